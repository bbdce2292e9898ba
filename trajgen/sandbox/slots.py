"""What a root runner's local sandbox holds on the host besides its work dir: a uid of its own, a
cgroup and a devpts instance, kept for the worker's next sandbox once every process of it is gone.

Taking a uid (a scan of the machine's uid locks), making a memory cgroup and mounting a devpts
instance, then undoing it all, cost more than the rest of a fresh sandbox outside bubblewrap
(bench/RESULTS.md). Once a sandbox's cgroup is emptied nothing of it runs, so its uid, group and
PTY instance are what the next sandbox would get fresh: any free uid serves it as well as
another, an empty group keeps only reclaimable page cache charged to it, and nothing in a
sandbox can change a group's limits (no /sys there) or an instance's options. Without a cgroup
nothing proves the processes gone, so nothing is kept; nor with --keep_sandboxes, whose kept work
dirs stay charged to their group. An MCP server's bubblewrap killed with its group leaves its init
to the host's init to reap; until then the group counts it against its process limit, and is not
reused (a new slot is made, as before slots).
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

from trajgen import locks
from trajgen.sandbox import SandboxConfig, cgroups, roots, shares


@dataclass(frozen=True)
class Slot:
    uid: int
    lock: int  # the fd holding the uid (roots.take_uid)
    pts: str  # the devpts instance (roots.new_devpts)
    group: cgroups.Group | None  # None where cgroups cannot be had (cgroups.problem)


_spares: dict[SandboxConfig, list[Slot]] = {}  # by run: a slot's limits and root are its run's
_names = itertools.count()
_next_uid = roots.UID_BASE  # where the next new slot's uid is looked for: past the last one taken, until one is freed


def take(config: SandboxConfig) -> Slot:
    """A slot a closed sandbox of this process left (give_back), else a new one; OSError if one cannot be made."""
    global _next_uid
    spares = _spares.setdefault(config, [])
    while True:
        try:
            slot = spares.pop(0)  # the longest kept, its orphans the likeliest reaped; in threads: no check-then-pop
        except IndexError:
            break
        if _intact(slot):
            return slot
        free(slot)
    uid, lock = roots.take_uid(_next_uid)  # a run's first sandboxes all make slots: without this, O(C) probes each
    _next_uid = uid + 1
    pts = group = None
    try:
        name = f"{os.getpid()}-{next(_names)}"
        pts = roots.new_devpts(config.root_dir, name, shares.ptys(config.slots))
        if cgroups.problem() is None:
            group = cgroups.create(config.run_id, config.label, name, config.memory_mb << 20, config.max_processes)
    except (OSError, ValueError):
        free(Slot(uid, lock, pts or "", group))
        raise
    return Slot(uid, lock, pts, group)


def give_back(slot: Slot, config: SandboxConfig) -> None:
    """Kill every process of the slot's sandbox and keep the slot for the next one; free it instead
    where that cannot be proven (no cgroup, a group that will not empty, --keep_sandboxes)."""
    if slot.group is None or config.keep:
        free(slot)
        return
    try:
        slot.group.kill()
    except OSError:
        free(slot)
        return
    _spares.setdefault(config, []).append(slot)


def free(slot: Slot) -> None:
    """Remove its group and instance and give up its uid (the lowest free ones go first again)."""
    global _next_uid
    _next_uid = roots.UID_BASE
    try:
        if slot.group:
            slot.group.remove()
        if slot.pts:
            roots.remove_work_dir(slot.pts)
    finally:
        locks.release(slot.lock)


def drop(config: SandboxConfig) -> None:
    """Free every kept slot of a run (its end, in the process that ran its sandboxes)."""
    for slot in _spares.pop(config, []):
        free(slot)


def _intact(slot: Slot) -> bool:
    """Whether the slot is as it was left: its group still there (a session's cleanup removes them)
    and counting no task (an unreaped one would hold a share of its process limit for good), its
    instance mounted with no PTY in it (one passed out of the sandbox, held elsewhere, would be)."""
    try:
        return (slot.group is not None and slot.group.dirs[0].is_dir() and slot.group.counted_tasks() == 0
                and os.path.ismount(slot.pts) and os.listdir(slot.pts) == ["ptmx"])
    except OSError:
        return False
