"""MCP servers as toolsets: the probe that reads their tools, and one session per prompt.

A `command` server runs inside the prompt's sandbox (sandbox/stdio.py), started at the prompt's
first call of one of its tools and ended with the prompt; its stdout is split into messages here,
each bounded before it is parsed (the SDK's own stdio reader holds a line whole, at quadratic cost).
A `url` server is shared and reached over streamable HTTP (SSE where the probe finds only that),
with the config's headers. Every fault of a server becomes its call's failed result, and the next
call starts the server again. The SDK speaks the protocol.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import re
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import AsyncIterator, Callable

import anyio
import httpx2
import mcp_types
import orjson
from mcp import ClientSession
from mcp.client.sse import sse_client
from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from mcp_types import CONNECTION_CLOSED

from trajgen import trajectory
from trajgen.sandbox import Sandbox, SandboxConfig, SandboxError
from trajgen.sandbox import stdio
from trajgen.sandbox.backends import check_images, open_sandbox
from trajgen.sandbox.process import OUTPUT_CAP
from trajgen.tools import ToolContext, ToolSpec
from trajgen.tools.mcp_config import Server, ServerFailed
from trajgen.tools.netguard import check_url

BLOCKS_CAP = 4 << 20  # bytes of a result's non-text blocks (images...) a row may keep
MESSAGE_CAP = 8 << 20  # bytes of one message from a stdio server: BLOCKS_CAP in base64 and room for the rest
CLOSING = 2 * stdio.GRACE + 1  # seconds a session whose connection closed may take to end and say why

# the SDK logs a server's misbehaviour with tracebacks; here it becomes the call's failed result
logging.getLogger("mcp").addHandler(logging.NullHandler())
logging.getLogger("mcp").propagate = False


class _Fault(Exception):
    """The server failed a call (exited, hung, broke the protocol): the call fails, the server restarts."""


class _Refused(_Fault):
    """The server answered the call with an error (an unknown tool, bad arguments): the call fails, the server stays."""


class _TooLarge(_Fault):
    """A stdio server sent a message longer than MESSAGE_CAP: it is not read further, and restarts."""


class _Lines:
    """A stdio server's stdout split into lines as it comes, each byte scanned once; _TooLarge as soon as
    a line is longer than MESSAGE_CAP, so no more than that is ever held."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list[bytes]:
        start = len(self._buffer)
        self._buffer += chunk
        lines = []
        while (end := self._buffer.find(b"\n", start)) >= 0:
            lines.append(bytes(self._buffer[:end]))
            del self._buffer[:end + 1]  # O(1): a bytearray drops its head by moving its start
            start = 0
        if max(map(len, lines), default=0) > MESSAGE_CAP or len(self._buffer) > MESSAGE_CAP:
            raise _TooLarge(f"the server sent a message of more than {MESSAGE_CAP >> 20} MB, the cap on one message")
        return lines


