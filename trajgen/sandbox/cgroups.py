"""A cgroup per local sandbox: one limit on its memory (/tmp and work dir pages included), its
processes and its CPU share, whatever the commands do, and one place that holds every process of
the sandbox (its command loop, its MCP servers, whatever they started) to end them all at once.

Both hierarchies are supported, found at start: cgroup v2 (`/sys/fs/cgroup/cgroup.controllers`),
where the runner's own cgroup must be able to hand `memory` and `pids` to children, and v1 with
the `memory`, `pids` and `cpu` controllers mounted at `/sys/fs/cgroup/<controller>` (and `freezer`,
used where mounted, so that nothing forks while the group is killed). Groups live
under the runner's own cgroup, as `trajgen-<run id>.<session label>/<name>` (a sandbox's:
`<worker pid>-<n>`, kept for the worker's next sandbox, slots.py): the session's end
removes its own, and the next invocation of a run those a runner killed with -9 left. Where neither
can be used (no root, a cgroup that is not delegated) `problem()` says why and the sandbox keeps
only per-process limits.
"""
from __future__ import annotations

import functools
import os
import time
from pathlib import Path

from trajgen.sandbox.process import kill_pids

CGROUP_FS = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("pids", "memory", "cpu")  # pids joined first: a task in any of a group's is counted (Group.kill)
V1_FREEZER = "freezer"
V2_CONTROLLERS = ("memory", "pids")
KILL_DEADLINE = 10.0
BROWSER = "browser"  # the label of a worker's browser group: trajgen-<run id>.browser-<pid>
# how a group is frozen and thawed: the file, its values, and the file and line that say it is frozen (v2, v1)
FREEZERS = (("cgroup.freeze", "1", "0", "cgroup.events", "frozen 1"),
            ("freezer.state", "FROZEN", "THAWED", "freezer.state", "FROZEN"))


def _own_path(controller: str) -> str:
    """The runner's cgroup in a hierarchy: "" is the v2 one, else a v1 controller's."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (controller in controllers.split(",")) if controller else controllers == "":
            return path.lstrip("/")
    raise OSError(f"no {controller or 'v2'} cgroup in /proc/self/cgroup")


@functools.cache
def _bases() -> tuple[tuple[Path, ...], str | None]:
    """(the directories run groups are made in, one per hierarchy used) or why there are none."""
    if os.geteuid() != 0:
        return (), "the runner is not root"
    try:
        if (CGROUP_FS / "cgroup.controllers").exists():
            base = CGROUP_FS / _own_path("")
            enabled = (base / "cgroup.subtree_control").read_text().split()
            if missing := [c for c in V2_CONTROLLERS if c not in enabled]:
                (base / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in missing))
            return (base,), None
        if all((CGROUP_FS / c / "cgroup.procs").exists() for c in V1_CONTROLLERS):
            freezer = (V1_FREEZER,) if (CGROUP_FS / V1_FREEZER / "cgroup.procs").exists() else ()
            return tuple(CGROUP_FS / c / _own_path(c) for c in (*V1_CONTROLLERS, *freezer)), None
    except OSError as e:
        return (), f"the runner's cgroup cannot hand controllers to sandboxes ({e.strerror or e})"
    return (), "no cgroup v2 with memory and pids, nor cgroup v1 memory, pids and cpu controllers"


def problem() -> str | None:
    """Why sandboxes get no cgroup here, or None."""
    return _bases()[1]


class Group:
    """One sandbox's cgroup (a directory per hierarchy used)."""

    def __init__(self, dirs: tuple[Path, ...]) -> None:
        self.dirs = dirs

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def enter(self, pid: int) -> None:
        """Move process `pid` into the group, in each hierarchy: what it starts from then on is born in it."""
        for path in self.procs_files:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, b"%d" % pid)
            finally:
                os.close(fd)

    def oom_kills(self) -> int:
        """How many processes the kernel killed for going over the memory limit so far."""
        if self._oom_file is None:
            return 0
        counts = _read(self._oom_file)
        at = counts.find(b"\noom_kill ") + 1  # the line, not oom_kill_disable nor oom_group_kill
        return int(counts[at + 9:counts.index(b"\n", at)]) if at else 0

    def counted_tasks(self) -> int:
        """The tasks its pids limit counts: those not yet reaped too (an orphan that only the host's
        init reaps, bubblewrap's own init killed with it), which cgroup.procs no longer lists."""
        return sum(int(_read(f)) for f in self._pids_files)

    @functools.cached_property
    def _pids_files(self) -> list[str]:
        return [str(d / "pids.current") for d in self.dirs if (d / "pids.current").exists()]

    @functools.cached_property
    def _oom_file(self) -> str | None:
        """Where the kernel counts them (v2, v1): read before and after every command, so found once."""
        names = (d / name for d in self.dirs for name in ("memory.events", "memory.oom_control"))
        return next((str(path) for path in names if path.exists()), None)

    def _may_hold_tasks(self) -> bool:
        """False when its counter says it holds nothing, or it is gone: a read instead of four listings."""
        try:
            return self.counted_tasks() > 0
        except FileNotFoundError:
            return False

    def pids(self) -> set[int]:
        """The processes in the group now (a killed one leaves it as it dies, before it is reaped)."""
        found: set[int] = set()
        for d in self.dirs:
            try:
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except FileNotFoundError:
                pass
        return found

    def kill(self) -> None:
        """SIGKILL every process in the group and return once it is empty; OSError if it is not within
        KILL_DEADLINE. v2's cgroup.kill does it in the kernel; else the group is frozen while it is
        listed and signalled, so no process can fork a new one in between."""
        deadline = time.monotonic() + KILL_DEADLINE
        while self._may_hold_tasks() and (pids := self.pids()):
            if time.monotonic() > deadline:
                raise OSError(f"{len(pids)} process(es) of the sandbox were still alive {KILL_DEADLINE:g} s after "
                              "SIGKILL")
            if (self.dirs[0] / "cgroup.kill").exists():
                (self.dirs[0] / "cgroup.kill").write_text("1")
            else:
                self._frozen_kill(deadline)
            time.sleep(0.005)

    def _frozen_kill(self, deadline: float) -> None:
        """Freeze (where a freezer is there), SIGKILL all, thaw: a frozen process dies once thawed."""
        for d in self.dirs:
            for state, freeze, thaw, events, frozen in FREEZERS:
                if (d / state).exists():
                    (d / state).write_text(freeze)
                    while frozen not in (d / events).read_text().splitlines() and time.monotonic() < deadline:
                        time.sleep(0.001)
                    try:
                        kill_pids(sorted(self.pids()))
                    finally:
                        (d / state).write_text(thaw)
                    return
        kill_pids(sorted(self.pids()))

    def remove(self) -> None:
        """Kill whatever still runs in it (one a killed runner left frozen included), then remove it."""
        try:
            self.kill()
        except OSError:  # _remove goes on trying until its own deadline
            pass
        _remove(self.dirs)


