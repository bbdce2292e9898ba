"""The host end of a sandbox's command loop: one long-lived process per prompt, commands over a pipe.

Starting a sandbox is the costly part of a command (namespaces, mounts, seccomp: about 7 ms of
machine CPU), so a prompt's sandbox starts once, at its first command, running supervise.py,
which runs each command as today's fresh sandbox would and kills everything it left behind. The
channel belongs to the sandbox: whatever the sandbox writes into it can only change what the
prompt's own commands are said to have printed, and a malformed answer ends the sandbox.
Cancelling a command (prompt deadline, shutdown) or a loop that stops answering kills the
whole sandbox; the next command starts a new one over the same work dir.
"""
from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Callable

from trajgen.sandbox import ExecResult, SandboxError
from trajgen.sandbox.process import Capture, kill_group

SOURCE = Path(__file__).with_name("supervise.py").read_text()
PYTHON = os.path.realpath(sys.executable)  # the base interpreter: visible in the sandbox (local.py binds it)
LOOP_ARGV = [PYTHON, "-I", "-S", "-c", SOURCE]
GRACE = 10.0  # seconds past a command's timeout before the loop itself counts as stuck
LOST = "the sandbox stopped unexpectedly; its processes were killed"
MAX_FRAME = 1 << 20


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
        try:
            proc.stdin.write(json.dumps({"command": command, "timeout": timeout}).encode() + b"\n")
            await proc.stdin.drain()
            while size := struct.unpack(">I", await proc.stdout.readexactly(4))[0]:
                if size > MAX_FRAME:
                    raise _Lost
                capture.add(await proc.stdout.readexactly(size))
            code, timed_out = (await proc.stdout.readline()).split()
            return int(code), timed_out == b"1"
        except (OSError, ValueError, asyncio.IncompleteReadError) as e:
            raise _Lost from e

    async def stop(self) -> None:
        """Kill the sandbox (its init dies with bwrap, and every process of the namespace with it)."""
        self._on_this_loop()
        proc, self._proc = self._proc, None
        if proc is not None:
            kill_group(proc.pid)
            await proc.wait()

