"""Side-model calls made after a run (--rescore's judge, --compress's summarizer): N requests at once,
each journaled as it is paid for, so that a killed job done again replays what it had and pays only
for the rest, through the agent's client (retries, rate limits, --cache_dir), counted, within the
spend limits, with a progress bar.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from trajgen import chat_calls, console, journal, store
from trajgen.errors import FatalAPIError
from trajgen.messages import Event, Notice, Replied
from trajgen.model import Metered, OpenAIModel, Reply, add_usage, no_usage
from trajgen.task import ModelSettings, Task


@dataclass(frozen=True, kw_only=True)
class Job:
    key: str  # its identity in the journal and the cache: a job asked again with the same messages replays
    messages: list[dict]
    response_format: dict | None = None


@dataclass
class SideStats:
    calls: int = 0  # paid for by this invocation
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float | None = None
    errors: int = 0
    replayed: int = 0  # answered by the journal or the cache, not paid again
    not_run: int = 0  # left when a spend limit was reached


async def run_jobs(jobs: list[Job], *, settings: ModelSettings, journal_path: Path, concurrency: int,
                   cache_dir: str | None, on_done: Callable[[Job, Reply | Exception], None], role: str,
                   max_cost: float | None = None, max_total_tokens: int | None = None,
                   cache_max_mb: float = 1024.0) -> SideStats:
    """Each job's reply (or the error that ended it) to `on_done`, in the order they finish. An endpoint
    that refuses every call or cannot be reached raises FatalAPIError at once; what was paid stays journaled."""
    replay: dict[str, list[dict]] = {}
    for entry in store.read_records(journal_path, []):
        replay.setdefault(entry.get("key"), []).append(entry)
    endpoint = chat_calls.Endpoint(settings, concurrency)
    cache = journal.Cache(cache_dir, cache_max_mb) if cache_dir else None
    if cache:
        cache.open()
    journaled, stats, paid = store.AppendFile(journal_path), SideStats(), no_usage()
    slots = asyncio.Semaphore(concurrency)

    def send(event: Event) -> None:
        if isinstance(event, Replied):
            journaled.append(journal.entry(event))
        elif isinstance(event, Notice):
            console.notice(event.text)

    def over() -> bool:
        tokens = paid["prompt_tokens"] + paid["completion_tokens"]
        return ((max_cost is not None and (paid["cost"] or 0.0) >= max_cost)
                or (max_total_tokens is not None and tokens >= max_total_tokens))

    async def one(job: Job) -> None:
        async with slots:
            if over():
                stats.not_run += 1
                return
            asked = replace(settings, extra_body={**settings.extra_body, "response_format": job.response_format}) \
                if job.response_format else settings
            task = Task(key=job.key, prompt_index=0, batch_num=0, prompt="", image=None, cwd=None, extra={},
                        toolsets_sampled=[], toolsets_offered=[], replay=tuple(replay.get(job.key, ())))
            metered = Metered(OpenAIModel(endpoint, asked, on_throttle=lambda: None))
            model = journal.JournalModel(metered, asked, task, send, cache, role)
            try:
                result: Reply | Exception = await model.complete(job.messages, [], False)
            except FatalAPIError:
                raise
            except Exception as e:  # this job's failure, said through on_done
                result = e
                stats.errors += 1
            stats.replayed += model.replayed["turns"]
            stats.calls += model.turn - model.replayed["turns"]
            add_usage(paid, metered.usage)
            on_done(job, result)
            done["failed" if isinstance(result, Exception) else "ok"] += 1
            progress.update(bar, advance=1, **done)

    progress = console.progress_bar()
    bar = progress.add_task(f"{role} calls", total=len(jobs), rate=0.0, ok=0, discarded=0, failed=0, eta="-")
    done = {"ok": 0, "failed": 0}
    try:
        with progress:
            tasks = [asyncio.create_task(one(job)) for job in jobs]
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        journaled.sync()
        journaled.close()
        await endpoint.close()
        if cache:
            cache.trim()
    stats.prompt_tokens, stats.completion_tokens, stats.cost = paid["prompt_tokens"], paid["completion_tokens"], paid["cost"]
    return stats
