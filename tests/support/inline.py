"""A whole run in the test's own process: `python batch_runner.py ...` as a function call.

Everything but the processes is the CLI's: its argument check, `trajgen.run`, the scheduler, the store,
the journal, the merge, and the workers' own conversation code (`trajgen.worker.Worker`) against
the loopback scripted server, with real sandboxes. Only the process pool is replaced, by `InlinePool`:
the workers' conversations on one event loop in a thread of this process. A run costs no interpreter,
imports, fork server or workers, so it takes a fraction of a second instead of about four.

What a process would give each run is set up for the call and undone after it: the working directory,
the environment, `sys.argv`, stdout and stderr (and the consoles that print to them), and the run
directory's lock, which the kernel releases when a runner exits. TRAJGEN_DEBUG=1 in the environment
lets a bug's traceback reach pytest, where the CLI prints one line.
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import os
import queue
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator

import pytest
from rich.console import Console

import batch_runner
from trajgen import console, store
from trajgen import run as run_module
from trajgen.messages import Event, Finished
from trajgen.options import RunOptions
from trajgen.process_pool import _Outbox
from trajgen.worker import Worker
from trajgen.task import Task, WorkerConfig

ROOT = Path(__file__).resolve().parents[2]
SECRET_ENV = ("OPENROUTER_API_KEY", "OPENAI_API_KEY", "TERMINAL_ENV")


class Runs:
    """Runs in tmp_path with a clean environment: their flags (`args`) and run directories.
    conftest's CLI runs them as a subprocess, `Inline` below in this process."""

    def __init__(self, tmp_path: Path):
        self.cwd = tmp_path
        self.env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
        self.env["HOME"] = str(tmp_path / "home")
        (tmp_path / "home").mkdir(exist_ok=True)

    def args(self, server, run_name: str = "run", **flags) -> list[str]:
        base = {"dataset_file": "prompts.jsonl", "run_name": run_name, "base_url": server.url, "api_key": "dummy-key",
                "model": "test-model", "num_workers": 2, "concurrency": 8, "distribution": "terminal_only",
                "max_retries": 1}
        base.update(flags)
        return [f"--{k}={v}" if v is not True else f"--{k}" for k, v in base.items() if v is not None]

    def run_dir(self, run_name: str = "run") -> Path:
        return self.cwd / "data" / run_name

    def run_id(self, run_name: str = "run") -> str:
        """The run's identity, which labels its sandboxes: what a test looks for among the engine's."""
        return RunOptions(output_dir=str(self.cwd / "data"), run_name=run_name).run_id


