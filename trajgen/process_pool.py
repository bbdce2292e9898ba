"""The process pool: worker processes, each an asyncio loop holding many conversations.

The parent hands out one prompt at a time (`submit`) and reads events back (`poll`): only the
messages of trajgen/messages.py cross the boundary, so the Ray executor reuses the worker as it
is. Workers print nothing (logs travel to the parent, which owns the terminal) and never write
the run directory: even the files tools make for the user travel home in the outcome.
"""
from __future__ import annotations

import asyncio
import contextvars
import math
import multiprocessing as mp
import os
import signal
import threading
from dataclasses import dataclass, field
from multiprocessing import forkserver, resource_tracker
from multiprocessing.connection import Connection, wait
from typing import Callable

from trajgen import agent, chat_calls, journal, registry, verify
from trajgen.errors import APITimeoutError, EndpointUnreachable, FatalAPIError, PromptTimeout, WorkerCrashed
from trajgen.messages import (STOP_SIGNALS, Cancel, Cancelled, Event, Fatal, Finished, Log, Retrying, Stop, Submit, Throttled,
                              without_landed_replies)
from trajgen.model import Metered, OpenAIModel
from trajgen.outcome import PromptOutcome, decide
from trajgen.sandbox import Sandbox
from trajgen.sandbox.backends import open_sandbox
from trajgen.tools import ToolContext, ToolSpec
from trajgen.task import Task, WorkerConfig

_PROMPT: contextvars.ContextVar[str] = contextvars.ContextVar("prompt")  # the key of the prompt a call is made for


class _Prompt:
    """One prompt's lazily opened sandbox and the cleanups its tools registered."""

    def __init__(self, task: Task, config: WorkerConfig):
        self.task, self.config = task, config
        self.sandbox: Sandbox | None = None
        self.ctx = ToolContext(sandbox=self.get_sandbox, command_timeout=config.sandbox.command_timeout,
                               settings=config.tools)

    async def get_sandbox(self) -> Sandbox:
        if self.sandbox is None:
            self.sandbox = await asyncio.to_thread(
                open_sandbox, self.config.sandbox, self.task.key, self.task.image, self.task.cwd
            )
        return self.sandbox

    async def close(self) -> None:
        closers = [c() for c in self.ctx.cleanups]
        if self.sandbox is not None:
            closers.append(self.sandbox.close())
        await asyncio.shield(asyncio.gather(*closers, return_exceptions=True))


