"""A small client of the Docker Engine API: the docker backend's calls without a `docker` process each.

A `docker exec` costs a Go binary's start (20-40 ms of CPU, 25 MB of memory) on top of the exec
itself; a terminal call needs none of it. This speaks HTTP/1.1 to the daemon over one byte
stream per request: the socket of a `unix://` or plain `tcp://` DOCKER_HOST, and for anything
else (ssh://, TLS, a docker context) the stdin and stdout of `docker system dial-stdio`, which
knows how to reach it, so one code path serves every engine. An exec's output comes on its
hijacked connection as the multiplexed raw stream: frames of an 8-byte header (stream, three
zero bytes, big-endian length) and the bytes. Every failure is one SandboxError line.
"""
from __future__ import annotations

import asyncio
import functools
import json
import os
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence
from urllib.parse import quote

from trajgen.sandbox import BackendUnreachable, SandboxError

DEFAULT_HOST = "unix:///var/run/docker.sock"
STDOUT, STDERR = 1, 2
HEADER = struct.Struct(">BxxxL")
EXITED_WAIT = 10.0  # seconds an exec may still be reported running once its output has ended
MESSAGE_CAP = 300  # characters of a daemon's error message we repeat
DIAL_EXIT_WAIT = 5.0  # seconds for `docker system dial-stdio` to exit (and say why) once its stream has ended


class EngineError(SandboxError):
    """The daemon answered a request with an error status (its `message`, one line)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Endpoint:
    """Where the daemon listens, as DOCKER_HOST and the docker CLI's configuration say."""

    shown: str  # for messages
    unix: str | None = None
    tcp: tuple[str, int] | None = None  # neither: through `docker system dial-stdio`


def endpoint() -> Endpoint:
    env = os.environ
    return _endpoint(env.get("DOCKER_HOST", ""), env.get("DOCKER_CONTEXT", ""),
                     bool(env.get("DOCKER_TLS_VERIFY") or env.get("DOCKER_TLS")),
                     env.get("DOCKER_CONFIG") or os.path.join(env.get("HOME", "/"), ".docker"))


@functools.cache
def _endpoint(host: str, context: str, tls: bool, config_dir: str) -> Endpoint:
    if not host and not context:  # the CLI configuration's current context, if one was chosen
        try:
            context = str(json.loads(Path(config_dir, "config.json").read_text()).get("currentContext") or "")
        except (OSError, ValueError, AttributeError):
            pass
    if not host and context in ("", "default"):
        host = DEFAULT_HOST
    if host.startswith("unix://"):
        return Endpoint(host, unix=host.removeprefix("unix://"))
    if host.startswith("tcp://") and not tls:
        name, _, port = host.removeprefix("tcp://").partition("/")[0].rpartition(":")
        if name and port.isdigit():
            return Endpoint(host, tcp=(name.strip("[]"), int(port)))
    return Endpoint(host or f"docker context {context}")


class _Connection:
    """One byte stream to the daemon: a socket, or a dial-stdio process's pipes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 proc: asyncio.subprocess.Process | None) -> None:
        self.reader, self.writer, self._proc = reader, writer, proc

    def close(self) -> None:
        self.writer.close()
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()

    async def lost(self, where: Endpoint) -> BackendUnreachable:
        """Why the daemon's end closed: dial-stdio's last error line if it said one."""
        why = "it closed the connection"
        if self._proc is not None:
            try:
                await asyncio.wait_for(self._proc.wait(), DIAL_EXIT_WAIT)
            except TimeoutError:
                self._proc.kill()
            lines = (await self._proc.stderr.read()).decode("utf-8", "replace").strip().splitlines()
            why = lines[-1] if lines else why
        return BackendUnreachable(f"cannot talk to the Docker engine at {where.shown}: {why}")


def docker_env() -> dict[str, str]:
    """What the docker CLI needs (DOCKER_HOST, its config), and none of the runner's other variables."""
    return {k: v for k, v in os.environ.items() if k.startswith("DOCKER_") or k in ("PATH", "HOME")}


async def _connect(where: Endpoint) -> _Connection:
    try:
        if where.unix is not None:
            return _Connection(*await asyncio.open_unix_connection(where.unix), None)
        if where.tcp is not None:
            return _Connection(*await asyncio.open_connection(*where.tcp), None)
    except OSError as e:
        raise BackendUnreachable(f"cannot reach the Docker engine at {where.shown}: {e.strerror or e}") from None
    try:
        proc = await asyncio.create_subprocess_exec(
            "docker", "system", "dial-stdio", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=docker_env(),
        )
    except OSError as e:
        raise BackendUnreachable(f"cannot run `docker system dial-stdio` to reach {where.shown}: {e.strerror or e}") from None
    return _Connection(proc.stdout, proc.stdin, proc)


_versions: dict[Endpoint, str] = {}  # the API version each engine speaks, asked once per process


async def _prefix(where: Endpoint) -> str:
    """`/v<the engine's API version>`: every call we make means the same in all of them since 1.24."""
    if where not in _versions:
        _, body = await _exchange(where, "GET", "/version")
        _versions[where] = str(body.get("ApiVersion") or "1.41")
    return f"/v{_versions[where]}"


def _request(method: str, path: str, body: Any, upgrade: bool) -> bytes:
    data = b"" if body is None else json.dumps(body).encode()
    connection = "Upgrade\r\nUpgrade: tcp" if upgrade else "close"
    return (f"{method} {path} HTTP/1.1\r\nHost: docker\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: {connection}\r\n\r\n").encode() + data


