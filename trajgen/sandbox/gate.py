"""A root runner's bwrap held before it starts anything, until the runner has put it in its sandbox's cgroup.

bwrap reads all its `--args` before it forks. The first is a pipe whose write end the runner keeps:
bwrap waits on it while the runner moves it into the group, so everything it starts is born there,
without a shell exec'd first to join (0.6 ms of machine CPU a sandbox). The pipe closes empty; the
options are in the second `--args`, so a runner that dies first leaves bwrap isolated as ever.
"""
from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import suppress
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol, TypeVar

from trajgen.sandbox import SandboxError, cgroups

# A move into a cgroup waits for every fork and exit on the machine to pass (the kernel's
# cgroup_threadgroup_rwsem): 0.1 ms alone, up to 16 ms under load, so never on the event loop.
_MOVES = ThreadPoolExecutor(max_workers=2, thread_name_prefix="cgroup-move")


class Process(Protocol):
    pid: int

    def kill(self) -> None: ...

    async def wait(self) -> int: ...


P = TypeVar("P", bound=Process)


@dataclass(frozen=True)
class Gate:
    group: cgroups.Group
    fd: int  # the pipe's write end


def gated(argv: list[str], fds: list[int], group: cgroups.Group | None) -> tuple[list[str], list[int], Gate | None]:
    """A bwrap command line and the fds it inherits, held at a gate into `group`; as they are without one."""
    if group is None:
        return argv, fds, None
    held, fd = os.pipe()
    return [argv[0], "--args", str(held), *argv[1:]], [*fds, held], Gate(group, fd)


async def start(spawn: Callable[[], Awaitable[P]], gate: Gate | None) -> P:
    """The process `spawn` starts, let through `gate` once it is in the group. One that cannot be
    moved, or whose start is cancelled, is killed while it still waits: never let go outside its group."""
    if gate is None:
        return await spawn()
    try:
        process = await spawn()
        move = _MOVES.submit(gate.group.enter, process.pid)
        try:
            await asyncio.wrap_future(move)
        except BaseException as e:
            wait([move])  # a move under way ends first (a moment, on this rare path): the pid is still bwrap's
            with suppress(ProcessLookupError):  # killed from outside meanwhile: the error above is still the one to say
                process.kill()
            await process.wait()
            if isinstance(e, OSError):
                raise SandboxError(f"cannot put the sandbox in its cgroup: {e.strerror or e}") from e
            raise
    finally:
        os.close(gate.fd)
    return process
