"""Running one command as a child process: output merged and capped, its group killed at the end."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable

from trajgen.sandbox import ExecResult, SandboxError

OUTPUT_CAP = 50_000  # bytes of command output kept: the first and the last half
CHUNK = 1 << 16


class Capture:
    """Keeps the head and tail of a stream as it arrives, so a flood of output costs no memory."""

    def __init__(self) -> None:
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = OUTPUT_CAP // 2 - len(self.head)
        self.head += chunk[:room] if room > 0 else b""
        self.tail += chunk[max(room, 0):]
        del self.tail[: -(OUTPUT_CAP // 2)]

    def text(self) -> str:
        cut = self.total - len(self.head) - len(self.tail)
        if cut == 0:
            return (self.head + self.tail).decode("utf-8", "replace")
        head, tail = self.head.decode("utf-8", "replace"), self.tail.decode("utf-8", "replace")
        return f"{head}\n[... {cut} bytes of output cut ...]\n{tail}"


def watch_children_with_pidfds() -> None:
    """Python 3.11's asyncio waits for each child process in a thread of its own, 0.3 ms of a worker's
    CPU a sandbox (bench/RESULTS.md); 3.12 made a pidfd read by the event loop the default, as here.
    Before the loop starts, in the main thread, where asyncio.run attaches it (not a Ray actor's loop)."""
    if sys.version_info >= (3, 12):
        return
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:  # a kernel before 5.3: the threads stay
        return
    asyncio.set_child_watcher(asyncio.PidfdChildWatcher())


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill_pids(pids: list[int]) -> None:
    """SIGKILL each, those already gone included."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_children(pid: int) -> None:
    """SIGKILL the children of `pid` (none when it has gone, or the kernel does not list them)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kill_pids([int(child) for child in f.read().split()])
    except OSError:
        pass


async def run_process(
    argv: list[str],
    timeout: float,
    env: dict[str, str],
    cwd: str | None = None,
    pass_fds: tuple[int, ...] = (),
    on_timeout: Callable[[], Awaitable[None]] | None = None,
) -> ExecResult:
    """Run argv in a new session with stdout+stderr merged and capped; on timeout kill its group.

    The group is killed after a normal exit (ending background jobs the command left; bwrap
    and docker end them anyway) and when the caller is cancelled too; `on_timeout` kills what
    lives beyond our reach.
    The output pipe is our own, not asyncio's: asyncio's `wait()` would also wait for every
    process holding the pipe, such as a background job that escaped with setsid.
    """
    read_fd, write_fd = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.DEVNULL, stdout=write_fd, stderr=write_fd,
            env=env, cwd=cwd, start_new_session=True, pass_fds=pass_fds,
        )
    except OSError as e:
        os.close(read_fd)
        raise SandboxError(f"cannot start {argv[0]}: {e.strerror}") from e
    finally:
        os.close(write_fd)
    stream = asyncio.StreamReader()
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(stream), os.fdopen(read_fd, "rb", 0)
    )
    capture = Capture()

    async def pump() -> None:
        while chunk := await stream.read(65536):
            capture.add(chunk)

    reader = asyncio.create_task(pump())
    error = None
    try:
        await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        error = f"timed out after {timeout:g} s; the command and its children were killed"
    finally:  # a cancelled caller (prompt deadline, shutdown) must not leave the command running
        kill_group(proc.pid)
        await proc.wait()
    if error and on_timeout:
        await on_timeout()
    try:  # a process that escaped the group may still hold the pipe: stop waiting for it
        await asyncio.wait_for(reader, 2)
    except TimeoutError:
        pass
    transport.close()
    return ExecResult(capture.text(), None if error else proc.returncode, error)


@asynccontextmanager
async def deadline(proc: asyncio.subprocess.Process, timeout: float) -> AsyncIterator[None]:
    """A block that talks to a child: TimeoutError past `timeout`, and however the block ends (the deadline, an
    error, a cancelled caller) a child still running is killed and reaped, never left behind."""
    try:
        async with asyncio.timeout(timeout):
            yield
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def last_line(text: str) -> str:
    """The last non-blank line of a CLI's error output: the one that says what went wrong."""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no error message"


async def run_cli(argv: list[str], env: dict[str, str], timeout: float,
                  stdin: bytes | None = None) -> tuple[int | None, bytes, str]:
    """Run a container runtime's CLI command: (exit code or None on timeout, stdout, stderr's text)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        )
    except OSError as e:
        raise SandboxError(f"cannot run the {argv[0]} CLI: {e.strerror}") from e
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return None, b"", f"{argv[0]} {argv[1]} did not finish within {timeout:g} s"
    return proc.returncode, out, err.decode("utf-8", "replace").strip()


async def stream_stdout(argv: list[str], env: dict[str, str], timeout: float, path: str) -> AsyncIterator[bytes]:
    """A CLI's stdout (`cat` of `path` in a container), a chunk at a time: the file never sits whole in the worker."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        )
    except OSError as e:
        raise SandboxError(f"cannot run the {argv[0]} CLI: {e.strerror}") from e
    try:
        async with deadline(proc, timeout):
            while chunk := await proc.stdout.read(CHUNK):
                yield chunk
            code = await proc.wait()
    except TimeoutError:
        raise SandboxError(f"cannot read {path}: no end within {timeout:g} s") from None
    if code != 0:
        raise SandboxError(f"cannot read {path}: {last_line((await proc.stderr.read()).decode('utf-8', 'replace'))}")
