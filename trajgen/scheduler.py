"""The parent's loop: admit prompts one at a time, write each outcome as it arrives, checkpoint
as batches end, back off on 429s, stop cleanly on Ctrl-C, SIGTERM or SIGHUP, a fatal API error, a
failed health check or a spend limit."""
from __future__ import annotations

import os
import signal
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import islice
from pathlib import Path
from typing import Callable, Iterator, Protocol

import orjson

from trajgen import console, journal, store
from trajgen.errors import EndpointUnreachable, ImageUnavailable, RunStopped, WorkerCrashed
from trajgen.messages import STOP_SIGNALS, Event, Fatal, Finished, Log, Notice, Replied, Rerun, Retrying, Throttled
from trajgen.outcome import PromptOutcome, Status, decide
from trajgen.plan import Plan, needs_sandbox
from trajgen.task import Task

POLL_SECONDS = 0.2
PROMPT_EXCERPT = 200  # characters of a failed prompt's text in failures.jsonl


class Executor(Protocol):
    """Where prompts run: the process pool, or Ray actors; any executor with these methods fits."""

    inflight: int

    def start(self) -> None: ...
    def submit(self, task: Task) -> None: ...
    def poll(self, timeout: float) -> list[Event]: ...
    def cancel(self) -> list[Event]: ...
    def kill(self) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class Limits:
    run_name: str
    batch_size: int
    concurrency: int
    verbose: bool = False
    max_cost: float | None = None
    max_total_tokens: int | None = None
    health_check: Callable[[], str | None] | None = None  # a reason string stops the run like a fatal API error


@dataclass
class RunEnd:
    """How the loop ended; the exit status is decided from it."""

    failed: int = 0
    not_run: int = 0
    stopped_by: signal.Signals | None = None  # the signal that stopped the run
    fatal: str | None = None  # why the run could not go on (the endpoint, or the health check)
    unreachable: bool = False  # the fatal error is an endpoint that never answered this run: nothing was recorded failed
    budget: str | None = None  # which spend limit stopped the run: `--max_cost=0.5`
    paid_cost: float = 0.0  # what this invocation paid, prompts that finished after a stop included
    paid_tokens: int = 0


def _which(task: Task | None) -> dict:
    """Which prompt a failure record is about, for a person reading it: its dataset `id` and the
    start of its text."""
    if task is None:
        return {}
    excerpt = task.prompt if len(task.prompt) <= PROMPT_EXCERPT else task.prompt[:PROMPT_EXCERPT - 1] + "…"
    return {"id": task.extra.get("id"), "prompt": excerpt}


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def exit_status(sig: signal.Signals) -> int:
    """143 for SIGTERM, as a shell reports a process it ended; 130 for Ctrl-C and SIGHUP."""
    return 143 if sig == signal.SIGTERM else 130


class _Signals:
    """The first SIGINT, SIGTERM or SIGHUP stops cleanly; a second leaves at once (files are
    consistent at every moment). A SIGHUP ignored from the start (`nohup`) stays ignored."""

    def __init__(self, on_second: Callable[[signal.Signals], None]):
        self.first: signal.Signals | None = None
        self.on_second = on_second
        nohup = signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        self.previous = {sig: signal.signal(sig, self) for sig in STOP_SIGNALS if not (nohup and sig == signal.SIGHUP)}

    def __call__(self, signum, frame) -> None:
        if self.first is None:
            self.first = signal.Signals(signum)
        else:
            self.on_second(self.first)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def paid(usage: dict) -> tuple[float, int]:
    """What an invocation paid for one prompt (dollars, tokens), whatever its outcome (a failed
    prompt's replies were paid for too), less the replies a row replayed from the journal."""
    replayed = usage.get("replayed") or journal.empty_replayed()
    return ((usage.get("cost") or 0.0) - (replayed["cost"] or 0.0),
            usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
            - replayed["prompt_tokens"] - replayed["completion_tokens"])


class _Spend:
    """What this invocation paid, counted as each reply arrives (`replied`), so a limit stops the run
    within the replies in flight. An outcome (`landed`) adds only what its prompt paid beyond the replies
    already counted for it: those that travelled with it (messages.without_landed_replies) and a
    reply that failed its checks (never journaled); an outcome that does not carry its replies (a dead
    worker's) adds nothing."""

    def __init__(self, limits: Limits):
        self.limits, self.cost, self.tokens = limits, 0.0, 0
        self.seen: dict[str, tuple[float, int]] = {}  # per prompt in flight: its replies counted so far

    def replied(self, key: str, usage: dict) -> None:
        cost, tokens = paid(usage)
        self.cost += cost
        self.tokens += tokens
        seen_cost, seen_tokens = self.seen.get(key, (0.0, 0))
        self.seen[key] = (seen_cost + cost, seen_tokens + tokens)

    def landed(self, key: str, usage: dict) -> None:
        cost, tokens = paid(usage)
        seen_cost, seen_tokens = self.seen.pop(key, (0.0, 0))
        self.cost += max(0.0, cost - seen_cost)
        self.tokens += max(0, tokens - seen_tokens)

    def rerun(self, key: str) -> None:
        """The prompt starts again from its first turn, replaying the replies counted so far: its next
        outcome counts them as replayed, not paid."""
        self.seen.pop(key, None)

    def exceeded(self) -> str | None:
        """The limit reached, if one is."""
        s = self.limits
        if s.max_cost is not None and self.cost >= s.max_cost:
            return f"--max_cost={s.max_cost}"
        if s.max_total_tokens is not None and self.tokens >= s.max_total_tokens:
            return f"--max_total_tokens={s.max_total_tokens}"
        return None


