"""The Docker SDK for Python driven from asyncio: its calls in threads, an exec's output read by a thread of its own.

The engine is the one the docker CLI would reach: DOCKER_HOST (unix, tcp, TLS per DOCKER_TLS_VERIFY
and DOCKER_CERT_PATH, ssh through the `ssh` command), else DOCKER_CONTEXT or the current context of
the CLI's config.json. An exec's output comes as the SDK's multiplexed frames: (stream, bytes).
Every failure is one SandboxError line; an engine we cannot reach is BackendUnreachable.
"""
from __future__ import annotations

import asyncio
import functools
import ipaddress
import os
import socket
import threading
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

import docker
import requests
from docker.context import ContextAPI
from docker.utils.socket import SocketError, next_frame_header, read_exactly

from trajgen.sandbox import BackendUnreachable, SandboxError

DEFAULT_HOST = "unix:///var/run/docker.sock"
STDOUT = 1  # the stream number of stdout in an exec's frames
EXITED_WAIT = 10.0  # seconds an exec may still be reported running once its output has ended
MESSAGE_CAP = 300  # characters of a daemon's error message we repeat
CALL_THREADS = 32  # engine calls at once (the default executor has cores + 4 threads, shared)
FRAMES_AHEAD = 16  # output frames read ahead of the event loop: the command waits beyond that
# The SDK hands over the exec's raw socket, past the buffer its HTTP client read the answer's headers
# into: output that came with them would be lost (docker/docker-py#3332). So the command waits for a
# line on its stdin, sent once the headers are read.
GATE = ("sh", "-c", 'read -r _ && exec "$@"', "sh")


class EngineError(SandboxError):
    """The daemon answered a request with an error status (its `message`, one line)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


ENGINE_ENV = ("DOCKER_HOST", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH", "DOCKER_CONTEXT", "DOCKER_CONFIG", "HOME")


@dataclass(frozen=True)
class Engine:
    shown: str  # for messages
    api: docker.APIClient


def engine() -> Engine:
    """The engine the environment names, its client made once (it asks the engine's API version)."""
    return _engine(tuple(os.environ.get(name) for name in ENGINE_ENV))


@functools.cache
def _engine(settings: tuple[str | None, ...]) -> Engine:
    shown, base_url, tls = _where()
    try:
        return Engine(shown, docker.APIClient(base_url=base_url, tls=tls, version="auto", use_ssh_client=True))
    except docker.errors.DockerException as e:
        raise BackendUnreachable(f"cannot reach the Docker engine at {shown}: {_reason(e)}") from None


def _where() -> tuple[str, str | None, Any]:
    """(what to call the engine in messages, its base URL, its TLS setting), as the docker CLI chooses."""
    env = os.environ
    if env.get("DOCKER_HOST"):
        found = docker.utils.kwargs_from_env(environment=env)
        return env["DOCKER_HOST"], found["base_url"], found.get("tls", False)
    name = env.get("DOCKER_CONTEXT") or ContextAPI.get_current_context().Name
    if name == "default":
        return DEFAULT_HOST, DEFAULT_HOST, False
    context = ContextAPI.get_context(name)
    if context is None:
        raise BackendUnreachable(f"cannot reach the Docker engine: there is no docker context {name}")
    return f"docker context {name}", context.Host, context.TLSConfig or False


def on_this_machine() -> bool:
    """Whether the engine the environment names listens here (a unix socket, or TCP on loopback):
    asked without connecting to it."""
    _, base_url, _ = _where()
    url = urllib.parse.urlsplit(base_url or DEFAULT_HOST)
    if url.scheme in ("unix", "http+unix"):
        return True
    try:
        return url.scheme in ("tcp", "http", "https") and ipaddress.ip_address(url.hostname or "").is_loopback
    except ValueError:
        return url.hostname == "localhost"


def _reason(e: BaseException) -> str:
    """The innermost OS error's words (what a refused or missing socket says), else the first line."""
    pending = [e]
    while pending:
        err = pending.pop()
        if isinstance(err, OSError) and err.strerror:
            return err.strerror
        pending += [a for a in getattr(err, "args", ()) if isinstance(a, BaseException)]
        pending += [c for c in (err.__cause__, err.__context__) if c is not None]
    return " ".join(str(e).split())[:MESSAGE_CAP]


def sync_call(method: str, *args: Any, **kwargs: Any) -> Any:
    """One SDK call (an APIClient method); EngineError with the daemon's message, BackendUnreachable."""
    where = engine()
    with _failures_said(where):
        return getattr(where.api, method)(*args, **kwargs)


def _pull(image: str) -> None:
    """Pull the image; its failure, which the engine reports inside the pull's progress, as EngineError."""
    where = engine()
    with _failures_said(where):
        for event in where.api.pull(image, stream=True, decode=True):
            if "error" in event:
                raise EngineError(0, " ".join(str(event["error"]).split())[:MESSAGE_CAP])


@contextmanager
def _failures_said(where: Engine) -> Iterator[None]:
    try:
        yield
    except docker.errors.APIError as e:
        message = " ".join(str(e.explanation or "").split())[:MESSAGE_CAP]
        raise EngineError(e.status_code or 0, message or f"HTTP status {e.status_code}") from None
    except (requests.exceptions.ConnectionError, docker.errors.DockerException, OSError) as e:
        raise BackendUnreachable(f"cannot talk to the Docker engine at {where.shown}: {_reason(e)}") from None


def _own_threads_and_clients() -> None:
    """Threads of their own: a call waits on the engine (a container's start takes a few hundred ms), and
    a command's input must not queue behind those calls, nor they behind the run's other threads. A
    forked child has none of its parent's threads, and must not share its parent's connections."""
    global _calls, _writes
    _calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="docker-call")
    _writes = ThreadPoolExecutor(thread_name_prefix="docker-write")
    _engine.cache_clear()


