"""A long-lived process with stdio pipes inside a prompt's sandbox (an MCP server), as byte streams.

In a local sandbox the process started here is bwrap, which reads its options and seccomp filter
from memfds it inherits, so the host path of the work dir stays out of every command line; in an
apptainer sandbox it is an `apptainer exec` into the prompt's instance. A docker sandbox's process
is an exec through the Docker API, a modal one's comes from Modal's Sandbox.exec: neither runs a
process on this machine. Its stderr is kept as a tail of a few KB, whatever it writes, and its
environment never appears on a command line.
"""
from __future__ import annotations

import asyncio
import os
import posixpath
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

import anyio

from trajgen.sandbox import Sandbox, SandboxError, apptainer, gate, visible
from trajgen.sandbox.docker import DockerSandbox
from trajgen.sandbox.docker_client import STDOUT, Exec
from trajgen.sandbox.local import LocalSandbox, sandbox_env
from trajgen.sandbox.modal_sandbox import ModalSandbox
from trajgen.sandbox.process import kill_group, last_line

STDERR_TAIL = 4096  # bytes of a process's stderr kept: its last, where it says why it failed
GRACE = 2.0  # seconds a process has to exit once its stdin closes before it is killed (as the MCP SDK waits)
END_WAIT = 10.0  # seconds the end of a remote process's stdin may take to reach it


class Tail:
    """The last STDERR_TAIL bytes of a stream: what a process said last, at a fixed cost whatever it writes."""

    def __init__(self) -> None:
        self._data = bytearray()

    def add(self, chunk: bytes) -> None:
        self._data += chunk[-STDERR_TAIL:]
        del self._data[:-STDERR_TAIL]

    def line(self) -> str | None:
        """Its last non-blank line, if any."""
        text = self._data.decode("utf-8", "replace")
        return last_line(text) if text.strip() else None


@dataclass(frozen=True)
class Pipes:
    stdout: AsyncIterator[bytes]  # chunks as they come, to its end
    write: Callable[[bytes], Awaitable[None]]  # to its stdin


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]  # of the process started on the host: the only way a value reaches the command
    cwd: str | None
    fds: tuple[int, ...] = ()  # memfds (and a gate's pipe) the started process inherits; ours close once it has started
    through: gate.Gate | None = None  # into the sandbox's cgroup

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


@asynccontextmanager
async def pipes(sandbox: Sandbox, command: list[str], env: dict[str, str], stderr: Tail,
                cwd: str | None = None) -> AsyncIterator[Pipes]:
    """`command` running in `sandbox` with `env` over the sandbox's own environment, its stderr
    going to `stderr`; in a local sandbox, with what it names visible (visible.py) and in `cwd` if
    given. At the exit its stdin closes: a process started here that has not ended GRACE seconds
    later is killed; one inside a container ends then, or with its sandbox."""
    if isinstance(sandbox, DockerSandbox):
        opened = _exec(await sandbox.start_process(command, env), stderr)
    elif isinstance(sandbox, ModalSandbox):
        opened = _modal(await sandbox.start_process(command, env), stderr)
    else:
        opened = _process(await _launch(sandbox, command, env, cwd), stderr)
    async with opened as streams:
        yield streams


async def _launch(sandbox: Sandbox, command: list[str], env: dict[str, str], cwd: str | None) -> Launch:
    """How to start `command` on this machine; SandboxError for a backend that runs no process here,
    or for a command a local sandbox cannot show (not on the PATH, a secret...)."""
    if isinstance(sandbox, apptainer.ApptainerSandbox):
        return Launch(await sandbox.process_argv(command), apptainer.runtime_env(env), None)
    if not isinstance(sandbox, LocalSandbox):
        raise SandboxError(f"the {type(sandbox).__name__} backend runs no process on this machine")
    config = sandbox.config
    shown = await asyncio.to_thread(visible.plan, command[0], tuple(command[1:]), cwd, config.network,
                                    (config.root_dir, config.run_dir))
    base = sandbox_env(sandbox.cwd)
    env = {**base, **dict(shown.env), "PATH": f"{posixpath.dirname(shown.argv[0])}:{base['PATH']}", **env}
    argv, fds, through = sandbox.process_argv(list(shown.argv), env, shown)
    return Launch(argv, env, shown.cwd if shown.cwd and not sandbox.isolated else sandbox.host_dir, tuple(fds),
                  through)


@asynccontextmanager
async def _process(launch: Launch, stderr: Tail) -> AsyncIterator[Pipes]:
    try:
        process = await gate.start(lambda: anyio.open_process(launch.argv, env=launch.env, cwd=launch.cwd,
                                                              start_new_session=True, pass_fds=launch.fds),
                                   launch.through)
    except OSError as e:
        raise SandboxError(f"cannot start {launch.argv[0]}: {e.strerror or e}") from e
    finally:
        launch.close()

    async def log() -> None:
        async for chunk in process.stderr:
            stderr.add(chunk)

    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(log)
            try:
                yield Pipes(process.stdout, process.stdin.send)
            finally:
                tasks.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                await process.stdin.aclose()
            with anyio.move_on_after(GRACE):
                while process.returncode is None:  # not wait(): a child holding its pipes would look like it
                    await anyio.sleep(0.01)
            if process.returncode is None:
                kill_group(process.pid)  # its own session: what it started outside the sandbox too
            with anyio.move_on_after(GRACE):
                await process.aclose()


@asynccontextmanager
async def _exec(ex: Exec, stderr: Tail) -> AsyncIterator[Pipes]:
    async def stdout() -> AsyncIterator[bytes]:
        async for stream, data in ex.frames():
            if stream == STDOUT:
                yield data
            else:
                stderr.add(data)

    async def write(data: bytes) -> None:
        ex.write(data)
        await ex.drain()

    try:
        yield Pipes(stdout(), write)
    finally:
        try:
            with anyio.CancelScope(shield=True), anyio.move_on_after(END_WAIT):
                await ex.send(b"")  # the end of its stdin
        finally:
            ex.close()


@asynccontextmanager
async def _modal(process, stderr: Tail) -> AsyncIterator[Pipes]:
    """A Modal ContainerProcess (bytes, not lines: its own line reader holds a line whole, however long)."""
    async def log() -> None:
        async for chunk in process.stderr:
            stderr.add(chunk)

    async def write(data: bytes) -> None:
        process.stdin.write(data)
        await process.stdin.drain.aio()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(log)
        try:
            yield Pipes(aiter(process.stdout), write)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(END_WAIT):  # it ends at the end of its stdin
                process.stdin.write_eof()
                await process.stdin.drain.aio()
            tasks.cancel_scope.cancel()
