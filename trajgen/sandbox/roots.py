"""Where local sandboxes live on the host: one root directory per run, one work dir per prompt,
and the identities their commands run as.

Roots and their locks live in a private base (private_base: /run/trajgen for root), never in
world-writable /tmp: root unmounts and deletes what is there. A runner holds a lock file beside
its root for its whole life (trajgen/locks.py); the kernel drops the lock when the runner dies,
however it dies. So a root whose lock nobody holds is stale, and any later run removes it,
whatever pid namespace either runner lives in. Each live sandbox of a root runner takes its own
uid from a reserved range, also by lock, so no two live sandboxes on the machine share a keyring,
a process limit or the right to signal each other.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from trajgen import locks
from trajgen.sandbox.binds import SystemView

ROOT_PREFIX = "trajgen-sandboxes-"
ROOT_BASE = "/run/trajgen"  # root's private base; /tmp is writable by every local user
UID_BASE = 1_900_000_000  # above any real account; below the 2**31 some tools choke on
UID_COUNT = 65_536
# one lock file per uid ever taken, kept (unlinking one could hand its uid out twice); machine-wide,
# whatever TMPDIR each runner has
UID_LOCKS = Path("/run/trajgen-uids")
MNT_DETACH, UMOUNT_NOFOLLOW = 2, 8
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 1 << 14, 1 << 18
CLONE_NEWNS = 0x00020000
_held: dict[str, int] = {}  # root dir -> the fd of its lock, held until the process ends


def private_base() -> Path:
    """The directory holding this user's sandbox roots and their locks, made if missing: /run/trajgen
    for root, else trajgen-<uid> in the temp dir. OSError if it is not a real directory of ours that
    nobody else may enter: root deletes and unmounts what is in it."""
    euid = os.geteuid()
    path = Path(ROOT_BASE if euid == 0 else os.path.join(tempfile.gettempdir(), f"trajgen-{euid}"))
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != euid or info.st_mode & 0o077:
        raise OSError(f"{path} is not a directory of uid {euid} closed to others; refusing to keep sandboxes in it")
    return path


def new_root_dir() -> str:
    """Create the run's sandbox root and hold its lock; stale roots of dead runners go first."""
    sweep_stale_roots()
    fd, lock = locks.acquire_new(private_base(), ROOT_PREFIX, ".lock")
    root = lock.removesuffix(".lock")
    _held[root] = fd
    os.mkdir(root, 0o700)
    return root


def release_root(root: str) -> None:
    """Give up the root's lock (and its file) once the root is gone, if this process holds it."""
    fd = _held.pop(root, None)
    if fd is not None:
        Path(root + ".lock").unlink(missing_ok=True)
        locks.release(fd)


def sweep_stale_roots() -> None:
    """A runner killed with -9 cannot clean up: remove the roots no live runner holds.

    Everything is reached through an fd of the private base, opened with O_NOFOLLOW: a symlink, or
    a lock or root not owned by us, is left alone, never followed."""
    euid = os.geteuid()
    base = os.open(private_base(), DIR_FLAGS)
    try:
        for name in os.listdir(base):
            if not (name.startswith(ROOT_PREFIX) and name.endswith(".lock")):
                continue
            try:
                lock = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=base)
            except OSError:  # a symlink (ELOOP) or gone
                continue
            try:  # holding the lock: a runner starting now, or another sweeper, waits or moves on
                info = os.fstat(lock)
                if not stat.S_ISREG(info.st_mode) or info.st_uid != euid or not locks.take_if_free(lock):
                    continue
                _remove_at(base, name.removesuffix(".lock"))
                os.unlink(name, dir_fd=base)
            finally:
                os.close(lock)
    finally:
        os.close(base)


def remove_root(root: str) -> None:
    """Remove a root and every work dir in it, unmounting the sized ones first."""
    parent = os.open(os.path.dirname(root) or ".", DIR_FLAGS)
    try:
        _remove_at(parent, os.path.basename(root))
    finally:
        os.close(parent)