class Inline(Runs):
    """`python batch_runner.py ...` in tmp_path, called in this process: `run` returns what
    conftest's `CLI.run` does, a CompletedProcess with the exit status and the output."""

    def run(self, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        stdout, stderr = io.StringIO(), io.StringIO()
        with pytest.MonkeyPatch.context() as process, _run_dir_locks_released(self.cwd.resolve()):
            process.chdir(self.cwd)
            environ = {**self.env, **(env or {})}
            for name in os.environ.keys() - environ.keys():
                process.delenv(name)
            for name, value in environ.items():
                process.setenv(name, value)
            process.setattr("sys.argv", [str(ROOT / "batch_runner.py"), *args])
            process.setattr("sys.stdout", stdout)
            process.setattr("sys.stderr", stderr)
            process.setattr(console, "out", Console(file=stdout, highlight=False))
            process.setattr(console, "err", Console(file=stderr, highlight=False))
            process.setattr(run_module, "ProcessPool", InlinePool)
            try:
                batch_runner.cli(list(args))
                code = 0
            except SystemExit as e:
                code = _exit_status(e, stderr)
        return subprocess.CompletedProcess(list(args), code, stdout.getvalue(), stderr.getvalue())


@pytest.fixture
def inline(tmp_path) -> Inline:
    return Inline(tmp_path)


@contextlib.contextmanager
def when(predicate: Callable[[], bool], action: Callable[[], None], timeout: float = 60) -> Iterator[None]:
    """Do `action` from another thread once `predicate` holds, while the body runs (a run in this
    process): what a test does to a CLI it started in the background. Fails if it never held."""
    leaving = threading.Event()

    def watch() -> bool:
        deadline = time.monotonic() + timeout
        while not leaving.is_set() and time.monotonic() < deadline:
            if predicate():
                action()
                return True
            leaving.wait(0.05)
        return False

    with ThreadPoolExecutor(1) as watcher:
        watching = watcher.submit(watch)
        try:
            yield
        finally:
            leaving.set()
        assert watching.result(), f"the condition never held within {timeout} s"


def interrupt() -> None:
    """Ctrl-C to this process: the run in it stops as the CLI does (the scheduler's handler takes it)."""
    os.kill(os.getpid(), signal.SIGINT)


@contextlib.contextmanager
def stopped_if_it_hangs(seconds: float = 120) -> Iterator[None]:
    """Ctrl-C to a run in this process that is still going after `seconds`: a hang shows as a run
    stopped by SIGINT (exit status 130), with its prompts in flight, instead of a test that never ends."""
    timer = threading.Timer(seconds, interrupt)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _exit_status(exit: SystemExit, stderr: io.StringIO) -> int:
    """The status the interpreter would exit with: sys.exit("text") prints the text and exits 1."""
    if exit.code is None or isinstance(exit.code, int):
        return exit.code or 0
    print(exit.code, file=stderr)
    return 1


@contextlib.contextmanager
def _run_dir_locks_released(under: Path) -> Iterator[None]:
    """Close the run directory locks under `under` that the body takes, as a runner's exit does: the
    next run may take them. A lock the test holds itself (another runner, say) stays held."""
    held = _run_dir_locks(under)
    try:
        yield
    finally:
        for fd, _ in _run_dir_locks(under).items() - held.items():
            os.close(fd)


def _run_dir_locks(under: Path) -> dict[int, Path]:
    """This process's open files of run directory locks under `under`, by fd."""
    locks = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd, gone already
            target = Path(os.readlink(f"/proc/self/fd/{fd}"))
            if target.name == store.LOCK and target.is_relative_to(under):
                locks[int(fd)] = target
    return locks


class InlinePool:
    """The process pool's workers (`Worker`, each its share of the concurrency, and its `_Outbox`) as
    conversations on one event loop in a thread of this process: they go on while the scheduler records,
    as worker processes do; a queue stands for the pipes."""

    def __init__(self, num_workers: int, config: WorkerConfig):
        self.num_workers, self.config = num_workers, config
        self.workers: dict[Worker, set[str]] = {}  # -> the keys of its prompts in flight
        self.submitted: dict[Worker, list[Task]] = {}  # handed over together at the next poll, as Submits are
        self.batches: queue.SimpleQueue[list[Event]] = queue.SimpleQueue()  # what the workers' outboxes send

    def start(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="inline-workers", daemon=True)
        self.thread.start()
        self.outboxes = [_Outbox(SimpleNamespace(send=self.batches.put)) for _ in range(self.num_workers)]
        self.workers = {Worker(self.config, outbox.send): set() for outbox in self.outboxes}

    def _in_loop(self, coroutine) -> None:
        asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    @property
    def inflight(self) -> int:
        return sum(len(keys) for keys in self.workers.values())

    def submit(self, task: Task) -> None:
        worker = min(self.workers, key=lambda w: len(self.workers[w]))
        self.workers[worker].add(task.key)
        self.submitted.setdefault(worker, []).append(task)

    @staticmethod
    def _start(worker: Worker, tasks: list[Task]) -> None:
        for task in tasks:
            worker.running[task.key] = asyncio.create_task(worker.run_one(task))

    def poll(self, timeout: float) -> list[Event]:
        for worker, tasks in self.submitted.items():
            self.loop.call_soon_threadsafe(self._start, worker, tasks)
        self.submitted = {}
        try:
            events = self.batches.get(timeout=timeout)
        except queue.Empty:
            return []
        return self._landed(events)

    def _landed(self, events: list[Event]) -> list[Event]:
        """`events` and every batch sent since; a finished prompt leaves flight."""
        while not self.batches.empty():
            events += self.batches.get()
        for event in events:
            if isinstance(event, Finished):
                for keys in self.workers.values():
                    keys.discard(event.outcome.key)
        return events

    def cancel(self) -> list[Event]:
        self.submitted = {}  # never started: nothing to cancel
        self._in_loop(self._cancel_all())
        for keys in self.workers.values():
            keys.clear()
        return self._landed([])

    async def _cancel_all(self) -> None:
        """Cancel every conversation, then send what they sent before it (a worker answers Cancel so)."""
        await asyncio.gather(*(w.cancel_all() for w in self.workers))
        for outbox in self.outboxes:
            outbox.flush()

    def kill(self) -> None:
        """Leaving at once ends this process, and with it these conversations."""

    def close(self) -> None:
        self._in_loop(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()

    async def _stop(self) -> None:
        """What each worker does on Stop (its conversations cancelled, its connections closed), then
        what asyncio.run does at the end of a worker."""
        await self._cancel_all()
        for w in self.workers:
            await w.endpoint.close()
        await self.loop.shutdown_asyncgens()
        await self.loop.shutdown_default_executor()
