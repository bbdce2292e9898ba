"""The parent's loop: admit prompts one at a time, write each result as it arrives, checkpoint
as batches end, back off on 429s, stop cleanly on Ctrl-C, a fatal API error or a spend limit."""
from __future__ import annotations

import os
import signal
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Protocol

from trajgen import console, store
from trajgen.errors import ImageUnavailable
from trajgen.plan import Plan, needs_sandbox
from trajgen.work import Result, Task


class Executor(Protocol):
    """Where prompts run: the process pool here; any executor with these methods fits."""

    inflight: int

    def start(self) -> None: ...
    def submit(self, task: Task) -> None: ...
    def poll(self, timeout: float) -> list[tuple]: ...
    def cancel(self) -> list[tuple]: ...
    def kill(self) -> None: ...
    def close(self) -> None: ...


@dataclass
class Schedule:
    run_name: str
    batch_size: int
    concurrency: int
    require_reasoning: bool = True
    verbose: bool = False
    max_cost: float | None = None
    max_total_tokens: int | None = None


@dataclass
class Outcome:
    failed: int = 0
    not_run: int = 0
    interrupted: bool = False
    fatal: str | None = None
    budget: str | None = None  # which spend limit stopped the run


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class _Signals:
    """First Ctrl-C/SIGTERM: stop cleanly. Second: leave at once (files are consistent at every moment)."""

    def __init__(self, on_second):
        self.count = 0
        self.on_second = on_second
        self.previous = {sig: signal.signal(sig, self) for sig in (signal.SIGINT, signal.SIGTERM)}

    def __call__(self, signum, frame) -> None:
        self.count += 1
        if self.count > 1:
            self.on_second()

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class _Spend:
    def __init__(self, schedule: Schedule):
        self.schedule, self.cost, self.tokens = schedule, 0.0, 0

    def add(self, row: dict) -> None:
        usage = row["metadata"]["usage"]
        self.cost += usage.get("cost") or 0.0
        self.tokens += usage["prompt_tokens"] + usage["completion_tokens"]

    def exceeded(self) -> str | None:
        s = self.schedule
        if s.max_cost is not None and self.cost >= s.max_cost:
            return f"--max_cost={s.max_cost} reached (${self.cost:.4f} spent)"
        if s.max_total_tokens is not None and self.tokens >= s.max_total_tokens:
            return f"--max_total_tokens={s.max_total_tokens} reached ({self.tokens} tokens)"
        return None


def execute(tasks: Iterator[Task], plan: Plan, pool: Executor, schedule: Schedule, run_dir: Path,
            missing_images: dict[str, str], previous_seconds: float, started: float, on_exit) -> Outcome:
    """Run the plan on `pool`; `on_exit` removes sandboxes when a second Ctrl-C leaves at once."""
    outcome = Outcome()
    writer = store.Writer(run_dir)
    counts: Counter = Counter()
    spend = _Spend(schedule)
    left: dict[int, int] = {}  # batches started and not yet ended -> prompts still to come back
    batches = plan.batch_count(schedule.batch_size)
    window = float(schedule.concurrency)  # conversations admitted; halves on 429/503, grows back per answered prompt
    last_throttle = 0.0

    def checkpoint() -> dict:
        return {
            "run_name": schedule.run_name, "updated_at": now(), "next_batch": plan.first_batch + batches,
            "batches_open": sorted(left), "counts_this_invocation": dict(counts),
            "remaining_this_invocation": plan.remaining - sum(counts.values()),
            "duration_seconds_total": round(previous_seconds + time.monotonic() - started, 3),
        }

    def start(task: Task) -> None:
        if task.batch_num not in left:
            offset = (task.batch_num - plan.first_batch) * schedule.batch_size
            left[task.batch_num] = min(schedule.batch_size, plan.remaining - offset)

    def record(result: Result) -> None:
        base = {"prompt_key": result.key, "prompt_index": result.prompt_index, "batch_num": result.batch_num}
        if result.row is not None:
            spend.add(result.row)
            if schedule.require_reasoning and not result.row["metadata"]["turns_with_reasoning"]:
                writer.discarded({**base, "reason": "no_reasoning", "row": result.row})
                counts["discarded"] += 1
            else:
                writer.row(result.batch_num, result.row)
                counts["ok"] += 1
        else:
            writer.failed({**base, "error_class": result.error_class, "message": result.message, "time": now()})
            counts["failed"] += 1
            if schedule.verbose:
                console.err.print(f"prompt {result.prompt_index} failed: {result.error_class}: {result.message}")
        left[result.batch_num] -= 1
        if left[result.batch_num] == 0:
            del left[result.batch_num]
            writer.end_batch(result.batch_num)
            writer.checkpoint(checkpoint())

    def leave_now() -> None:
        pool.kill()
        writer.close(checkpoint())
        on_exit()
        console.err.print(f"\nstopped at once; resume with:\n  {console.resume_command()}")
        os._exit(130)

    signals = _Signals(leave_now)
    pool.start()
    exhausted = False
    progress = console.progress_bar()
    bar = progress.add_task("prompts", total=plan.remaining, ok=0, discarded=0, failed=0, rate=0.0)
    try:
        with progress:
            while True:
                outcome.budget = outcome.budget or spend.exceeded()
                stopping = signals.count > 0 or outcome.fatal is not None
                while not (stopping or outcome.budget or exhausted) and pool.inflight < int(window):
                    task = next(tasks, None)
                    if task is None:
                        exhausted = True
                    elif task.image in missing_images and needs_sandbox(task):
                        start(task)
                        record(Result(task.key, task.prompt_index, task.batch_num, error_class=ImageUnavailable.__name__,
                                      message=f"image {task.image}: {missing_images[task.image]}"))
                    else:
                        start(task)
                        pool.submit(task)
                if stopping or ((exhausted or outcome.budget) and pool.inflight == 0):
                    break
                for message in pool.poll(0.2):
                    kind = message[0]
                    if kind == "result":
                        record(message[1])
                        if message[1].row is not None:  # only an answer says the endpoint has recovered
                            window = min(float(schedule.concurrency), window + 1)
                    elif kind == "throttle" and time.monotonic() - last_throttle > 2.0:
                        window, last_throttle = max(1.0, window / 2), time.monotonic()
                    elif kind == "fatal":
                        outcome.fatal = outcome.fatal or message[1]
                    elif kind == "log":
                        console.err.print(message[1])
                done = sum(counts.values())
                progress.update(bar, completed=done, rate=done / max(1e-9, time.monotonic() - started), **counts)
            if pool.inflight:
                for message in pool.cancel():
                    if message[0] == "result":
                        record(message[1])
    finally:
        pool.close()
        writer.close(checkpoint())
        signals.restore()
    outcome.interrupted = signals.count > 0
    outcome.failed = counts["failed"]
    outcome.not_run = plan.remaining - sum(counts.values())
    return outcome