class _Worker:
    """A worker's conversations. `send` carries its events out: the pipe here, a Ray actor's
    outbox in trajgen/ray_executor.py, which reuses `run_one` as it is."""

    def __init__(self, config: WorkerConfig, send: Callable[[Event], None]):
        self.config, self.send = config, send
        self.endpoint = chat_calls.Endpoint(config.model, config.concurrency)
        self.cache = journal.Cache(config.cache_dir, config.cache_max_mb) if config.cache_dir else None
        self.schemas: dict[tuple[str, ...], tuple[list[ToolSpec], list[dict]]] = {}
        self.running: dict[str, asyncio.Task] = {}

    def tools_for(self, toolsets: list[str]) -> tuple[list[ToolSpec], list[dict]]:
        """Schemas are built once per toolset combination, not per prompt."""
        combo = tuple(toolsets)
        if combo not in self.schemas:
            tools = registry.offered_tools(toolsets, self.config.unavailable_tools, self.config.mcp_tools)
            self.schemas[combo] = (tools, [t.schema() for t in tools])
        return self.schemas[combo]

    def retrying(self, error: Exception, attempt: int, retries: int, wait: float) -> None:
        """Tell the parent that the current prompt's call waits for a retry, and why."""
        status = chat_calls.status_of(error)
        cause = (f"HTTP {status}" if status is not None else "timeout" if isinstance(error, APITimeoutError)
                 else "connection error")
        self.send(Retrying(_PROMPT.get(""), cause, attempt, retries, wait))

    async def run_one(self, task: Task) -> None:
        """Run one prompt to its outcome and send it; a fatal endpoint error also stops the run. Every
        prompt sent here ends with a Finished: an error nobody foresaw fails it, never leaves it in flight."""
        _PROMPT.set(task.key)  # this prompt's own asyncio task: its context is its own
        prompt = _Prompt(task, self.config)
        try:
            outcome = await self._converse(task, prompt)
        except Exception as e:  # _converse decides its own errors: this is a bug in deciding one
            outcome = decide(task, error=e)
        finally:
            await prompt.close()
            self.running.pop(task.key, None)
        if outcome.reason == FatalAPIError.__name__:
            self.send(Fatal(outcome.message))
        elif outcome.reason == EndpointUnreachable.__name__:
            self.send(Fatal(f"--base_url={self.config.model.base_url} cannot be reached: {outcome.message}", True))
        elif outcome.traceback and self.config.verbose:
            self.send(Log(f"{task.key}: {outcome.traceback}"))
        self.send(Finished(outcome))

    async def _converse(self, task: Task, prompt: _Prompt) -> PromptOutcome:
        """The conversation, its row, its check and its outcome: an error at any of these steps fails
        the prompt with what it paid (resume retries it)."""
        endpoint = OpenAIModel(self.endpoint, self.config.model, on_throttle=lambda: self.send(Throttled()),
                               on_retry=self.retrying)
        paid = Metered(endpoint)  # what this attempt paid, so a failed prompt still counts it
        deadline = asyncio.timeout(self.config.model.prompt_timeout)
        try:
            tools, schemas = self.tools_for(task.toolsets_offered)
            model = journal.JournalModel(paid, self.config.model, task, self.send, self.cache)
            async with deadline:
                conversation = await agent.run_conversation(task.prompt, model, self.config.model, tools,
                                                            schemas, prompt.ctx)
            row = agent.render_row(task, conversation, self.config.model, tuple(t.name for t in self.config.mcp_tools))
            row["metadata"]["usage"]["replayed"] = model.replayed  # counted in the usage, not paid again
            row["metadata"]["usage"]["stalls"] = endpoint.stalls  # calls abandoned for silence and asked again
            row["verify"] = (await self._verify(task, conversation, prompt)).as_row()
            return decide(task, row=row, files=prompt.ctx.files)
        except TimeoutError as e:
            if not deadline.expired():  # a timeout inside the conversation is that error, not the prompt's deadline
                return decide(task, error=e, usage={**paid.usage, "stalls": endpoint.stalls})
            timeout = PromptTimeout(f"prompt ran past --prompt_timeout={self.config.model.prompt_timeout}s")
            return decide(task, error=timeout, usage={**paid.usage, "stalls": endpoint.stalls})
        except Exception as e:  # any other error fails this prompt only, with its traceback if nobody foresaw it
            return decide(task, error=e, usage={**paid.usage, "stalls": endpoint.stalls})

    async def _verify(self, task: Task, conversation: agent.Conversation, prompt: _Prompt) -> verify.Check:
        """Every finished conversation is checked, a discarded one too (the statistics count every
        sample the model finished); not journaled: a resumed sample is checked again."""
        if task.verify is None:
            return verify.UNVERIFIED
        return await verify.run(task.verify, agent.final_answer(conversation), prompt.get_sandbox,
                                self.config.verify_timeout)

    async def serve(self, conn: Connection) -> None:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()

        def deliver(messages: list) -> None:
            for message in messages:
                inbox.put_nowait(message)

        def read() -> None:  # blocking pipe reads stay off the event loop
            while True:
                try:
                    messages = conn.recv()
                except (EOFError, OSError):
                    messages = [Stop()]
                loop.call_soon_threadsafe(deliver, messages)
                if any(isinstance(m, Stop) for m in messages):
                    return

        threading.Thread(target=read, daemon=True).start()
        while True:
            match await inbox.get():
                case Submit(task):
                    self.running[task.key] = asyncio.create_task(self.run_one(task))
                case Cancel():
                    await self.cancel_all()
                    self.send(Cancelled())
                case Stop():
                    await self.cancel_all()
                    break
        await self.endpoint.close()

    async def cancel_all(self) -> None:
        pending = list(self.running.values())
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


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


def _start_fork_server() -> None:
    """Start the workers' fork server unless it runs, with the stop signals blocked, which it keeps
    and its workers inherit until they have their handlers: a signal to the process group is the
    parent's to act on. No signal to this process is lost: it is delivered once the mask is back."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        resource_tracker.ensure_running()  # unblocks SIGINT and SIGTERM on its way out: block them again
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _wait_for_the_parent(signum, frame) -> None:
    """Ctrl-C and a SIGTERM or SIGHUP to the process group are the parent's to act on: it cancels
    this worker's prompts. A handler, not SIG_IGN: the sandboxes' processes start with the default."""


def _worker_main(conn: Connection, config: WorkerConfig, environ: dict[str, str]) -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, _wait_for_the_parent)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked since the fork (_start_fork_server)
    os.environ.clear()  # the fork server's environment is its start's; a library user may have changed it since
    os.environ.update(environ)
    outbox = _Outbox(conn)
    asyncio.run(_Worker(config, outbox.send).serve(conn))
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
        self.ctx = mp.get_context("forkserver")  # imports the workers' modules once; each worker forks ready
        self.ctx.set_forkserver_preload(["__main__", "trajgen.process_pool"])
        self.workers: list[_Handle] = []

    def start(self) -> None:
        self.workers = [self._spawn() for _ in range(self.num_workers)]

    def _spawn(self) -> _Handle:
        parent_end, child_end = self.ctx.Pipe()
        process = self.ctx.Process(target=_worker_main, args=(child_end, self.config, dict(os.environ)), daemon=True)
        _start_fork_server()
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