def _remove_at(parent: int, name: str) -> None:
    """Remove directory `name` of the directory open at `parent`, unmounting what is mounted on its
    entries; a symlink or a directory not owned by us is left as it is."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent)
    except OSError:
        return
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            return
        for entry in os.listdir(fd):
            _unmount(f"/proc/self/fd/{fd}/{entry}")
        shutil.rmtree(name, dir_fd=parent, ignore_errors=True)
    finally:
        os.close(fd)


def new_work_dir(root: str, key: str, size_mb: int, owner: int | None, sized: bool) -> str:
    """A fresh work dir for prompt `key` under the run's root (a retried prompt starts clean): a tmpfs
    of `size_mb` when `sized` (root only), owned by `owner` when given. OSError if it cannot be made,
    ValueError if `key` is not a plain file name."""
    path = os.path.join(os.path.realpath(root), _plain(key))
    os.makedirs(root, mode=0o700, exist_ok=True)
    remove_work_dir(path)
    os.mkdir(path, 0o755)
    if sized:
        mount_tmpfs(path, size_mb, owner or 0)
    elif owner is not None:
        os.chown(path, owner, owner)
    return path


def _plain(key: str) -> str:
    """`key` if it is a plain file name, else ValueError."""
    if not key or "/" in key or key in (".", ".."):
        raise ValueError(f"sandbox key {key!r} is not a plain file name")
    return key


def remove_work_dir(path: str) -> None:
    _unmount(path)
    try:
        os.rmdir(path)  # a sized work dir or a PTY instance is empty once detached: 10 µs, not rmtree's 85
    except FileNotFoundError:
        pass
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


def mount_tmpfs(path: str, size_mb: int, owner: int) -> bool:
    """Put a tmpfs of `size_mb` at `path` (owned by `owner`), so the work dir has a size; False when not root."""
    if os.geteuid() != 0:
        return False
    _mount(b"tmpfs", path, b"tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,mode=0755,uid={owner},gid={owner}")
    return True


def own_mount_table() -> None:
    """Give this process (single-threaded still) a private copy of the mount table, so the work dirs
    and PTY instances its sandboxes mount stay out of every other process's table: bubblewrap reads
    the whole table at most of its binds (9 a sandbox here: bench/RESULTS.md). OSError if it cannot."""
    if _libc().unshare(CLONE_NEWNS) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"cannot make a mount namespace: {os.strerror(error)}")
    _mount(b"none", "/", None, MS_REC | MS_PRIVATE, "")  # nothing of ours propagates back to the host's


def _mount(source: bytes, path: str, fstype: bytes | None, flags: int, options: str) -> None:
    if _libc().mount(source, path.encode(), fstype, ctypes.c_ulong(flags), options.encode()) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"cannot mount {(fstype or source).decode()} at {path}: {os.strerror(error)}")


def _unmount(path: str) -> None:
    """Detach what is mounted at `path`, never following a symlink there; nothing (EINVAL) if nothing is."""
    _libc().umount2(path.encode(), MNT_DETACH | UMOUNT_NOFOLLOW)


@functools.cache
def _libc() -> ctypes.CDLL:
    """libc for the calls os lacks; loaded once: a load and its function lookups cost 36 µs a call."""
    return ctypes.CDLL(None, use_errno=True)


def new_devpts(root: str, key: str, max_ptys: int) -> str:
    """A devpts instance of its own for prompt `key`, holding at most `max_ptys` PTYs (root only): the
    PTYs of every other instance count against the machine's `kernel.pty.max`."""
    path = os.path.join(os.path.realpath(root), _plain(key) + ".pts")
    os.makedirs(root, mode=0o700, exist_ok=True)
    remove_work_dir(path)
    os.mkdir(path, 0o755)
    _mount(b"devpts", path, b"devpts", MS_NOSUID | MS_NOEXEC, f"newinstance,ptmxmode=0666,mode=0620,max={max_ptys}")
    return path


DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")  # what bubblewrap's --dev binds from the host's
DEV_LINKS = {"stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2",
             "fd": "/proc/self/fd", "core": "/proc/kcore", "ptmx": "pts/ptmx"}


