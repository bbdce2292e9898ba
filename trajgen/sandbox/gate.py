"""A root runner's bwrap held before it starts anything, until the runner has put it in its sandbox's cgroup.

bwrap reads all its `--args` before it forks. The first is a pipe whose write end the runner keeps:
bwrap waits on it while the runner moves it into the group, so everything it starts is born there,
without a shell exec'd first to join (0.6 ms of machine CPU a sandbox). The pipe closes empty; the
options are in the second `--args`, so a runner that dies first leaves bwrap isolated as ever.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol, TypeVar

from trajgen.sandbox import SandboxError, cgroups


class Process(Protocol):
    pid: int

    async def wait(self) -> int: ...


P = TypeVar("P", bound=Process)


@dataclass(frozen=True)
class Gate:
    group: cgroups.Group
    fd: int  # the pipe's write end

    def admit(self, pid: int) -> None:
        """Move the held bwrap into the group; one that cannot be moved is killed, never let go outside it."""
        try:
            self.group.enter(pid)
        except OSError as e:
            os.kill(pid, signal.SIGKILL)
            raise SandboxError(f"cannot put the sandbox in its cgroup: {e.strerror or e}") from e


def gated(argv: list[str], fds: list[int], group: cgroups.Group | None) -> tuple[list[str], list[int], Gate | None]:
    """A bwrap command line and the fds it inherits, held at a gate into `group`; as they are without one."""
    if group is None:
        return argv, fds, None
    held, fd = os.pipe()
    return [argv[0], "--args", str(held), *argv[1:]], [*fds, held], Gate(group, fd)


async def start(spawn: Callable[[], Awaitable[P]], gate: Gate | None) -> P:
    """The process `spawn` starts, through `gate` when there is one. Whatever happens, the gate closes."""
    if gate is None:
        return await spawn()
    try:
        process = await spawn()
        try:
            gate.admit(process.pid)
        except SandboxError:
            await process.wait()
            raise
    finally:
        os.close(gate.fd)
    return process