class _Session:
    """One server's session, held by a task of its own: the SDK's contexts must be entered and
    left in one task, while calls come from the conversation's."""

    def __init__(self, streams: Callable[[], AsyncIterator], stderr: stdio.Tail | None) -> None:
        self.stderr = stderr
        self._ready: asyncio.Future[ClientSession] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._hold(streams))

    async def _hold(self, streams) -> None:
        """Until stopped, or until the server's side of the transport closes (it exited): then the
        next call finds the session ended and starts the server again."""
        try:
            async with streams() as (read, write), anyio.create_task_group() as relays:
                relay_in, relay_out = anyio.create_memory_object_stream(0)
                closed = anyio.Event()

                async def relay() -> None:
                    async with relay_in:
                        async for message in read:
                            await relay_in.send(message)
                    closed.set()

                relays.start_soon(relay)
                async with ClientSession(relay_out, write) as session:
                    await session.initialize()
                    self._ready.set_result(session)
                    await closed.wait()
                relays.cancel_scope.cancel()
        except Exception as e:
            if not self._ready.done():
                self._ready.set_exception(e)
            raise

    def ended(self) -> bool:
        return self._task.done()

    async def run(self, request, timeout: float):
        """`request(session)`'s result, within `timeout` seconds that include starting the server; _Fault else."""
        call = asyncio.ensure_future(self._call(request))
        try:
            done, _ = await asyncio.wait({call, self._task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:  # a hung call, and one whose prompt was cancelled (its deadline), end here
            if not call.done():
                call.cancel()
        if call in done:
            return call.result()
        if not done:
            raise _Fault(f"no answer within {timeout:g} s")
        error = None if self._task.cancelled() else _sole(self._task.exception())
        if isinstance(error, _Fault):
            raise error
        raise _Fault(f"the server ended ({self.stderr_tail() or (_describe(error) if error else 'no reason given')})")

    async def _call(self, request):
        try:
            return await request(await asyncio.shield(self._ready))
        except MCPError as e:
            if e.code != CONNECTION_CLOSED:
                raise _Refused(f"error {e.code}: {e.message}") from e
            raise await self._closed(e) from e
        except Exception as e:  # the protocol's errors (McpError), a closed connection, a refused start...
            raise _Fault(self.stderr_tail() or _describe(e)) from e

    async def _closed(self, error: MCPError) -> _Fault:
        """Why the connection closed: the session's own fault once it has ended (a message too large), else
        the server's last words."""
        await asyncio.wait({self._task}, timeout=CLOSING)
        ended = _sole(self._task.exception()) if self._task.done() and not self._task.cancelled() else None
        return ended if isinstance(ended, _Fault) else _Fault(self.stderr_tail() or _describe(error))

    def stderr_tail(self) -> str | None:
        """The server's last line of stderr: why it could not start, usually."""
        return self.stderr.line() if self.stderr else None

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def _sole(error: BaseException | None) -> BaseException | None:
    """The error inside groups of one (task groups wrap what ends them)."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def _describe(error: BaseException) -> str:
    """One line: an HTTP status says what to do about a refusal; anything else is named with its text."""
    error = _sole(error)
    if isinstance(error, httpx2.HTTPStatusError):
        status = error.response.status_code
        hint = '; pass its token through "headers" (an OAuth sign-in cannot run in a batch)' if status in (401, 403) else ""
        return f"HTTP {status} {error.response.reason_phrase} from {error.request.url}{hint}"
    text = " ".join(str(error).split())
    if isinstance(error, SandboxError) and text:  # ours, already a sentence
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


FIXES = (  # what a server's last words usually mean, and what to do about it
    (re.compile(r"No module named '?([\w.]+)"), "install the package of {0} into the Python that \"command\" "
     "names, or name the Python (or venv) that has it"),
    (re.compile(r"[Nn]ot found in the cache|[Nn]etwork connectivity is disabled|ENOTCACHED|offline|EAI_AGAIN|"
                r"ENOTFOUND|ENETUNREACH|[Nn]ame resolution"),
     "the sandbox has no network: have the server on this machine beforehand (uvx: run it here once, which fills "
     "uv's cache; npx: npm install it and give node its script, docs/mcp.md), or pass --sandbox_network"),
    (re.compile(r"[Rr]ead-only file system|EROFS"), "what the config names is shown read-only: let the server write in "
     "its working dir or /tmp"),
    (re.compile(r"No such file or directory|can't open file|ENOENT|not found"),
     "check that the path exists on this machine: the sandbox shows the system dirs and, read-only, what the "
     "config's command, args and cwd name that exists, by its absolute path"),
)


def _fix(text: str) -> str:
    """`; FIX` for a start that failed in a way a config can mend, else nothing."""
    for pattern, fix in FIXES:
        if found := pattern.search(text):
            return "; " + fix.format(*found.groups())
    return ""


@asynccontextmanager
async def _stdio(server: Server, sandbox: Sandbox, stderr: stdio.Tail) -> AsyncIterator:
    """The session's streams of the SDK's messages with `server` run inside `sandbox`, in its work dir:
    one message per line each way, as the SDK's stdio transport frames them, none longer than MESSAGE_CAP."""
    from_server, read = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write, to_server = anyio.create_memory_object_stream[SessionMessage](0)
    async with stdio.pipes(sandbox, [server.command, *server.args], dict(server.env), stderr, server.cwd) as pipes:

        async def receive() -> None:
            lines = _Lines()
            async with from_server:
                async for chunk in pipes.stdout:
                    for line in lines.feed(chunk):
                        if line.strip():
                            try:
                                message = SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(
                                    line, by_name=False))
                            except ValueError as e:  # not a message (a stray print): the session ignores it
                                message = e
                            await from_server.send(message)

        async def send() -> None:
            async with to_server:
                async for message in to_server:
                    await pipes.write(message.message.model_dump_json(by_alias=True, exclude_unset=True).encode()
                                      + b"\n")

        async with anyio.create_task_group() as tasks:
            for task in (receive, send):
                tasks.start_soon(task)
            try:
                yield read, write
            finally:
                tasks.cancel_scope.cancel()


def _open(server: Server, get_sandbox: Callable, allow_private: bool) -> _Session:
    if server.url:
        @asynccontextmanager
        async def streams() -> AsyncIterator:
            if refused := await check_url(server.url, allow_private):
                raise SandboxError(refused)
            headers = dict(server.headers)
            if server.sse:
                async with sse_client(server.url, headers=headers) as pair:
                    yield pair
            else:
                async with create_mcp_http_client(headers=headers) as client, \
                        streamable_http_client(server.url, http_client=client) as pair:
                    yield pair
        return _Session(streams, None)
    stderr = stdio.Tail()

    @asynccontextmanager
    async def in_sandbox() -> AsyncIterator:
        async with _stdio(server, await get_sandbox(), stderr) as pair:
            yield pair
    return _Session(in_sandbox, stderr)


async def call_tool(server: Server, tool: str, ctx: ToolContext, /, **arguments) -> dict:
    """One call of `server`'s `tool` in this prompt's session of it, started at the first call."""
    sessions: dict[str, _Session] | None = ctx.state.get("mcp")
    if sessions is None:
        sessions = ctx.state["mcp"] = {}
        ctx.cleanups.append(functools.partial(_stop_all, sessions))
    session = sessions.get(server.name)
    if session is None or session.ended():
        if session is not None:
            await session.stop()
        session = sessions[server.name] = _open(server, ctx.sandbox, ctx.settings.allow_private_urls)
    try:
        result = await session.run(lambda s: s.call_tool(tool, arguments), ctx.settings.tool_timeout)
    except _Refused as e:
        return {"success": False, "error": f"MCP server {server.name}: {e}"}
    except _Fault as e:
        await session.stop()
        sessions.pop(server.name, None)
        return {"success": False, "error": f"MCP server {server.name}: {e}; it starts again at the next call"}
    return render(result)


async def _stop_all(sessions: dict[str, _Session]) -> None:
    await asyncio.gather(*(s.stop() for s in sessions.values()))


def render(result) -> dict:
    """A tool result as a row stores it: its text, and a line naming each block that is not text,
    for the model and ShareGPT; those blocks as the SDK gives them, in the row only
    (trajectory.BLOCKS); any structured content. Past a cap, a failure."""
    text = "\n".join(block.text for block in result.content if block.type == "text")
    others = [block.model_dump(mode="json", by_alias=True, exclude_none=True)
              for block in result.content if block.type != "text"]
    rendered = [*([text] if text else []), *(_block_text(b) for b in others)]
    out = {"output": "\n".join(rendered), "success": not result.is_error,
           "error": (text or "the tool reported an error") if result.is_error else None}
    if result.structured_content is not None:
        out["structured_content"] = result.structured_content
    for part, size, cap in (("result", len(orjson.dumps(out)), OUTPUT_CAP),
                            ("non-text content", len(orjson.dumps(others)), BLOCKS_CAP)):
        if size > cap:
            return {"success": False, "error": f"the {part} is {size} bytes, more than the cap of {cap}"}
    return {**out, trajectory.BLOCKS: others} if others else out


def _block_text(block: dict) -> str:
    """A line naming a block that is not text (its bytes stay in `content`)."""
    if block["type"] == "resource":
        resource = block["resource"]
        return resource.get("text") or f"[resource {resource.get('uri')} ({resource.get('mimeType', 'binary')})]"
    if block["type"] == "resource_link":
        return f"[resource link {block.get('uri')}]"
    return f"[{block['type']} ({block.get('mimeType', 'unknown type')})]"


async def probe(servers: tuple[Server, ...], sandbox: SandboxConfig, timeout: float,
                allow_private: bool) -> list[ToolSpec]:
    """Each server's tools, read once from an instance of its own; ServerFailed naming the first
    server that cannot start or list them."""
    return [tool for server in servers for tool in await _probe_one(server, sandbox, timeout, allow_private)]


async def _probe_one(server: Server, config: SandboxConfig, timeout: float, allow_private: bool) -> list[ToolSpec]:
    opened: list[Sandbox] = []

    async def get_sandbox() -> Sandbox:
        """A sandbox of --docker_image, built or pulled first where the backend runs images: sandboxes never do."""
        if not opened:
            if reason := (await check_images([config.docker_image], config)).get(config.docker_image):
                raise SandboxError(f"image {config.docker_image} is unavailable: {reason}")
            opened.append(await asyncio.to_thread(open_sandbox, config, f"mcp-probe-{server.name}"))
        return opened[0]

    async def listing(s: ClientSession) -> list:
        tools, cursor = [], None
        while True:
            page = await s.list_tools(params={"cursor": cursor} if cursor else None)
            tools += page.tools
            if not (cursor := page.next_cursor):
                return tools

    attempts = [server, replace(server, sse=True)] if server.url and not server.sse else [server]
    try:
        for attempt in attempts:
            session = _open(attempt, get_sandbox, allow_private)
            try:
                tools = await session.run(listing, timeout)
                break
            except _Fault as e:
                if attempt is attempts[-1]:
                    raise ServerFailed(f"MCP server {server.name} cannot start or list its tools: {e}{_fix(str(e))}") \
                        from None
            finally:
                await session.stop()
    finally:
        for s in opened:
            await s.close()
    return [ToolSpec(t.name, server.name, t.description or "", t.input_schema,
                     functools.partial(call_tool, attempt, t.name)) for t in tools]
