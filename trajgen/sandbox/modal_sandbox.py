"""The `modal` backend: one Modal sandbox per prompt, driven through the modal SDK's async interface.

Modal runs the sandbox off this machine; its runtime is the boundary. The sandbox is created
at the prompt's start (`start`) or its first tool call, from the row's registry image (entrypoint
cleared, the image checked once per run by `check_image`), under the `--modal_app` app, with no
network unless asked, the run's CPU and memory as request and limit, a lifetime of
`--modal_timeout`, and tags for the session, the run and the prompt, so `remove` can find what a
crashed or killed runner left.
Commands, reads and writes all go through `Sandbox.exec`; every terminal call ends with the docker
backend's `kill -9 -1` wrapper, so nothing a call starts outlives it, and the file contents cross on
the exec's stdin and stdout, never in its (size-limited) arguments. Credentials are Modal's own
configuration (`modal token set` or MODAL_TOKEN_ID/MODAL_TOKEN_SECRET); nothing of ours enters the
sandbox but the three variables every backend sets. The SDK is imported only when this backend runs.
"""
from __future__ import annotations

import asyncio
import math
import warnings
from contextlib import contextmanager
from types import ModuleType
from typing import AsyncIterator, Iterator

from trajgen.sandbox import Backend, BackendUnreachable, ExecResult, SandboxConfig, SandboxError
from trajgen.sandbox.process import Capture, last_line
from trajgen.sandbox.shell import KILL_ALL, MERGED, READ, REAPER, WRITE

ENV = {"LANG": "C.UTF-8", "TERM": "dumb", "PYTHONUNBUFFERED": "1"}
GRACE = 10  # seconds Modal lets a command run past our own timeout before killing it itself
STDIN_CHUNK = 1 << 20


def _sdk() -> ModuleType:
    try:
        import modal
    except ImportError:
        raise BackendUnreachable("the modal backend needs the modal SDK: pip install 'trajgen-batch-runner[modal]'") from None
    return modal


async def _load_sdk() -> ModuleType:
    """The SDK, imported off the event loop the first time (the import takes about a third of a second)."""
    return await asyncio.to_thread(_sdk)


def _failures(modal: ModuleType) -> tuple[type[BaseException], ...]:
    """What Modal can raise for reasons of its own: its error tree, grpclib's and the connection's."""
    import grpclib.exceptions

    return modal.exception.Error, grpclib.exceptions.GRPCError, grpclib.exceptions.StreamTerminatedError, OSError


def _line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return f"{type(error).__name__}: {text}"


@contextmanager
def _modal_errors(what: str) -> Iterator[None]:
    """Modal's errors (auth, quota, not found, connection) as one SandboxError line, never a traceback;
    credentials refused or Modal out of reach as BackendUnreachable."""
    modal = _sdk()
    try:
        yield
    except (modal.exception.AuthError, modal.exception.ConnectionError, OSError) as e:
        raise BackendUnreachable(f"{what}: {_line(e)}") from None
    except _failures(modal) as e:
        raise SandboxError(f"{what}: {_line(e)}") from None


def _image(modal: ModuleType, ref: str):
    return modal.Image.from_registry(ref).entrypoint([])


_apps: dict[str, object] = {}  # app name -> the looked-up App, once per process


async def _app(modal: ModuleType, config: SandboxConfig):
    if config.modal_app not in _apps:
        _apps[config.modal_app] = await modal.App.lookup.aio(config.modal_app, create_if_missing=True)
    return _apps[config.modal_app]


async def _exec(sandbox, *args: str, timeout: float, workdir: str | None, stderr: bool = True):
    """Start a command in the sandbox, bytes out; Modal itself ends it a little after our own timeout."""
    streams = _sdk().stream_type.StreamType
    return await sandbox.exec.aio(*args, timeout=math.ceil(timeout) + GRACE, workdir=workdir, env=ENV, text=False,
                                  stderr=streams.PIPE if stderr else streams.DEVNULL)


async def _stderr_line(process) -> str:
    return last_line((await process.stderr.read.aio()).decode("utf-8", "replace"))


