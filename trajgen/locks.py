"""Exclusive locks that the kernel releases when their holder dies, so kill -9 leaves none stale.

One runner per run directory, and the sandbox sweep: a sandbox root is stale exactly when no
live runner holds its lock, whatever pid namespace that runner lives in.
"""
from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path


class LockHeld(Exception):
    """Another live process holds the lock."""

    def __init__(self, path: Path, holder: str):
        super().__init__(f"{path} is held by pid {holder or 'unknown'}")
        self.path, self.holder = path, holder


def acquire(path: Path, wait: bool = False) -> int:
    """Take the lock at `path` (created if missing), waiting for it only if `wait`; returns the fd to
    keep open. The holder's pid is written into the file so a refused process can name it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise LockHeld(path, holder) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def acquire_new(directory: Path, prefix: str, suffix: str) -> tuple[int, str]:
    """Create a lock file of a fresh name in `directory` and take it. A sweeper may take and unlink
    the file between its creation and our lock; then we try another name."""
    while True:
        fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=directory)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink:
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd, path
        os.close(fd)


def take_if_free(fd: int) -> bool:
    """Take the lock of the file open at `fd` if nobody holds it and it still has a name: the right
    to remove what it guards, which no other process then has."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return os.fstat(fd).st_nlink > 0


def release(fd: int) -> None:
    os.close(fd)


def is_held(path: Path) -> bool:
    """True while a live process holds the lock at `path`; a missing file is not held."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        return held_elsewhere(fd)
    finally:
        os.close(fd)


def held_elsewhere(fd: int) -> bool:
    """True while another open file of the lock file open at `fd` holds its lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
