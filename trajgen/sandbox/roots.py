"""Where local sandboxes live on the host: one root directory per run, one work dir per prompt,
and the identities their commands run as.

A runner holds a lock file beside its root for its whole life (trajgen/locks.py); the kernel drops
the lock when the runner dies, however it dies. So a root whose lock nobody holds is stale, and
any later run removes it, whatever pid namespace either runner lives in. Each live sandbox of a
root runner takes its own uid from a reserved range, also by lock, so no two live sandboxes on
the machine share a keyring, a process limit or the right to signal each other.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
from pathlib import Path

from trajgen import locks

ROOT_PREFIX = "trajgen-sandboxes-"
UID_BASE = 1_900_000_000  # above any real account; below the 2**31 some tools choke on
UID_COUNT = 65_536
# one lock file per uid ever taken, kept (unlinking one could hand its uid out twice); machine-wide,
# whatever TMPDIR each runner has
UID_LOCKS = Path("/run/trajgen-uids")
MNT_DETACH = 2
MS_NOSUID, MS_NODEV = 2, 4
_held: dict[str, int] = {}  # root dir -> the fd of its lock, held until the process ends


def new_root_dir() -> str:
    """Create the run's sandbox root and hold its lock; stale roots of dead runners go first."""
    sweep_stale_roots()
    fd, lock = tempfile.mkstemp(prefix=ROOT_PREFIX, suffix=".lock")
    os.close(fd)
    _held[lock.removesuffix(".lock")] = locks.acquire(Path(lock))
    root = lock.removesuffix(".lock")
    os.mkdir(root, 0o700)
    return root


def release_root(root: str) -> None:
    """Give up the root's lock (and its file) once the root is gone, if this process holds it."""
    fd = _held.pop(root, None)
    if fd is not None:
        Path(root + ".lock").unlink(missing_ok=True)
        locks.release(fd)


def sweep_stale_roots() -> None:
    """A runner killed with -9 cannot clean up: remove the roots no live runner holds."""
    for lock in Path(tempfile.gettempdir()).glob(f"{ROOT_PREFIX}*.lock"):
        if not locks.is_held(lock):
            remove_root(str(lock.with_suffix("")))
            lock.unlink(missing_ok=True)


def remove_root(root: str) -> None:
    """Remove a root and every work dir in it, unmounting the sized ones first."""
    if os.path.isdir(root):
        for entry in os.scandir(root):
            unmount(entry.path)
    shutil.rmtree(root, ignore_errors=True)


def new_work_dir(root: str, key: str, size_mb: int, owner: int | None, sized: bool) -> str:
    """A fresh work dir for prompt `key` under the run's root (a retried prompt starts clean): a tmpfs
    of `size_mb` when `sized` (root only), owned by `owner` when given. OSError if it cannot be made,
    ValueError if `key` is not a plain file name."""
    if not key or "/" in key or key in (".", ".."):
        raise ValueError(f"sandbox key {key!r} is not a plain file name")
    path = os.path.join(os.path.realpath(root), key)
    os.makedirs(root, mode=0o700, exist_ok=True)
    remove_work_dir(path)
    os.mkdir(path, 0o755)
    if sized:
        mount_tmpfs(path, size_mb, owner or 0)
    elif owner is not None:
        os.chown(path, owner, owner)
    return path


def remove_work_dir(path: str) -> None:
    unmount(path)
    shutil.rmtree(path, ignore_errors=True)


def mount_tmpfs(path: str, size_mb: int, owner: int) -> bool:
    """Put a tmpfs of `size_mb` at `path` (owned by `owner`), so the work dir has a size; False when not root."""
    if os.geteuid() != 0:
        return False
    options = f"size={size_mb}m,mode=0755,uid={owner},gid={owner}".encode()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"tmpfs", path.encode(), b"tmpfs", ctypes.c_ulong(MS_NOSUID | MS_NODEV), options) != 0:
        raise OSError(ctypes.get_errno(), f"cannot mount a tmpfs at {path}: {os.strerror(ctypes.get_errno())}")
    return True


def unmount(path: str) -> None:
    if os.path.ismount(path):
        ctypes.CDLL(None, use_errno=True).umount2(path.encode(), MNT_DETACH)


def take_uid() -> tuple[int, int]:
    """(a uid no live sandbox on this machine has, the fd holding it): give the fd to `release`."""
    UID_LOCKS.mkdir(mode=0o700, exist_ok=True)
    for uid in range(UID_BASE, UID_BASE + UID_COUNT):  # lowest free first: few lock files ever exist
        try:
            return uid, locks.acquire(UID_LOCKS / str(uid))
        except locks.LockHeld:
            continue
    raise OSError("every uid of the sandbox range is in use")