class ModalSandbox:
    """A prompt's Modal sandbox, created at first use."""

    def __init__(self, config: SandboxConfig, key: str, image: str, cwd: str) -> None:
        self.config = config
        self.key = key
        self.image = image
        self.cwd = cwd
        self._sandbox = None
        self._lock = asyncio.Lock()

    async def _get(self):
        async with self._lock:
            if self._sandbox is None:
                self._sandbox = await self._start()
        return self._sandbox

    async def _start(self):
        modal, c = await _load_sdk(), self.config
        with _modal_errors(f"cannot start a Modal sandbox from image {self.image}"):
            sandbox = await modal.Sandbox.create.aio(
                "sh", "-c", REAPER, app=await _app(modal, c), image=_image(modal, self.image),
                timeout=c.modal_timeout, block_network=not c.network, cpu=(c.cpus, c.cpus),
                memory=(c.memory_mb, c.memory_mb),
                tags={"trajgen.session": c.label, "trajgen.run": c.run_id, "trajgen.key": self.key},
            )
        try:  # the work dir, before any exec names it as its workdir
            with _modal_errors(f"cannot prepare {self.cwd} in image {self.image}"):
                made = await _exec(sandbox, "mkdir", "-p", "--", self.cwd, timeout=c.command_timeout, workdir=None)
                if await made.wait.aio() != 0:
                    raise SandboxError(f"cannot prepare {self.cwd} in image {self.image}: {await _stderr_line(made)}")
        except SandboxError:
            await self._terminate(sandbox)
            raise
        return sandbox

    async def _exec(self, *args: str, timeout: float, stderr: bool = True):
        return await _exec(await self._get(), *args, timeout=timeout, workdir=self.cwd, stderr=stderr)

    async def start(self) -> None:
        await self._get()

    async def run(self, command: str, timeout: float) -> ExecResult:
        capture = Capture()
        with _modal_errors("the Modal sandbox failed"):
            process = await self._exec("sh", "-c", MERGED, "sh", command, timeout=timeout, stderr=False)

            async def finish() -> int:
                async for chunk in process.stdout:
                    capture.add(chunk)
                return await process.wait.aio()

            try:
                code = await asyncio.wait_for(finish(), timeout)
            except TimeoutError:  # the tree is killed from inside: ending the exec alone would leave its children
                await self.end_processes()
                return ExecResult(capture.text(), None,
                                  f"timed out after {timeout:g} s; the command and its children were killed")
        return ExecResult(capture.text(), code)

    async def read_chunks(self, path: str) -> AsyncIterator[bytes]:
        """`cat` in the sandbox, streamed a chunk at a time: the file never sits whole in the worker."""
        with _modal_errors(f"cannot read {path}"):
            process = await self._exec("sh", "-c", READ, "sh", path, timeout=self.config.command_timeout)
            try:
                async with asyncio.timeout(self.config.command_timeout):
                    async for chunk in process.stdout:
                        yield chunk
                    code = await process.wait.aio()
            except TimeoutError:
                raise SandboxError(f"cannot read {path}: no end within {self.config.command_timeout:g} s") from None
            if code != 0:
                raise SandboxError(f"cannot read {path}: {await _stderr_line(process)}")

    async def write_file(self, path: str, data: bytes) -> None:
        """The bytes go through the exec's stdin, a chunk at a time: exec arguments are size-limited."""
        with _modal_errors(f"cannot write {path}"):
            process = await self._exec("sh", "-c", WRITE, "sh", path, timeout=self.config.command_timeout)
            try:
                async with asyncio.timeout(self.config.command_timeout):
                    for start in range(0, len(data), STDIN_CHUNK):
                        process.stdin.write(data[start:start + STDIN_CHUNK])
                        await process.stdin.drain.aio()
                    process.stdin.write_eof()
                    await process.stdin.drain.aio()
                    code = await process.wait.aio()
            except TimeoutError:
                raise SandboxError(f"cannot write {path}: no end within {self.config.command_timeout:g} s") from None
            if code != 0:
                raise SandboxError(f"cannot write {path}: {await _stderr_line(process)}")

    async def start_process(self, command: list[str], env: dict[str, str]):
        """`command` as a long-lived process of this sandbox, with pipes (the SDK's ContainerProcess,
        whose stdout yields bytes as they come: lines are split by the caller, within its bounds): in the
        work dir, with the sandbox's environment plus `env`. It ends when its stdin closes, or with the sandbox."""
        sandbox = await self._get()
        with _modal_errors(f"cannot start {command[0]}"):
            return await sandbox.exec.aio(*command, workdir=self.cwd, env={**ENV, **env}, text=False)

    async def end_processes(self) -> None:
        if self._sandbox is not None:
            with _modal_errors("the Modal sandbox failed"):
                killer = await self._exec(*KILL_ALL, timeout=self.config.command_timeout, stderr=False)
                await killer.wait.aio()

    async def _terminate(self, sandbox) -> None:
        with _modal_errors("cannot terminate the Modal sandbox"):
            await sandbox.terminate.aio()

    async def close(self) -> None:
        if self._sandbox is not None and not self.config.keep:
            sandbox, self._sandbox = self._sandbox, None
            await self._terminate(sandbox)


def open_modal(config: SandboxConfig, key: str, image: str | None, cwd: str | None) -> ModalSandbox:
    return ModalSandbox(config, key, image or config.docker_image, cwd or "/workspace")


async def check_image(image: str, config: SandboxConfig) -> str | None:
    """None if Modal can build (or has cached) the image, else a one-line reason."""
    try:
        modal = await _load_sdk()
        with _modal_errors(f"Modal cannot build image {image}"):
            await _image(modal, image).build.aio(await _app(modal, config))
    except BackendUnreachable:
        raise
    except SandboxError as e:
        return str(e)
    return None


def remove_sandboxes(tag: str, value: str) -> None:
    """Terminate every running sandbox tagged <tag>=<value>; quiet when Modal is absent or unreachable.

    Listed across the environment, not within one app: the tag values are unique to a run, and a
    run resumed under another --modal_app must still find what the first invocation left.
    """
    try:
        import modal
    except ImportError:
        return
    with warnings.catch_warnings():  # the SDK marks environment-wide listing deprecated; here it is the point
        warnings.simplefilter("ignore", modal.exception.DeprecationError)
        try:
            for sandbox in modal.Sandbox.list(tags={tag: value}):
                sandbox.terminate()
        except _failures(modal):  # unreachable or not authenticated: nothing we could remove
            pass


BACKEND = Backend(open_modal, check_image, remove_sandboxes)