class Scheduler:
    """One run of the plan on an executor. The only writer of the run directory while it runs."""

    def __init__(self, plan: Plan, pool: Executor, limits: Limits, run_dir: Path, missing_images: dict[str, str],
                 previous_seconds: float, started: float):
        self.plan, self.pool, self.limits, self.missing_images = plan, pool, limits, missing_images
        self.previous_seconds, self.started = previous_seconds, started
        self.writer = store.Writer(run_dir)
        self.end = RunEnd()
        self.counts: Counter = Counter()
        self.spend = _Spend(limits)
        self.left: dict[int, int] = {}  # batches started and not yet ended -> prompts still to come back
        self.batches = plan.batch_count(limits.batch_size)
        self.window = float(limits.concurrency)  # conversations admitted; halves on 429/503, grows back per answered prompt
        self.last_throttle = 0.0
        self.exhausted = False
        self.submitted: dict[str, Task] = {}  # in flight; recorded failed if a fatal stop cancels them
        self.retrying: dict[str, tuple[Retrying, float]] = {}  # prompts waiting to retry a call, and since when
        self.answered = False  # the endpoint has answered some worker in this run
        self.noticed: set[str] = set()  # the topics of the notices said

    def checkpoint(self) -> dict:
        return {
            "run_name": self.limits.run_name, "updated_at": now(), "next_batch": self.plan.first_batch + self.batches,
            "batches_open": sorted(self.left), "counts_this_invocation": dict(self.counts),
            "remaining_this_invocation": self.plan.remaining - sum(self.counts.values()),
            "duration_seconds_total": round(self.previous_seconds + time.monotonic() - self.started, 3),
        }

    def admit(self, tasks: Iterator[Task]) -> None:
        """Hand out prompts while the window has room; a prompt whose image is missing fails here."""
        while not self.exhausted and self.pool.inflight < int(self.window):
            task = next(tasks, None)
            if task is None:
                self.exhausted = True
                return
            if task.batch_num not in self.left:
                offset = (task.batch_num - self.plan.first_batch) * self.limits.batch_size
                self.left[task.batch_num] = min(self.limits.batch_size, self.plan.remaining - offset)
            if task.image in self.missing_images and needs_sandbox(task):
                self.record(decide(task, error=ImageUnavailable(f"image {task.image}: {self.missing_images[task.image]}")),
                            task)
            else:
                self.submitted[task.key] = task
                self.pool.submit(task)

    def record(self, outcome: PromptOutcome, task: Task | None = None) -> None:
        """Write one outcome; `task`, when it was never submitted (the submitted ones are known)."""
        task = self.submitted.pop(outcome.key, None) or task
        base = {"prompt_key": outcome.key, "prompt_index": outcome.prompt_index, "batch_num": outcome.batch_num}
        self.spend.landed(outcome.key, outcome.usage)
        self.writer.user_files(outcome.files)  # before the row that names them
        match outcome.status:  # rows arrive serialised by the worker and are written as they are
            case Status.OK:
                self.writer.row(outcome.batch_num, outcome.key, orjson.Fragment(outcome.row))
            case Status.DISCARDED:
                self.writer.discarded({**base, "reason": outcome.reason, "row": orjson.Fragment(outcome.row)})
            case Status.FAILED:
                trace = {"traceback": outcome.traceback} if outcome.traceback else {}
                self.writer.failed({**base, **_which(task), "error_class": outcome.reason, "message": outcome.message,
                                    "usage": outcome.usage, "time": now(), **trace})
                if self.limits.verbose:
                    console.err.print(f"prompt {outcome.prompt_index} failed: {outcome.reason}: {outcome.message}")
        self.counts[outcome.status.value] += 1
        self.left[outcome.batch_num] -= 1
        if self.left[outcome.batch_num] == 0:
            del self.left[outcome.batch_num]
            self.writer.end_batch(outcome.batch_num)
            self.writer.checkpoint(self.checkpoint())

    def handle(self, event: Event) -> None:
        match event:
            case Finished(outcome) if outcome.reason == EndpointUnreachable.__name__ and not self.answered:
                self.retrying.pop(outcome.key, None)  # not a failure of the prompt: it is still to run
            case Finished(outcome):
                self.retrying.pop(outcome.key, None)
                self.answered = self.answered or outcome.row is not None
                self.record(outcome)
                if outcome.row is not None:  # only an answer says the endpoint has recovered
                    self.window = min(float(self.limits.concurrency), self.window + 1)
            case Replied():
                self.retrying.pop(event.key, None)
                self.spend.replied(event.key, event.reply.usage)
                self.answered = True
                self.writer.journal(journal.entry(event))
            case Rerun(key):
                self.spend.rerun(key)
            case Retrying(key):
                self.retrying[key] = (event, time.monotonic())
            case Throttled() if time.monotonic() - self.last_throttle > 2.0:
                self.window, self.last_throttle = max(1.0, self.window / 2), time.monotonic()
            case Fatal(reason, unreachable):  # out of reach after answering another worker: an ordinary fatal stop
                self.end.unreachable = self.end.unreachable or (self.end.fatal is None and unreachable
                                                                and not self.answered)
                self.end.fatal = self.end.fatal or reason
            case Log(text):
                console.err.print(text)
            case Notice(topic, text) if topic not in self.noticed:
                self.noticed.add(topic)
                console.notice(text)

    def should_stop(self, signals: _Signals) -> bool:
        """Leave the loop at once on a signal, a spend limit (the prompts in flight are cancelled, so their
        streams close and the provider stops generating) or a fatal error; otherwise when all is back."""
        self.end.budget = self.end.budget or self.spend.exceeded()
        if self.end.fatal is None and self.limits.health_check is not None:
            self.end.fatal = self.limits.health_check()
        if signals.first is not None or self.end.fatal is not None or self.end.budget is not None:
            return True
        if self.writer.error is not None:  # the run directory cannot be written: stop as on a signal, close raises it
            return True
        return self.exhausted and self.pool.inflight == 0

    def execute(self, tasks: Iterator[Task], on_exit: Callable[[], None]) -> RunEnd:
        """Run the plan; `on_exit` removes sandboxes when a second Ctrl-C leaves at once."""
        signals = _Signals(lambda first: self.leave_now(first, on_exit))
        tasks = islice(tasks, self.plan.remaining)  # the plan as counted: a line added since waits for a resume
        self.pool.start()
        progress = console.progress_bar()
        bar = progress.add_task("prompts", total=self.plan.remaining, ok=0, discarded=0, failed=0, rate=0.0, eta="?")
        began = time.monotonic()
        try:
            with progress:
                while not self.should_stop(signals):
                    self.admit(tasks)
                    try:
                        events = self.pool.poll(POLL_SECONDS)
                    except WorkerCrashed as e:  # no worker left to run anything: a stop like a fatal endpoint error
                        events, self.end.fatal = [], str(e)
                    for event in events:
                        self.handle(event)
                    done = sum(self.counts.values())
                    progress.update(bar, completed=done, rate=done / max(1e-9, time.monotonic() - self.started),
                                    eta=console.eta(self.plan.remaining - done, done, time.monotonic() - began),
                                    **self.counts)
                    progress.status = self.status()
                if self.pool.inflight:
                    for event in self.pool.cancel():  # what was already on its way: outcomes, and replies paid for
                        if isinstance(event, (Finished, Replied)):
                            self.handle(event)
                if self.end.fatal and not self.end.unreachable:  # the prompts cut short fail: the statistics show them
                    for task in list(self.submitted.values()):
                        self.record(decide(task, error=RunStopped(self.end.fatal)))
        finally:
            self.pool.close()
            self.writer.close(self.checkpoint())
            signals.restore()
        self.end.stopped_by = signals.first
        self.end.paid_cost, self.end.paid_tokens = self.spend.cost, self.spend.tokens
        self.end.failed = self.counts["failed"]
        self.end.not_run = self.plan.remaining - sum(self.counts.values())
        return self.end

    def status(self) -> str:
        """The line under the progress bar: the prompts retrying a call (the latest cause, its retry and
        wait), and the prompts in flight."""
        line = f"{self.pool.inflight} in flight"
        if not self.retrying:
            return line
        event, since = max(self.retrying.values(), key=lambda pair: pair[1])
        left = max(0.0, event.wait - (time.monotonic() - since))
        return (f"{len(self.retrying)} retrying: {event.cause}, attempt {event.attempt}/{event.retries}, "
                f"next in {left:.0f} s; {line}")

    def leave_now(self, first: signal.Signals, on_exit: Callable[[], None]) -> None:
        self.pool.kill()
        self.writer.close(self.checkpoint())
        on_exit()
        console.stopped("\nstopped at once; resume with:", error=False)
        os._exit(exit_status(first))