_own_threads_and_clients()
os.register_at_fork(after_in_child=_own_threads_and_clients)


async def call(method: str, *args: Any, **kwargs: Any) -> Any:
    """sync_call in a thread."""
    return await asyncio.get_running_loop().run_in_executor(_calls, functools.partial(sync_call, method, *args, **kwargs))


async def pull(image: str) -> None:
    """Pull the image (with the registry logins of the CLI's config.json), in a thread."""
    await asyncio.get_running_loop().run_in_executor(_calls, _pull, image)


class Exec:
    """A started exec: its input, its output frames as they come, then its exit code. Close it in every case."""

    def __init__(self, exec_id: str, sock: Any) -> None:
        self.id = exec_id
        self._sock = sock  # what the SDK hands over: a socket, or a SocketIO around one
        self._raw = getattr(sock, "_sock", sock)
        self._loop = asyncio.get_running_loop()
        self._frames: asyncio.Queue = asyncio.Queue()
        self._room = threading.Semaphore(FRAMES_AHEAD)
        self._closed = False
        self._held = b""
        self._unsent = b""
        threading.Thread(target=self._read_frames, name="docker-exec", daemon=True).start()

    def _read_frames(self) -> None:
        """In its own thread: each frame, then None at the end or the error that ended the stream."""
        item: Any = None
        while True:
            self._room.acquire()
            if self._closed:
                return
            try:
                stream, size = next_frame_header(self._sock)
                item = None if size < 0 else (stream, read_exactly(self._sock, size))
            except (OSError, SocketError, ValueError) as e:
                item = BackendUnreachable(f"cannot talk to the Docker engine at {engine().shown}: {_reason(e)}")
            try:
                self._loop.call_soon_threadsafe(self._frames.put_nowait, item)
            except RuntimeError:  # the event loop has closed
                return
            if not isinstance(item, tuple):
                return

    async def frame(self) -> tuple[int, bytes] | None:
        """The next (stream, bytes), or None once the command and everything holding its output have ended."""
        item = await self._frames.get()
        self._room.release()
        if isinstance(item, BaseException):
            self._frames.put_nowait(item)  # and again at the next call
            raise item
        if item is None:
            self._frames.put_nowait(None)
        return item

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

    def write(self, data: bytes) -> None:
        self._unsent += data

    async def drain(self) -> None:
        data, self._unsent = self._unsent, b""
        try:
            await self._loop.run_in_executor(_writes, self._raw.sendall, data)
        except OSError as e:
            raise BackendUnreachable(f"cannot talk to the Docker engine at {engine().shown}: {_reason(e)}") from None

    async def send(self, data: bytes) -> None:
        """All of the command's input, then its end of file; its output still comes back."""
        self.write(data)
        await self.drain()
        try:
            self._raw.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    async def exit_code(self) -> int | None:
        """The exit code once the daemon has seen the exit (it may lag the end of the output a little)."""
        deadline = self._loop.time() + EXITED_WAIT
        while True:
            state = await call("exec_inspect", self.id)
            if not state.get("Running") or self._loop.time() > deadline:
                return state.get("ExitCode")
            await asyncio.sleep(0.01)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._room.release()  # a reader waiting for room sees the close
        try:
            self._raw.shutdown(socket.SHUT_RDWR)  # a reader waiting for data sees the end
        except OSError:
            pass
        self._sock.close()
        self._raw.close()


async def start_exec(container: str, user: str, argv: Sequence[str], stdin: bool = False,
                     env: dict[str, str] | None = None) -> Exec:
    """Start argv in the container as `user`, with its stdin attached (Exec.write) if asked, else at its end;
    `env` over the container's environment, sent through the API (no command line shows it)."""
    created = await call("exec_create", container, [*GATE, *argv], stdin=True, user=user, environment=env)
    ex = Exec(created["Id"], await call("exec_start", created["Id"], socket=True))
    ex.write(b"\n")  # opens the gate: with the caller's first input, or now
    if not stdin:
        try:
            await ex.send(b"")
        except BaseException:
            ex.close()
            raise
    return ex


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
