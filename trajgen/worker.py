"""One worker's conversations: each prompt run to its outcome in its own asyncio task.

Any executor runs these as they are: the process pool (trajgen/process_pool.py) in forked processes, the
Ray actors (trajgen/ray_executor.py), and the tests in their own process (tests/support/inline.py). The
worker only sends events (`send`); it never writes the run directory.
"""
from __future__ import annotations

import asyncio
import contextvars
import threading
from multiprocessing.connection import Connection
from typing import Callable

from trajgen import agent, chat_calls, journal, judge, registry, rewards, roles, simulated_user, token_ids, tokenizer, verify
from trajgen.errors import APITimeoutError, EndpointUnreachable, FatalAPIError, PromptTimeout, SideEndpointUnreachable
from trajgen.messages import Cancel, Cancelled, Event, Fatal, Finished, Log, Retrying, Stop, Submit, Throttled
from trajgen.model import Metered, OpenAIModel
from trajgen.outcome import PromptOutcome, decide
from trajgen.plan import needs_sandbox
from trajgen.sandbox import Sandbox, SandboxError
from trajgen.sandbox.backends import open_sandbox
from trajgen.tools import ToolContext, ToolSpec
from trajgen.task import ModelSettings, Task, WorkerConfig

_PROMPT: contextvars.ContextVar[str] = contextvars.ContextVar("prompt")  # the key of the prompt a call is made for


class _Prompt:
    """One prompt's sandbox, opened at its first use or started ahead, and the cleanups its tools registered."""

    def __init__(self, task: Task, config: WorkerConfig):
        self.task, self.config = task, config
        self.opening: asyncio.Future[Sandbox] | None = None  # shared: a caller's cancellation must not lose the sandbox
        self.side: dict[str, roles.SideModel] = {}  # the side models this prompt asked, by role
        self.ctx = ToolContext(sandbox=self.get_sandbox, command_timeout=config.sandbox.command_timeout,
                               settings=config.tools)

    async def get_sandbox(self) -> Sandbox:
        """The prompt's sandbox, once started if it was started ahead; an opening that failed is tried again."""
        if self.opening is None or (self.opening.done() and self.opening.exception() is not None):
            self.opening = asyncio.ensure_future(self._open(start=False))
        return await asyncio.shield(self.opening)

    def start_ahead(self) -> None:
        """Open and start the sandbox while the prompt's first model call runs, so that its start-up is
        off the prompt's path."""
        self.opening = asyncio.ensure_future(self._open(start=True))

    async def _open(self, start: bool) -> Sandbox:
        sandbox = await asyncio.to_thread(open_sandbox, self.config.sandbox, self.task.key, self.task.image,
                                          self.task.cwd)
        if start:
            try:
                await sandbox.start()
            except SandboxError:  # its first command starts it again, and says why it cannot
                pass
        return sandbox

    async def close(self) -> None:
        closers = [c() for c in self.ctx.cleanups]
        if self.opening is not None:
            closers.append(self._close_sandbox())
        await asyncio.gather(*closers, return_exceptions=True)

    async def _close_sandbox(self) -> None:
        await (await self.opening).close()  # one being opened or started is closed once it is


