"""The host end of a sandbox's command loop: one long-lived shell per prompt, commands over a pipe.

Starting a sandbox is the costly part of a command (namespaces, mounts, seccomp: about 7 ms of
machine CPU), so a prompt's sandbox starts once, at its first command, running supervise.sh,
which runs each command as today's fresh sandbox would and kills everything it left behind. The
loop is bash, not Python: a prompt with a single command must not pay an interpreter's start-up.
The command's output comes straight through the pipe, capped here, and ends at a random marker
the command has never seen. The channel belongs to the sandbox: what the sandbox writes into it
can only change what the prompt's own commands are said to have printed. Cancelling a command
(prompt deadline, shutdown) or a loop that stops answering kills the whole sandbox; the next
command starts a new one over the same work dir.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path
from typing import Callable

from trajgen.sandbox import ExecResult, SandboxError
from trajgen.sandbox.process import Capture, kill_group

LOOP_ARGV = ["bash", "--noprofile", "--norc", "-c", Path(__file__).with_name("supervise.sh").read_text()]
GRACE = 10.0  # seconds past a command's timeout before the loop itself counts as stuck
LOST = "the sandbox stopped unexpectedly; its processes were killed"
KILLED = 137  # what `timeout -s KILL` reports for a command it had to kill
CHUNK = 65536


class _Lost(Exception):
    """The loop broke its protocol or ended."""


class Supervisor:
    """Runs commands, one at a time, through the loop that `start_argv()` starts (argv, fds to pass)."""

    def __init__(self, start_argv: Callable[[], tuple[list[str], list[int]]], env: dict[str, str], cwd: str) -> None:
        self._start_argv, self._env, self._cwd = start_argv, env, cwd
        self._proc: asyncio.subprocess.Process | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = asyncio.Lock()

    def _on_this_loop(self) -> None:
        """A loop left behind by the caller (each asyncio.run is a new one) cannot drive the old process: kill it."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._proc is not None:
                kill_group(self._proc.pid)
            self._proc, self._loop, self._lock = None, loop, asyncio.Lock()

    async def run(self, command: str, timeout: float) -> ExecResult:
        self._on_this_loop()
        async with self._lock:
            proc = self._proc or await self._start()
            capture = Capture()
            try:
                code, timed_out = await asyncio.wait_for(self._exchange(proc, command, timeout, capture),
                                                         timeout + GRACE)
            except TimeoutError:
                code, timed_out = None, True
                await self.stop()
            except _Lost:
                await self.stop()
                return ExecResult(capture.text(), None, LOST)
            except BaseException:  # cancelled: nothing of the command may go on running
                await self.stop()
                raise
        if timed_out:
            return ExecResult(capture.text(), None, f"timed out after {timeout:g} s; the command and its children were killed")
        return ExecResult(capture.text(), code)

    async def _start(self) -> asyncio.subprocess.Process:
        argv, fds = self._start_argv()
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                env=self._env, cwd=self._cwd, start_new_session=True, pass_fds=fds,
            )
        except OSError as e:
            raise SandboxError(f"cannot start {argv[0]}: {e.strerror}") from e
        finally:
            for fd in fds:
                os.close(fd)
        return self._proc

    @staticmethod
    async def _exchange(proc: asyncio.subprocess.Process, command: str, timeout: float, capture: Capture) -> tuple[int, bool]:
        marker = os.urandom(16).hex().encode()
        escaped = command.encode("utf-8", "replace").replace(b"\\", b"\\\\").replace(b"\n", b"\\n")
        started = time.monotonic()
        try:
            proc.stdin.write(b"%.3f %s\n%s\n" % (max(timeout, 0.001), marker, escaped))  # 0 would mean none
            await proc.stdin.drain()
            held = b""
            while (at := held.find(marker)) < 0:
                cut = max(0, len(held) - len(marker) + 1)  # what cannot be the start of the marker
                capture.add(held[:cut])
                held = held[cut:]
                if not (chunk := await proc.stdout.read(CHUNK)):
                    raise _Lost
                held += chunk
            capture.add(held[:at])
            status = held[at + len(marker):]
            while b"\n" not in status:
                if not (chunk := await proc.stdout.read(CHUNK)):
                    raise _Lost
                status += chunk
            code = int(status.split(b"\n", 1)[0])
        except (OSError, ValueError) as e:
            raise _Lost from e
        return code, code == KILLED and time.monotonic() - started >= timeout

    async def stop(self) -> None:
        """Kill the sandbox (its init dies with bwrap, and every process of the namespace with it)."""
        self._on_this_loop()
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.stdin.close()  # the loop ends at the end of its input, and the sandbox with it, even if
            kill_group(proc.pid)  # bwrap's init missed its parent's death (seen under load)
            await proc.wait()

