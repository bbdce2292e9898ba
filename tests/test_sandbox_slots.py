"""A closed sandbox's uid, cgroup and PTY instance, kept for the worker's next sandbox (slots.py):
reused only once nothing of the first sandbox can run or hold a PTY, and given up at the run's end."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from trajgen import locks
from trajgen.sandbox import cgroups, roots, slots
from trajgen.sandbox.backends import SandboxConfig, bwrap_problem, cleanup, open_sandbox
from tests.conftest import arun

pytestmark = [
    pytest.mark.skipif(bwrap_problem() is not None, reason=f"bubblewrap cannot run here: {bwrap_problem()}"),
    pytest.mark.skipif(os.geteuid() != 0 or cgroups.problem() is not None,
                       reason="slots need root and cgroups (per-prompt uids, groups and PTY instances)"),
]


@pytest.fixture
def config(tmp_path: Path):
    config = SandboxConfig(root_dir=str(tmp_path / "sandboxes"), command_timeout=30)
    yield config
    cleanup(config)


def held(slot: slots.Slot) -> bool:
    return locks.is_held(roots.UID_LOCKS / str(slot.uid))


def test_the_next_sandbox_gets_the_closed_ones_slot_with_nothing_of_it_left(config):
    first = open_sandbox(config, "p1")
    assert arun(first.run("exec 3<>/dev/ptmx; ls /dev/pts | wc -l; echo mine > /tmp/left", 30)).output == "2\n"
    slot = first._slot
    arun(first.close())
    second = open_sandbox(config, "p2")
    assert second._slot == slot and second.uid == slot.uid and held(slot)
    result = arun(second.run("id -u; ls -A /dev/pts /tmp", 30))
    assert result.output.split() == [str(slot.uid), "/dev/pts:", "ptmx", "/tmp:"], result
    arun(second.close())
    cleanup(config)
    assert not held(slot) and not slot.group.dirs[0].exists() and not os.path.ismount(slot.pts)


def test_a_slot_is_kept_only_once_its_mcp_servers_are_killed(config):
    first = open_sandbox(config, "p1")
    argv, fds, through = first.process_argv(["sleep", "600"], {"PATH": "/usr/bin:/bin"})
    server = subprocess.Popen(argv, pass_fds=fds)  # an MCP server's own bubblewrap, in the sandbox's group
    for fd in fds:
        os.close(fd)
    through.group.enter(server.pid)  # as gate.start does
    os.close(through.fd)
    deadline = time.monotonic() + 30
    while len(first._group.pids()) < 3 and time.monotonic() < deadline:  # bwrap, its init, sleep: up
        time.sleep(0.01)
    slot = first._slot
    arun(first.close())
    assert slot in slots._spares[config] and server.wait(timeout=30) == -9  # killed before the slot was kept


def test_a_pty_held_outside_the_sandbox_keeps_its_instance_from_being_reused(config):
    first = open_sandbox(config, "p1")
    assert arun(first.run("true", 30)).exit_code == 0
    slot = first._slot
    arun(first.close())
    outside = os.open(os.path.join(slot.pts, "ptmx"), os.O_RDWR | os.O_NOCTTY)  # a PTY passed out of the sandbox
    try:
        second = open_sandbox(config, "p2")
        assert second._slot.pts != slot.pts and not slot.group.dirs[0].exists()
        arun(second.close())
    finally:
        os.close(outside)


def test_nothing_is_kept_for_kept_sandboxes(config):
    config = SandboxConfig(root_dir=config.root_dir, keep=True)
    try:
        first = open_sandbox(config, "p1")
        slot = first._slot
        arun(first.close())
        assert not held(slot) and not slot.group.dirs[0].exists()
        second = open_sandbox(config, "p2")
        assert second._slot.group != slot.group and second._slot.pts != slot.pts
        arun(second.close())
    finally:
        cleanup(config)


def test_a_group_still_counting_an_unreaped_task_is_not_reused(config):
    """bubblewrap's init, killed with the rest of the group, is an orphan only the host's init reaps:
    until then it holds one of the group's processes, which a reused group would lose for good."""
    first = open_sandbox(config, "p1")
    slot = first._slot
    arun(first.close())
    enter = "; ".join(f"echo $$ > {f}" for f in slot.group.procs_files)
    unreaped = subprocess.Popen(["sh", "-c", enter])  # exits at once, left a zombie until waited for
    os.waitid(os.P_PID, unreaped.pid, os.WEXITED | os.WNOWAIT)  # until it has exited, leaving it unreaped
    try:
        assert slot.group.pids() == set() and slot.group.counted_tasks() == 1
        second = open_sandbox(config, "p2")
        assert second._slot.group != slot.group and second._slot.pts != slot.pts
        arun(second.close())
    finally:
        unreaped.wait()


def test_new_slots_look_for_a_uid_past_the_last_one_taken_until_one_is_freed(config, monkeypatch):
    """A run's first sandboxes all make slots: probing every uid the worker already holds again for
    each one made the run's start cost O(C^2) lock probes (bench/RESULTS.md)."""
    take, starts = roots.take_uid, []

    def recording(start):
        starts.append(start)
        return take(start)

    monkeypatch.setattr(roots, "take_uid", recording)
    monkeypatch.setattr(slots, "_next_uid", roots.UID_BASE)
    made = [slots.take(config) for _ in range(3)]
    slots.free(made.pop())
    made.append(slots.take(config))
    for slot in made:
        slots.free(slot)
    assert starts == [roots.UID_BASE, made[0].uid + 1, made[1].uid + 1, roots.UID_BASE]


def test_a_uid_is_looked_for_from_the_start_given_round_to_the_lowest():
    last = roots.UID_BASE + roots.UID_COUNT - 1
    uid, lock = roots.take_uid(last)
    try:
        assert uid == last  # nothing else takes uids from the top
        wrapped, other = roots.take_uid(last)
        locks.release(other)
        assert roots.UID_BASE <= wrapped < last
    finally:
        locks.release(lock)
