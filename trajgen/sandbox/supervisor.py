"""The host end of a sandbox's command loop: one long-lived shell per prompt, commands over a channel.

Starting a sandbox is the costly part of a command (namespaces, mounts, seccomp; its cost is in
bench/RESULTS.md), so a prompt's sandbox starts once, at its first command, running supervise.sh,
which runs each command as today's fresh sandbox would and kills everything it left behind. The
loop is bash, not Python: a prompt with a single command must not pay an interpreter's start-up.
The command's output comes straight through the channel, capped here, and ends at a random marker
the command has never seen. The channel belongs to the sandbox: what the sandbox writes into it
can only change what the prompt's own commands are said to have printed. A command past its
timeout, a cancelled one (prompt deadline, shutdown) or a loop that breaks its protocol kills the
whole sandbox; the next command starts a new one over the same work dir.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable, Protocol

from trajgen.sandbox import ExecResult, SandboxError, gate
from trajgen.sandbox.process import Capture, kill_children, kill_group

LOOP_ARGV = ["bash", "--noprofile", "--norc", "-c", Path(__file__).with_name("supervise.sh").read_text(), "supervise"]
LOST = "the sandbox stopped unexpectedly; its processes were killed"
CHUNK = 65536
REAP_SECONDS = 5.0  # for bwrap to exit once its child, the sandbox's init, is killed; then its group is killed


class Reader(Protocol):
    async def read(self, n: int) -> bytes: ...  # b"" at the end


class Writer(Protocol):
    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


@dataclass(frozen=True)
class Channel:
    """A running loop: its input, its output, and how to end it with every process it started."""

    reader: Reader
    writer: Writer
    kill: Callable[[], Awaitable[None]]


async def process_channel(argv: list[str], fds: list[int], env: dict[str, str], cwd: str,
                          through: gate.Gate | None = None) -> Channel:
    """Start the loop as a child process (in a session of its own, `through` the gate into its
    sandbox's cgroup if any) talking over its stdin and stdout.

    The fds are passed to it and closed here. Killing it kills the sandbox: a PID namespace ends
    with its first process, and the loop ends at the end of its input even if bwrap's init missed
    its parent's death (seen under load). That init is killed first, so that bwrap reaps it: bwrap
    leaves it to exit alone when it ends by itself or is killed with bwrap, an orphan for whoever
    adopts them, and a runner that is PID 1 (a container without an init) never reaped one: a
    zombie, and a PID namespace kept, per sandbox.
    """
    try:
        proc = await gate.start(lambda: asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=env, cwd=cwd, start_new_session=True, pass_fds=fds,
        ), through)
    except OSError as e:
        raise SandboxError(f"cannot start {argv[0]}: {e.strerror}") from e
    finally:
        for fd in fds:
            os.close(fd)

    async def kill() -> None:
        if proc.returncode is None:  # once bwrap is reaped its pid may be another process's
            kill_children(proc.pid)  # the sandbox's init, before the end of input lets it end by itself
        proc.stdin.close()
        try:
            async with asyncio.timeout(REAP_SECONDS):
                await proc.wait()
        except TimeoutError:  # bwrap lives on: its group goes with it (once reaped, its pid is free for others)
            kill_group(proc.pid)
            await proc.wait()

    return Channel(proc.stdout, proc.stdin, kill)


class _Lost(Exception):
    """The loop broke its protocol or ended."""


class Supervisor:
    """Runs commands, one at a time, through the loop that `start()` starts; on one event loop."""

    def __init__(self, start: Callable[[], Awaitable[Channel]]) -> None:
        self._start = start
        self._channel: Channel | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Start the loop ahead of the first command."""
        async with self._lock:
            self._channel = self._channel or await self._start()

    async def run(self, command: str, timeout: float) -> ExecResult:
        async with self._lock:
            channel = self._channel = self._channel or await self._start()
            capture = Capture()
            try:
                async with asyncio.timeout(timeout):  # not wait_for: no task of its own per command
                    code = await self._exchange(channel, command, capture)
            except TimeoutError:
                await self.stop()
                return ExecResult(capture.text(), None, f"timed out after {timeout:g} s; the command and its children were killed")
            except _Lost:
                await self.stop()
                return ExecResult(capture.text(), None, LOST)
            except BaseException:  # cancelled: nothing of the command may go on running
                await self.stop()
                raise
        return ExecResult(capture.text(), code)

    @staticmethod
    async def _exchange(channel: Channel, command: str, capture: Capture) -> int:
        marker = os.urandom(16).hex().encode()
        escaped = command.encode("utf-8", "replace").replace(b"\\", b"\\\\").replace(b"\n", b"\\n")
        held = b""
        try:
            channel.writer.write(b"%s\n%s\n" % (marker, escaped))
            await channel.writer.drain()
            while (at := held.find(marker)) < 0:
                cut = max(0, len(held) - len(marker) + 1)  # what cannot be the start of the marker
                capture.add(held[:cut])
                held = held[cut:]
                if not (chunk := await channel.reader.read(CHUNK)):
                    raise _Lost
                held += chunk
            capture.add(held[:at])
            status, held = held[at + len(marker):], b""
            while b"\n" not in status:
                if not (chunk := await channel.reader.read(CHUNK)):
                    raise _Lost
                status += chunk
            return int(status.split(b"\n", 1)[0])
        except (OSError, ValueError) as e:
            raise _Lost from e
        finally:
            capture.add(held)  # the output's last bytes, when it ends in a timeout or a loss

    @property
    def running(self) -> bool:
        """Whether a loop was started and not stopped since."""
        return self._channel is not None

    async def stop(self) -> None:
        """End the loop and every process of the sandbox."""
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.kill()
