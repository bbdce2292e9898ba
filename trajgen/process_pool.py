"""The process pool: worker processes, each an asyncio loop holding many conversations.

The parent hands out one prompt at a time (`submit`) and reads events back (`poll`): only the
messages of trajgen/messages.py cross the boundary, so the Ray executor runs the same worker
(trajgen/worker.py). Workers print nothing (logs travel to the parent, which owns the terminal) and never write
the run directory: even the files tools make for the user travel home in the outcome.
"""
from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import os
import signal
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from trajgen import fork_server
from trajgen.errors import WorkerCrashed
from trajgen.messages import STOP_SIGNALS, Cancel, Cancelled, Event, Finished, Stop, Submit, without_landed_replies
from trajgen.outcome import decide
from trajgen.sandbox.backends import prepare_worker
from trajgen.task import Task, WorkerConfig
from trajgen.worker import Worker


class _Outbox:
    """A worker's events, sent together once per turn of its event loop: one pickle and one pipe
    write for all of them, not one per event. Every pipe message, both ways, is a list."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.pending: list[Event] = []

    def send(self, event: Event) -> None:
        if not self.pending:
            asyncio.get_running_loop().call_soon(self.flush)
        self.pending.append(event)

    def flush(self) -> None:
        if self.pending:
            events, self.pending = self.pending, []
            try:
                self.conn.send(without_landed_replies(events))
            except OSError:  # the parent is gone; the reader thread's EOF stops this worker
                pass


def _wait_for_the_parent(signum, frame) -> None:
    """Ctrl-C and a SIGTERM or SIGHUP to the process group are the parent's to act on: it cancels
    this worker's prompts. A handler, not SIG_IGN: the sandboxes' processes start with the default."""


def _worker_main(conn: Connection, config: WorkerConfig, environ: dict[str, str]) -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, _wait_for_the_parent)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked since the fork (fork_server.start)
    os.environ.clear()  # the fork server's environment is its start's; a library user may have changed it since
    os.environ.update(environ)
    prepare_worker(config.sandbox)
    outbox = _Outbox(conn)
    asyncio.run(Worker(config, outbox.send).serve(conn))
    outbox.flush()


@dataclass
class _Handle:
    process: mp.Process
    conn: Connection
    inflight: dict[str, Task] = field(default_factory=dict)
    outbox: list[Submit] = field(default_factory=list)  # sent together at the next poll


class ProcessPool:
    """`num_workers` processes; each holds up to its share of the run's concurrency."""

    def __init__(self, num_workers: int, config: WorkerConfig):
        self.num_workers = num_workers
        self.config = config
        self.workers: list[_Handle] = []

    def start(self) -> None:
        self.workers = [self._spawn() for _ in range(self.num_workers)]

    def _spawn(self) -> _Handle:
        parent_end, child_end = fork_server.CONTEXT.Pipe()
        process = fork_server.CONTEXT.Process(target=_worker_main, args=(child_end, self.config, dict(os.environ)),
                                              daemon=True)
        fork_server.start()
        process.start()
        child_end.close()
        return _Handle(process, parent_end)

    @property
    def inflight(self) -> int:
        return sum(len(w.inflight) for w in self.workers)

    def submit(self, task: Task) -> None:
        worker = min(self.workers, key=lambda w: len(w.inflight))
        worker.inflight[task.key] = task
        worker.outbox.append(Submit(task))

    def _send(self, worker: _Handle, *messages: Submit | Cancel | Stop) -> None:
        """The submitted prompts, then `messages`, in one pipe message."""
        batch, worker.outbox = [*worker.outbox, *messages], []
        if batch:
            worker.conn.send(batch)

    def poll(self, timeout: float) -> list[Event]:
        """Messages from the workers; a dead worker's prompts come back as failed and it is replaced."""
        for w in self.workers:
            try:
                self._send(w)
            except OSError:  # a dead worker: found below
                pass
        conns = {w.conn: w for w in self.workers}
        sentinels = {w.process.sentinel: w for w in self.workers}
        messages: list[Event] = []
        for ready in wait([*conns, *sentinels], timeout):
            worker = conns.get(ready) or sentinels[ready]
            if ready in conns:
                try:
                    while worker.conn.poll():
                        for message in worker.conn.recv():
                            if isinstance(message, Finished):
                                worker.inflight.pop(message.outcome.key, None)
                            messages.append(message)
                except (EOFError, OSError):
                    pass
            if not worker.process.is_alive() and worker in self.workers:
                messages.extend(self._replace(worker))
        return messages

    def _replace(self, worker: _Handle) -> list[Event]:
        self.workers.remove(worker)
        worker.conn.close()
        self.workers.append(self._spawn())
        died = WorkerCrashed(f"worker process died (exit code {worker.process.exitcode})")
        return [Finished(decide(t, error=died)) for t in worker.inflight.values()]

    def cancel(self, timeout: float = 10.0) -> list[Event]:
        """Cancel every conversation in flight (their sandboxes are closed); results that were
        already on their way are returned so that no finished prompt is lost."""
        waiting = {}
        for w in self.workers:
            try:
                self._send(w, Cancel())
                waiting[w.conn] = w
            except OSError:  # a dead worker: its prompts are not recorded, resume runs them
                w.inflight.clear()
        arrived: list[Event] = []
        while waiting:
            ready = wait(list(waiting), timeout)
            if not ready:
                break
            for conn in ready:
                try:
                    batch = conn.recv()
                except (EOFError, OSError):
                    batch = [Cancelled()]
                for message in batch:
                    if isinstance(message, Cancelled):
                        waiting.pop(conn).inflight.clear()
                    else:
                        arrived.append(message)
        return arrived

    def kill(self) -> None:
        """Leave at once: the workers die, and with them (die-with-parent) their sandboxes' processes."""
        for w in self.workers:
            w.process.kill()

    def close(self) -> None:
        for w in self.workers:
            try:
                self._send(w, Stop())
            except OSError:
                pass
        for w in self.workers:
            w.process.join(timeout=10)
            if w.process.is_alive():
                w.process.kill()


def worker_share(concurrency: int, num_workers: int) -> int:
    return max(1, math.ceil(concurrency / num_workers))
