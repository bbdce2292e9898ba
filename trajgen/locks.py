"""Exclusive locks that the kernel releases when their holder dies, so kill -9 leaves none stale.

One runner per run directory, and the sandbox sweep: a sandbox root is stale exactly when no
live runner holds its lock, whatever pid namespace that runner lives in.
"""
from __future__ import annotations

import fcntl
import os
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
