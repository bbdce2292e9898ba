"""Each sandbox's share of the kernel tables the whole machine shares, which neither a cgroup nor a
uid bounds: open files (`fs.file-max`) and PTYs (`kernel.pty.max`).

A run may have `slots` sandboxes open at once (its concurrency); together they may take half of
each table, the other half staying for the host and other runs. A sandbox's open descriptors are
bounded by RLIMIT_NOFILE per process times its process limit, so the per-process limit is its
share divided by `max_processes`; its PTYs by the `max=` of a devpts instance of its own. Each share
has a floor a working shell needs, which a run of thousands of slots may exceed (docs/sandboxes.md).

A file object outlives its descriptor, though: `open`, `mmap`, `close` keeps one per mapping that no
rlimit counts (some 65,000 per process, vm.max_map_count). So a root runner raises `fs.file-max`
to LONG_MAX, as systemd does: file objects are then bounded by kernel memory, and each one (the
`struct file` and its mapping, about 400 bytes) is charged to the memory cgroup of the sandbox that
made it, so a sandbox's memory limit bounds its share (widen_file_table).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

MIN_OPEN_FILES = 64  # a compiler, pip or a test runner at work
MAX_OPEN_FILES = 1024  # the usual soft limit: more is a share nobody needs
MIN_PTYS = 8
FILE_MAX = Path("/proc/sys/fs/file-max")
UNBOUNDED = (1 << 63) - 1  # LONG_MAX: what systemd (since v240) sets fs.file-max to


def _read(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@functools.cache
def _sysctl(name: str, default: int) -> int:
    """A sysctl the runner never changes, read once."""
    value = _read(Path("/proc/sys", name))
    return default if value is None else value


def open_files(slots: int, max_processes: int) -> int:
    """RLIMIT_NOFILE for each process of a sandbox, of the table as it is now (widen_file_table raises it)."""
    share = (_read(FILE_MAX) or 1 << 20) // (2 * slots * max_processes)
    return max(MIN_OPEN_FILES, min(MAX_OPEN_FILES, share))


def ptys(slots: int) -> int:
    """The PTYs one sandbox may hold: of the instances beside the host's, which `kernel.pty.reserve` leaves."""
    usable = _sysctl("kernel/pty/max", 4096) - _sysctl("kernel/pty/reserve", 1024)
    return max(MIN_PTYS, usable // (2 * slots))


def widen_file_table() -> str | None:
    """Raise fs.file-max to LONG_MAX if it is lower and the runner is root; the line that says what
    was done, or what is left to do, or None when nothing is."""
    current = _read(FILE_MAX)
    if current is None or current >= UNBOUNDED:
        return None
    why = "so that each sandbox's memory limit bounds the kernel file objects it holds (docs/sandboxes.md)"
    if os.geteuid() != 0:
        return (f"fs.file-max is {current:,}, which one sandbox can fill within its memory; as root, the runner "
                f"would raise it to {UNBOUNDED} as systemd does, {why}")
    try:
        FILE_MAX.write_text(str(UNBOUNDED))
    except OSError as e:
        return (f"cannot raise fs.file-max from {current:,} ({e.strerror or e}): one sandbox can fill it "
                "within its memory")
    return f"raised fs.file-max from {current:,} to {UNBOUNDED} (as systemd does), {why}"
