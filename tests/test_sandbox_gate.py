"""A root runner's bwrap starts held at a gate into its sandbox's cgroup (gate.py): nothing of the
sandbox may run outside the group, and a gate never admitted must still leave bwrap fully isolated."""
from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from trajgen.sandbox import SandboxError, cgroups, gate
from trajgen.sandbox.backends import SandboxConfig, bwrap_problem, cleanup, open_sandbox
from tests.conftest import arun

pytestmark = [
    pytest.mark.skipif(bwrap_problem() is not None, reason=f"bubblewrap cannot run here: {bwrap_problem()}"),
    pytest.mark.skipif(os.geteuid() != 0 or cgroups.problem() is not None,
                       reason="the gate is for a root runner's sandboxes, which get a cgroup each"),
]


@pytest.fixture
def sandbox(tmp_path: Path):
    config = SandboxConfig(root_dir=str(tmp_path / "sandboxes"), command_timeout=30)
    sandbox = open_sandbox(config, "p1")
    yield sandbox
    arun(sandbox.close())
    cleanup(config)


def waits_at_its_gate(pid: int) -> None:
    """Once bwrap has come to read its gate's pipe: it has no child yet, nor can it make one until the pipe closes."""
    deadline = time.monotonic() + 30
    while not Path(f"/proc/{pid}/wchan").read_text().endswith("pipe_read"):
        assert time.monotonic() < deadline, "bwrap never came to wait at its gate"
        time.sleep(0.01)
    assert Path(f"/proc/{pid}/task/{pid}/children").read_text() == ""


def test_the_sandbox_and_its_bwrap_start_in_its_group(sandbox):
    """Its cgroup namespace is rooted at the group: bwrap was in it before it made the namespace."""
    result = arun(sandbox.run("cat /proc/self/cgroup", 30))
    assert result.exit_code == 0 and result.output
    assert all(line.endswith(":/") for line in result.output.splitlines()), result.output
    bwraps = [pid for pid in sandbox._group.pids() if Path(f"/proc/{pid}/comm").read_text() == "bwrap\n"]
    parents = {Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1] for pid in bwraps}
    assert str(os.getpid()) in parents  # the runner's own child, the bwrap outside the sandbox, is in the group


def test_a_bwrap_that_cannot_join_its_group_is_killed_before_it_starts_anything(sandbox):
    argv, fds, through = sandbox.process_argv(["touch", "started"], {"PATH": "/usr/bin:/bin"})
    for d in sandbox._group.dirs:  # the group is gone (a cleanup racing the sandbox's start)
        d.rmdir()
    started = []

    async def spawn():
        started.append(await asyncio.create_subprocess_exec(*argv, pass_fds=fds))
        for fd in fds:
            os.close(fd)
        waits_at_its_gate(started[0].pid)
        return started[0]

    with pytest.raises(SandboxError, match="cannot put the sandbox in its cgroup"):
        arun(gate.start(spawn, through))
    assert started[0].returncode == -9
    assert not os.path.exists(os.path.join(sandbox.host_dir, "started"))


def test_a_bwrap_killed_from_outside_at_its_gate_fails_its_start_saying_why(sandbox):
    argv, fds, through = sandbox.process_argv(["touch", "started"], {"PATH": "/usr/bin:/bin"})

    async def spawn():
        process = await asyncio.create_subprocess_exec(*argv, pass_fds=fds)
        for fd in fds:
            os.close(fd)
        waits_at_its_gate(process.pid)
        process.kill()  # the OOM killer, or a user's kill -9
        await process.wait()
        return process

    with pytest.raises(SandboxError, match="cannot put the sandbox in its cgroup"):
        arun(gate.start(spawn, through))
    assert not os.path.exists(os.path.join(sandbox.host_dir, "started"))


def test_a_start_cancelled_while_bwrap_moves_kills_it_once_the_move_is_over(sandbox, monkeypatch):
    """The move finishes before bwrap is killed: a pid moved after its process was reaped could be another's."""
    argv, fds, through = sandbox.process_argv(["touch", "started"], {"PATH": "/usr/bin:/bin"})
    moving, go_on, moved = threading.Event(), threading.Event(), []
    enter = through.group.enter

    def slow_enter(pid: int) -> None:
        moving.set()
        go_on.wait(30)
        enter(pid)
        moved.append(pid in through.group.pids())

    monkeypatch.setattr(through.group, "enter", slow_enter)

    async def cancelled_start():
        started = []

        async def spawn():
            started.append(await asyncio.create_subprocess_exec(*argv, pass_fds=fds))
            for fd in fds:
                os.close(fd)
            return started[0]

        starting = asyncio.create_task(gate.start(spawn, through))
        await asyncio.to_thread(moving.wait, 30)
        starting.cancel()
        go_on.set()
        with pytest.raises(asyncio.CancelledError):
            await starting
        return started[0]

    process = arun(cancelled_start())
    assert moved == [True] and process.returncode == -9
    assert not os.path.exists(os.path.join(sandbox.host_dir, "started"))


def test_a_gate_closed_without_admitting_leaves_bwrap_fully_isolated(sandbox):
    """The runner dies between starting bwrap and admitting it: bwrap goes on with every option."""
    argv, fds, through = sandbox.process_argv(["sh", "-c", "id -u; readlink /proc/self/ns/net"],
                                              {"PATH": "/usr/bin:/bin"})
    process = subprocess.Popen(argv, pass_fds=fds, stdout=subprocess.PIPE, text=True)
    for fd in fds:
        os.close(fd)
    waits_at_its_gate(process.pid)
    os.close(through.fd)
    out, _ = process.communicate(timeout=30)
    uid, net = out.split()
    assert int(uid) == sandbox.uid and net != os.readlink("/proc/self/ns/net")
    assert process.returncode == 0
