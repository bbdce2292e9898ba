"""The plan: which samples this invocation runs, in which batches, with which toolsets.

Each prompt is run `samples` times (--samples_per_prompt). Sample 0 keeps the prompt's key, so
one sample per prompt is the run it always was; sample i gets `<key>~<i>`, its own identity for
resume, the journal and the cache, so raising the count on --resume adds only the new samples.
Streamed from the dataset twice: once to check and count (before the first request), once to run.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from trajgen.distributions import Distribution, sample_toolsets
from trajgen import dataset
from trajgen.task import Task

SANDBOX_TOOLSETS = ("terminal", "file")


@dataclass
class Plan:
    remaining: int = 0
    first_batch: int = 0
    sampled: Counter = field(default_factory=Counter)  # toolset -> prompts that sampled it
    images: Counter = field(default_factory=Counter)  # image -> prompts that will open a container with it
    rows_with_image: int = 0
    verified: int = 0  # samples with a verify command (each opens a sandbox, whatever its toolsets)
    with_user: int = 0  # samples whose row names a simulated user (trajgen/simulated_user.py)

    def batch_count(self, batch_size: int) -> int:
        return -(-self.remaining // batch_size)


def sample_key(key: str, index: int) -> str:
    return key if index == 0 else f"{key}~{index}"


def tasks(entries: Iterable[dataset.Entry], *, fingerprint: str, done: set[str], distribution: Distribution, seed: int,
          batch_size: int, first_batch: int, unavailable: dict[str, str],
          journal: dict[str, list[dict]], samples: int = 1, toolsets_per_sample: bool = False) -> Iterator[Task]:
    """Every sample of the keyed `entries` without a final record, in dataset order (a prompt's
    samples together), in consecutive batches of batch_size; each with its journaled replies
    (`journal`: sample key -> entries), which it replays. The toolsets are sampled once per
    prompt, so a group is comparable, unless `toolsets_per_sample`."""
    n = 0
    for entry in entries:
        extra = {**entry.extra, **({"image": entry.image} if entry.image else {}), **({"cwd": entry.cwd} if entry.cwd else {})}
        for index in range(samples):
            key = sample_key(entry.key, index)
            if key in done:
                continue
            sampled = sample_toolsets(distribution, seed, key if toolsets_per_sample else entry.key)
            yield Task(key=key, prompt_index=entry.index, batch_num=first_batch + n // batch_size,
                       prompt=entry.prompt, image=entry.image, cwd=entry.cwd, extra=extra, toolsets_sampled=sampled,
                       toolsets_offered=[t for t in sampled if t not in unavailable],
                       dataset_fingerprint=fingerprint, replay=tuple(journal.get(key, ())), verify=entry.verify,
                       sample_index=index, group_id=entry.key, user=entry.user)
            n += 1


def count(planned: Iterator[Task], first_batch: int, default_image: str | None) -> Plan:
    """default_image: the image of rows that name none, under a backend that runs images (else None)."""
    plan = Plan(first_batch=first_batch)
    for task in planned:
        plan.remaining += 1
        plan.sampled.update(task.toolsets_sampled)
        plan.rows_with_image += task.image is not None
        plan.verified += task.verify is not None
        plan.with_user += task.user is not None
        if default_image and needs_sandbox(task):
            plan.images[task.image or default_image] += 1
    return plan


def needs_sandbox(task: Task) -> bool:
    return task.verify is not None or any(t in SANDBOX_TOOLSETS for t in task.toolsets_offered)
