"""A whole run in the test's own process: `python batch_runner.py ...` as a function call.

Everything but the processes is the CLI's: its argument check, `trajgen.run`, the scheduler, the store,
the journal, the merge, and the workers' own conversation code (`trajgen.process_pool._Worker`) against
the loopback scripted server, with real sandboxes. Only the process pool is replaced, by `InlinePool`:
the workers' conversations on one event loop of this process. A run costs no interpreter, imports, fork
server or workers, so it takes a fraction of a second instead of about four.

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
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import pytest
from rich.console import Console

import batch_runner
from trajgen import console, store
from trajgen import run as run_module
from trajgen.messages import Event, without_landed_replies
from trajgen.process_pool import _Worker
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
    """The process pool's workers (`_Worker`, each its share of the concurrency) as conversations on one
    event loop, which runs while the scheduler polls: the same code, without processes or pipes."""

    def __init__(self, num_workers: int, config: WorkerConfig):
        self.num_workers, self.config = num_workers, config
        self.workers: list[_Worker] = []
        self.events: list[Event] = []

    def start(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.arrived = asyncio.Event()
        self.workers = [_Worker(self.config, self._send) for _ in range(self.num_workers)]

    def _send(self, event: Event) -> None:
        self.events.append(event)
        self.arrived.set()

    def _take(self) -> list[Event]:
        events, self.events = self.events, []
        return without_landed_replies(events)  # as a worker's outbox sends them

    @property
    def inflight(self) -> int:
        return sum(len(w.running) for w in self.workers)

    def submit(self, task: Task) -> None:
        worker = min(self.workers, key=lambda w: len(w.running))
        worker.running[task.key] = self.loop.create_task(worker.run_one(task))

    def poll(self, timeout: float) -> list[Event]:
        if not self.events:
            self.loop.run_until_complete(self._arrival(timeout))
        return self._take()

    async def _arrival(self, timeout: float) -> None:
        self.arrived.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.arrived.wait(), timeout)

    def cancel(self) -> list[Event]:
        self.loop.run_until_complete(self._cancel_all())
        return self._take()

    async def _cancel_all(self) -> None:
        await asyncio.gather(*(w.cancel_all() for w in self.workers))

    def kill(self) -> None:
        """Nothing runs between polls: leaving at once leaves nothing running."""

    def close(self) -> None:
        self.loop.run_until_complete(self._stop())
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()

    async def _stop(self) -> None:
        """What each worker does on Stop: its conversations cancelled, its connections closed."""
        await self._cancel_all()
        for w in self.workers:
            await w.endpoint.close()