def create(run_id: str, label: str, key: str, memory_bytes: int, max_processes: int) -> Group:
    """The sandbox's cgroup with its limits; OSError if it cannot be made."""
    dirs = tuple(base / _session(run_id, label) / key for base in _bases()[0])
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        if (d / "memory.max").exists():
            (d / "memory.max").write_text(str(memory_bytes))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
        if (d / "memory.limit_in_bytes").exists():
            (d / "memory.limit_in_bytes").write_text(str(memory_bytes))
        if (d / "pids.max").exists():
            (d / "pids.max").write_text(str(max_processes))
    return Group(dirs)


def remove(run_id: str = "*", label: str = "*") -> None:
    """Remove every group of a session (`label`: after a worker crash, or at its end) or of a run
    (`run_id`: what earlier invocations left); safe to repeat."""
    bases = _bases()[0]
    for name in {run.name for base in bases for run in base.glob(_session(run_id, label)) if run.is_dir()}:
        keys = {p.name for base in bases if (base / name).is_dir() for p in (base / name).iterdir() if p.is_dir()}
        for key in keys:  # each group across its hierarchies, so that it is killed frozen
            Group(tuple(base / name / key for base in bases)).remove()
        _remove(tuple(base / name for base in bases))


def _read(path: str) -> bytes:
    """A small counter file: read around every command and at each sandbox's end, at a third of open()'s cost."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def _session(run_id: str, label: str) -> str:
    return f"trajgen-{run_id or '-'}.{label}"


def _remove(dirs: tuple[Path, ...]) -> None:
    """Kill each group's processes until it can be removed (dying processes keep it busy a moment)."""
    deadline = time.monotonic() + KILL_DEADLINE
    for d in dirs:
        while not _rmdir(d) and time.monotonic() < deadline:
            try:
                kill_pids([int(p) for p in (d / "cgroup.procs").read_text().split()])
            except FileNotFoundError:
                break
            time.sleep(0.01)


def _rmdir(d: Path) -> bool:
    """True once `d` is gone."""
    try:
        d.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True