def new_dev(path: str) -> None:
    """Mount at `path` a read-only /dev holding what bubblewrap's --dev makes (root only): the same
    nodes (the host's modes, owners and numbers), links and empty root-owned shm and pts dirs. Made
    once, bound whole into each sandbox: --dev binds its six nodes one by one, and bubblewrap reads
    the whole mount table at each bind (bench/RESULTS.md)."""
    os.makedirs(path, 0o700, exist_ok=True)
    _mount(b"tmpfs", path, b"tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755")
    try:
        for name in DEV_NODES:
            host, node = os.stat(f"/dev/{name}"), os.path.join(path, name)
            os.mknod(node, host.st_mode, host.st_rdev)
            os.chown(node, host.st_uid, host.st_gid)
            os.chmod(node, stat.S_IMODE(host.st_mode))  # mknod's mode is the umask's to cut
        for name, target in DEV_LINKS.items():
            os.symlink(target, os.path.join(path, name))
        for name in ("shm", "pts"):
            os.mkdir(os.path.join(path, name))
            os.chmod(os.path.join(path, name), 0o755)
        _mount(b"none", path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC, "")
    except OSError:
        _unmount(path)  # not left half made for the next sandbox to take
        raise


def new_view(path: str, view: SystemView, points: tuple[str, ...]) -> None:
    """Mount at `path` the read-only / a root runner's sandboxes are shown: `view`'s dirs (their own
    mounts too, as bubblewrap binds them), links and passable parents, a /dev (new_dev), and the empty
    dirs `points` for bubblewrap to mount on: it can make no other. Made once, bound whole into each
    sandbox (one bind, one read of the mount table, instead of one per dir: bench/RESULTS.md)."""
    os.makedirs(path, 0o700, exist_ok=True)
    _mount(b"tmpfs", path, b"tmpfs", MS_NOSUID | MS_NODEV, "size=64k,nr_inodes=256,mode=0755")
    try:
        for link, target in view.links:
            os.symlink(target, path + link)
        for parent in view.parents:
            os.mkdir(path + parent)
            os.chmod(path + parent, 0o755)  # mkdir's mode is the umask's to cut
        for point in (*points, *view.dirs):  # a mount hides its point's mode
            os.mkdir(path + point)
        for d in view.dirs:
            _bind_read_only(d, path + d)
        new_dev(os.path.join(path, "dev"))
        _mount(b"none", path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, "")
    except OSError:
        _unmount(path)  # with all under it: not left half made for the next sandbox to take
        raise


MOUNT_FLAGS = {b"noexec": MS_NOEXEC, b"noatime": 1 << 10, b"nodiratime": 1 << 11, b"relatime": 1 << 21}


def _bind_read_only(source: str, path: str) -> None:
    """Bind `source` at `path` with every mount under it, each made read-only, nosuid and nodev and
    keeping its other flags (a remount would clear them), as bubblewrap's --ro-bind does."""
    _mount(source.encode(), path, None, MS_BIND | MS_REC, "")
    for point, options in _mounts_under(path):
        kept = sum(flag for name, flag in MOUNT_FLAGS.items() if name in options)
        _mount(b"none", point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | kept, "")


def _mounts_under(path: str) -> list[tuple[str, list[bytes]]]:
    """(mount point, its own options) of `path` and of each mount under it."""
    found, top = [], os.fsencode(path)
    for line in Path("/proc/self/mountinfo").read_bytes().splitlines():
        fields = line.split()
        point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), fields[4])  # \040 is a space
        if point == top or point.startswith(top + b"/"):
            found.append((os.fsdecode(point), fields[5].split(b",")))
    return found


def loop_uid(uid: int) -> int:
    """The effective uid the command loop of the sandbox whose commands run as `uid` starts with: none of theirs."""
    return uid + UID_COUNT


def take_uid(start: int = UID_BASE) -> tuple[int, int]:
    """(a uid no live sandbox on this machine has, the fd holding it): give the fd to `release`. The
    lowest free one from `start` (wrapping round): a caller that takes many in a row passes the one
    after its last, so it does not probe again each uid it holds itself."""
    held = UID_LOCKS if os.geteuid() == 0 else private_base() / "uids"  # a user's: for its containers' uids
    held.mkdir(mode=0o700, exist_ok=True)
    start = start if UID_BASE <= start < UID_BASE + UID_COUNT else UID_BASE
    for uid in itertools.chain(range(start, UID_BASE + UID_COUNT), range(UID_BASE, start)):
        try:
            return uid, locks.acquire(held / str(uid))
        except locks.LockHeld:
            continue
    raise OSError("every uid of the sandbox range is in use")