class Worker:
    """A worker's conversations. `send` carries its events out: the process pool's pipe, or a Ray
    actor's outbox in trajgen/ray_executor.py, which reuses `run_one` as it is."""

    def __init__(self, config: WorkerConfig, send: Callable[[Event], None]):
        self.config, self.send = config, send
        self.endpoint = chat_calls.Endpoint(config.model, config.concurrency)
        self.endpoints = {(config.model.base_url, config.model.api_key): self.endpoint}  # side models' too
        self.cache = journal.Cache(config.cache_dir, config.cache_max_mb) if config.cache_dir else None
        self.schemas: dict[tuple[str, ...], tuple[list[ToolSpec], list[dict]]] = {}
        self.running: dict[str, asyncio.Task] = {}
        self.closing: set[asyncio.Task] = set()  # prompts' sandboxes closing after their outcome went out

    def tools_for(self, toolsets: list[str]) -> tuple[list[ToolSpec], list[dict]]:
        """Schemas are built once per toolset combination, not per prompt."""
        combo = tuple(toolsets)
        if combo not in self.schemas:
            tools = registry.offered_tools(toolsets, self.config.unavailable_tools, self.config.mcp_tools)
            self.schemas[combo] = (tools, [t.schema() for t in tools])
        return self.schemas[combo]

    def side_model(self, prompt: _Prompt, role: str, settings: ModelSettings) -> journal.JournalModel:
        """The prompt's model for `role` (trajgen/roles.py), on the worker's pool for its endpoint."""
        if role not in prompt.side:
            endpoint = self.endpoints.setdefault((settings.base_url, settings.api_key),
                                                 chat_calls.Endpoint(settings, self.config.concurrency))
            paid = Metered(roles.Named(OpenAIModel(endpoint, settings, on_throttle=lambda: self.send(Throttled()),
                                                   on_retry=self.retrying), role, settings))
            model = journal.JournalModel(paid, settings, prompt.task, self.send, self.cache, role)
            prompt.side[role] = roles.SideModel(model, paid)
        return prompt.side[role].model

    def retrying(self, error: Exception, attempt: int, retries: int, wait: float) -> None:
        """Tell the parent that the current prompt's call waits for a retry, and why."""
        status = chat_calls.status_of(error)
        cause = (f"HTTP {status}" if status is not None else "timeout" if isinstance(error, APITimeoutError)
                 else "connection error")
        self.send(Retrying(_PROMPT.get(""), cause, attempt, retries, wait))

    async def run_one(self, task: Task) -> None:
        """Run one prompt to its outcome and send it; a fatal endpoint error also stops the run. Every
        prompt sent here ends with a Finished: an error nobody foresaw fails it, never leaves it in flight.
        Its sandbox closes after that, off the prompt's path; cancel_all waits for it."""
        _PROMPT.set(task.key)  # this prompt's own asyncio task: its context is its own
        prompt = _Prompt(task, self.config)
        if needs_sandbox(task):
            prompt.start_ahead()
        try:
            outcome = await self._converse(task, prompt)
        except Exception as e:  # _converse decides its own errors: this is a bug in deciding one
            outcome = decide(task, error=e)
        finally:
            self.running.pop(task.key, None)
            closing = asyncio.create_task(prompt.close())
            self.closing.add(closing)
            closing.add_done_callback(self.closing.discard)
        if outcome.reason == FatalAPIError.__name__:
            self.send(Fatal(outcome.message))
        elif outcome.reason == SideEndpointUnreachable.__name__:
            self.send(Fatal(outcome.message, True))
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
            journaled = journal.JournalModel(paid, self.config.model, task, self.send, self.cache)
            model = (token_ids.Retokenizing(journaled, tokenizer.load(self.config.model.tokenizer))
                     if self.config.model.tokenizer else journaled)
            async with deadline:
                summary = self.config.summary
                conversation = await agent.run_conversation(
                    task.prompt, model, self.config.model, tools, schemas, prompt.ctx, self._simulator(task, prompt),
                    summary and (lambda: self.side_model(prompt, "summary", summary)))
            check = await self._verify(task, conversation, prompt)
            row = agent.render_row(task, conversation, self.config.model, tuple(t.name for t in self.config.mcp_tools),
                                   replayed=journaled.replayed, stalls=endpoint.stalls, check=check)
            if (judging := self.config.judge) is not None:  # the judge reads the rendered row
                row.update(await judge.judge(self.side_model(prompt, "judge", judging.settings), judging, row))
            row["reward"] = rewards.chosen(row, self.config.reward_from)
            if prompt.side:  # known once the judge has answered
                row["metadata"]["side_usage"] = roles.side_usage(prompt.side)
            return decide(task, row=row, usage=roles.prompt_usage(row["metadata"]), files=prompt.ctx.files)
        except TimeoutError as e:
            if not deadline.expired():  # a timeout inside the conversation is that error, not the prompt's deadline
                return decide(task, error=e, usage={**roles.paid(paid, prompt.side), "stalls": endpoint.stalls})
            timeout = PromptTimeout(f"prompt ran past --prompt_timeout={self.config.model.prompt_timeout}s")
            return decide(task, error=timeout, usage={**roles.paid(paid, prompt.side), "stalls": endpoint.stalls})
        except Exception as e:  # any other error fails this prompt only, with its traceback if nobody foresaw it
            return decide(task, error=e, usage={**roles.paid(paid, prompt.side), "stalls": endpoint.stalls})

    def _simulator(self, task: Task, prompt: _Prompt) -> simulated_user.Simulator | None:
        """The episode's simulated user: for rows with a `user` field, or every row with --user_for_all."""
        user = self.config.user
        if user is None or not (task.user or user.for_all):
            return None
        return simulated_user.Simulator(self.side_model(prompt, "user", user.settings), task.user, user.max_turns,
                                        user.settings.model)

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
        for endpoint in self.endpoints.values():
            await endpoint.close()

    async def cancel_all(self) -> None:
        """Cancel every prompt in flight and wait until every sandbox is closed."""
        pending = list(self.running.values())
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.gather(*self.closing)
