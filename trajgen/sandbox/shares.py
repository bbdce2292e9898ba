"""Each sandbox's share of the kernel tables the whole machine shares, which neither a cgroup nor a
uid bounds: open files (`fs.file-max`) and PTYs (`kernel.pty.max`).

A run may have `slots` sandboxes open at once (its concurrency); together they may take half of
each table, the other half staying for the host and other runs. A sandbox's open files are bounded
by RLIMIT_NOFILE per process times its process limit, so the per-process limit is its share
divided by `max_processes`; its PTYs by the `max=` of a devpts instance of its own. Each share
has a floor a working shell needs, which a run of thousands of slots may exceed (docs/sandboxes.md).
"""
from __future__ import annotations

import functools
from pathlib import Path

MIN_OPEN_FILES = 64  # a compiler, pip or a test runner at work
MAX_OPEN_FILES = 1024  # the usual soft limit: more is a share nobody needs
MIN_PTYS = 8


@functools.cache
def _sysctl(name: str, default: int) -> int:
    try:
        return int(Path("/proc/sys", name).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def open_files(slots: int, max_processes: int) -> int:
    """RLIMIT_NOFILE for each process of a sandbox."""
    share = _sysctl("fs/file-max", 1 << 20) // (2 * slots * max_processes)
    return max(MIN_OPEN_FILES, min(MAX_OPEN_FILES, share))


def ptys(slots: int) -> int:
    """The PTYs one sandbox may hold: of the instances beside the host's, which `kernel.pty.reserve` leaves."""
    usable = _sysctl("kernel/pty/max", 4096) - _sysctl("kernel/pty/reserve", 1024)
    return max(MIN_PTYS, usable // (2 * slots))
