"""N calls of a side model after a run (--compress's summaries): concurrent, through the agent's client
(retries, rate limits, the --cache_dir cache), journaled so that a killed job resumes without paying
twice, counted, with a progress bar.

Each job is one request, keyed by `Job.key`: its reply is journaled under that key and the side
model's role, as a prompt's replies are (trajgen/journal.py), and replayed on the next invocation.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from trajgen import chat_calls, console, journal, store
from trajgen.errors import FatalAPIError
from trajgen.messages import Event, Notice, Replied
from trajgen.model import Metered, OpenAIModel, Reply
from trajgen.task import ModelSettings, Task


@dataclass(frozen=True, kw_only=True)
class Job:
    key: str
    messages: list[dict]
    response_format: dict | None = None


@dataclass
class SideStats:
    """What this invocation's calls paid (replayed replies apart)."""

    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float | None = None
    errors: int = 0
    replayed: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # job key -> the error, in one line


def _replays(journal_path: Path, role: str) -> dict[str, tuple[dict, ...]]:
    """The journal's replies of `role`, by job key."""
    found: dict[str, list[dict]] = {}
    if journal_path.exists():
        for entry in store.read_records(journal_path, []):
            if isinstance(entry, dict) and entry.get("role") == role and isinstance(entry.get("key"), str):
                found.setdefault(entry["key"], []).append(entry)
    return {key: tuple(entries) for key, entries in found.items()}


async def run_jobs(jobs: list[Job], *, settings: ModelSettings, journal_path: Path, concurrency: int,
                   cache_dir: str | None, on_done: Callable[[Job, Reply | Exception], None],
                   role: str = "summary") -> SideStats:
    """Every job's reply (or its error) to `on_done`, as each comes. An endpoint that refuses every call
    (FatalAPIError, EndpointUnreachable) stops them all: it is raised once the calls in flight ended."""
    stats = SideStats()
    endpoint = chat_calls.Endpoint(settings, concurrency)
    cache = journal.Cache(cache_dir, 1024.0) if cache_dir else None
    if cache:
        cache.open()
    replays = _replays(journal_path, role)
    out = store.AppendFile(journal_path)
    slots = asyncio.Semaphore(concurrency)
    fatal: list[FatalAPIError] = []

    def send(event: Event) -> None:
        if isinstance(event, Replied):
            out.append(journal.entry(event))
        elif isinstance(event, Notice):
            console.notice(event.text)

    async def one(job: Job, paid: Metered) -> None:
        async with slots:
            if fatal:
                return
            task = Task(job.key, 0, 0, "", None, None, {}, [], [], replay=replays.get(job.key, ()))
            job_settings = settings if job.response_format is None else replace(
                settings, extra_body={**settings.extra_body, "response_format": job.response_format})
            model = journal.JournalModel(paid, job_settings, task, send, cache, role)
            try:
                reply: Reply | Exception = await model.complete(job.messages, [], False)
            except FatalAPIError as e:
                fatal.append(e)
                return
            except Exception as e:  # this job's failure only: its caller keeps its row as it was
                reply = e
                stats.errors += 1
                stats.failed[job.key] = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            stats.replayed += model.replayed["turns"]
            stats.calls += model.turn - model.replayed["turns"]
            on_done(job, reply)
            done[0] += 1
            seconds = time.monotonic() - started
            bar.update(progress, advance=1, ok=done[0] - stats.errors, failed=stats.errors, rate=done[0] / seconds,
                       eta=console.eta(len(jobs) - done[0], done[0], seconds))

    paid = Metered(OpenAIModel(endpoint, settings, on_throttle=lambda: None))
    done, started = [0], time.monotonic()
    bar = console.progress_bar()
    progress = bar.add_task(f"{role} calls", total=len(jobs), ok=0, discarded=0, failed=0, rate=0.0, eta="?")
    try:
        with bar:
            await asyncio.gather(*(one(job, paid) for job in jobs))
    finally:
        out.sync()
        out.close()
        await endpoint.close()
        if cache:
            cache.trim()
    if fatal:
        raise fatal[0]
    stats.prompt_tokens, stats.completion_tokens = paid.usage["prompt_tokens"], paid.usage["completion_tokens"]
    stats.cost = paid.usage["cost"]
    return stats
