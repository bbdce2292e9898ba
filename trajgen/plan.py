"""The plan: which prompts this invocation runs, in which batches, with which toolsets.

Streamed from the dataset twice: once to count (before the first request), once to run.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

from trajgen.distributions import Distribution, sample_toolsets
from trajgen import dataset
from trajgen.work import Task

SANDBOX_TOOLSETS = ("terminal", "file")


@dataclass
class Plan:
    remaining: int = 0
    first_batch: int = 0
    sampled: Counter = field(default_factory=Counter)  # toolset -> prompts that sampled it
    images: Counter = field(default_factory=Counter)  # image -> prompts that will open a container with it
    rows_with_image: int = 0

    def batch_count(self, batch_size: int) -> int:
        return -(-self.remaining // batch_size)


def tasks(path: str, check: dataset.DatasetCheck, done: set[str], distribution: Distribution, seed: int,
          batch_size: int, max_samples: int | None, first_batch: int, unavailable: dict[str, str],
          journal: dict[str, list[dict]]) -> Iterator[Task]:
    """Every prompt without a final record, in dataset order, in consecutive batches of batch_size;
    each with its journaled replies (`journal`: prompt key -> entries), which it replays."""
    n = 0
    for entry in dataset.entries(path, check.duplicates, max_samples):
        if entry.key in done:
            continue
        sampled = sample_toolsets(distribution, seed, entry.key)
        extra = {**entry.extra, **({"image": entry.image} if entry.image else {}), **({"cwd": entry.cwd} if entry.cwd else {})}
        yield Task(entry.key, entry.index, first_batch + n // batch_size, entry.prompt, entry.image, entry.cwd,
                   extra, sampled, [t for t in sampled if t not in unavailable], check.fingerprint,
                   tuple(journal.get(entry.key, ())))
        n += 1


def count(planned: Iterator[Task], first_batch: int, docker_image: str | None) -> Plan:
    """docker_image: the default image under the docker backend (None under local)."""
    plan = Plan(first_batch=first_batch)
    for task in planned:
        plan.remaining += 1
        plan.sampled.update(task.toolsets_sampled)
        plan.rows_with_image += task.image is not None
        if docker_image and needs_sandbox(task):
            plan.images[task.image or docker_image] += 1
    return plan


def needs_sandbox(task: Task) -> bool:
    return any(t in SANDBOX_TOOLSETS for t in task.toolsets_offered)