async def _head(conn: _Connection, where: Endpoint) -> tuple[int, dict[str, str]]:
    """The status and headers of the daemon's answer."""
    try:
        head = await conn.reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
        raise await conn.lost(where) from None
    status_line, *lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(status_line.split()[1])
    except (IndexError, ValueError):
        raise SandboxError(f"the Docker engine at {where.shown} answered something that is not HTTP") from None
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def _body(conn: _Connection, where: Endpoint, headers: dict[str, str]) -> bytes:
    try:
        return await _read_body(conn.reader, headers)
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, OSError):
        raise await conn.lost(where) from None


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "chunked" in headers.get("transfer-encoding", ""):
        data = bytearray()
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            data += await reader.readexactly(size + 2)
            del data[-2:]
        return bytes(data)
    if (length := headers.get("content-length")) is not None:
        return await reader.readexactly(int(length))
    return await reader.read()


def _error(status: int, body: bytes) -> EngineError:
    try:
        message = str(json.loads(body).get("message"))
    except (ValueError, AttributeError):
        message = body.decode("utf-8", "replace")
    line = " ".join(message.split())[:MESSAGE_CAP] or f"HTTP status {status}"
    return EngineError(status, line)


async def _exchange(where: Endpoint, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One request on a connection of its own: (status, the decoded JSON answer or None)."""
    conn = await _connect(where)
    try:
        conn.writer.write(_request(method, path, body, upgrade=False))
        status, headers = await _head(conn, where)
        data = await _body(conn, where, headers)
    finally:
        conn.close()
    if status >= 400:
        raise _error(status, data)
    try:
        return status, json.loads(data) if data.strip() else None
    except ValueError:
        raise SandboxError(f"the Docker engine at {where.shown} answered {path} with something that is not JSON") from None


async def call(method: str, path: str, body: Any = None, **query: Any) -> Any:
    """One API call (path without the version); the decoded answer, or EngineError with the daemon's message."""
    where = endpoint()
    if query:
        path += "?" + "&".join(f"{k}={quote(v if isinstance(v, str) else json.dumps(v), safe='')}" for k, v in query.items())
    return (await _exchange(where, method, await _prefix(where) + path, body))[1]


class Exec:
    """A started exec: its input, its output frames as they come, then its exit code. Close it in every case."""

    def __init__(self, where: Endpoint, exec_id: str, conn: _Connection) -> None:
        self._where, self.id, self._conn = where, exec_id, conn
        self.writer = conn.writer  # the command's stdin, if it was attached
        self._held = b""

    async def frame(self) -> tuple[int, bytes] | None:
        """The next (stream, bytes), or None once the command and everything holding its output have ended."""
        reader = self._conn.reader
        try:
            header = await reader.readexactly(HEADER.size)
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                return None
            raise await self._conn.lost(self._where) from None
        except OSError:
            raise await self._conn.lost(self._where) from None
        stream, size = HEADER.unpack(header)
        try:
            return stream, await reader.readexactly(size)
        except (asyncio.IncompleteReadError, OSError):
            raise await self._conn.lost(self._where) from None

    async def send(self, data: bytes) -> None:
        """All of the command's input, then its end of file; its output still comes back."""
        try:
            self.writer.write(data)
            await self.writer.drain()
            self.writer.write_eof()
        except OSError:
            raise await self._conn.lost(self._where) from None

    async def frames(self) -> AsyncIterator[tuple[int, bytes]]:
        while frame := await self.frame():
            yield frame

    async def read(self, n: int) -> bytes:
        """Up to n bytes of its stdout (its stderr left out), b"" at the end: the exec as a byte stream."""
        while not self._held:
            frame = await self.frame()
            if frame is None:
                return b""
            if frame[0] == STDOUT:
                self._held = frame[1]
        data, self._held = self._held[:n], self._held[n:]
        return data

    async def exit_code(self) -> int | None:
        """The exit code once the daemon has seen the exit (it may lag the end of the output a little)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + EXITED_WAIT
        while True:
            state = await call("GET", f"/exec/{self.id}/json")
            if not state.get("Running") or loop.time() > deadline:
                return state.get("ExitCode")
            await asyncio.sleep(0.01)

    def close(self) -> None:
        self._conn.close()


async def run_exec(container: str, user: str, argv: Sequence[str], on_output: Callable[[int, bytes], None],
                   stdin: bytes | None = None) -> int | None:
    """Run argv in the container to its end, `stdin` its whole input, each output frame to `on_output`: its exit code."""
    ex = await start_exec(container, user, argv, stdin=stdin is not None)
    try:
        if stdin is not None:
            await ex.send(stdin)
        async for stream, data in ex.frames():
            on_output(stream, data)
        return await ex.exit_code()
    finally:
        ex.close()


async def start_exec(container: str, user: str, argv: Sequence[str], stdin: bool = False) -> Exec:
    """Start argv in the container as `user`, with its stdin attached (Exec.writer) if asked."""
    where = endpoint()
    created = await call("POST", f"/containers/{container}/exec", {
        "User": user, "Cmd": list(argv), "AttachStdin": stdin, "AttachStdout": True, "AttachStderr": True, "Tty": False,
    })
    conn = await _connect(where)
    try:
        conn.writer.write(_request("POST", f"{await _prefix(where)}/exec/{created['Id']}/start",
                                   {"Detach": False, "Tty": False}, upgrade=True))
        status, headers = await _head(conn, where)
        if status not in (101, 200):
            raise _error(status, await _body(conn, where, headers))
    except BaseException:
        conn.close()
        raise
    return Exec(where, created["Id"], conn)
