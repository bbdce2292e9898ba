"""File tools' access to a local work dir from the host, as root, without ever following a link out.

A path is walked one component at a time from an fd of the work dir, each opened with O_NOFOLLOW
relative to the one before (openat). A symlink met on the way is read and followed by hand only
while it stays inside the work dir; `..` never climbs above it. So a sandbox command that swaps a
directory for a link between our check and our write gains nothing: the swapped link is opened as
a link (ELOOP), not followed. Created files and directories are chowned through their fd.
"""
from __future__ import annotations

import errno
import os
import posixpath
import stat
from typing import Iterator

from trajgen.sandbox import SandboxError

MAX_LINKS = 40
CHUNK = 1 << 20
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Outside(SandboxError):
    """The path, or a symlink on it, leads out of the work dir."""


class WorkDir:
    """A work dir on the host (`host_dir`), seen by commands at `cwd`, its new files owned by `owner`."""

    def __init__(self, host_dir: str, cwd: str, owner: int | None) -> None:
        self.host_dir, self.cwd, self.owner = host_dir, cwd, owner

    def relative(self, path: str) -> list[str]:
        """The components of a sandbox path below the work dir; SandboxError if it leaves it."""
        if not isinstance(path, str) or not path or "\0" in path:
            raise SandboxError("path must be a non-empty string")
        full = posixpath.normpath(posixpath.join(self.cwd, path))
        if full != self.cwd and not full.startswith(self.cwd.rstrip("/") + "/"):
            raise Outside(f"path {path!r} is outside the work dir {self.cwd}; only files under it are reachable")
        return [part for part in posixpath.relpath(full, self.cwd).split("/") if part != "."]

    def check(self, path: str) -> None:
        """Outside (a SandboxError) if `path` or a symlink on it leads out of the work dir; missing parts are fine."""
        if self.relative(path):
            try:
                os.close(self._walk(path, create=False)[0])
            except Outside:
                raise
            except SandboxError:
                pass

    def _walk(self, path: str, create: bool) -> tuple[int, str]:
        """(an fd of the parent directory, the final name) with every link resolved inside the work dir."""
        todo = self.relative(path)
        if not todo:
            raise SandboxError(f"{path!r} is the work dir itself, not a file")
        fds = [os.open(self.host_dir, DIR_FLAGS)]
        links = 0
        try:
            while True:
                name = todo.pop(0)
                if name == "..":
                    if len(fds) == 1:
                        raise Outside(f"path {path!r} passes through a symlink that leads outside the work dir {self.cwd}")
                    os.close(fds.pop())
                    continue
                target = _link(fds[-1], name)
                if target is not None:
                    links += 1
                    if links > MAX_LINKS:
                        raise SandboxError(f"path {path!r}: too many levels of symlinks")
                    if target.startswith("/"):
                        try:
                            rest = self.relative(target)
                        except SandboxError:
                            raise Outside(
                                f"path {path!r} passes through a symlink that leads outside the work dir {self.cwd}"
                            ) from None
                        for fd in fds[1:]:
                            os.close(fd)
                        del fds[1:]
                    else:
                        rest = [part for part in target.split("/") if part not in ("", ".")]
                    todo[:0] = rest
                    if not todo:
                        raise SandboxError(f"{path!r} is the work dir itself, not a file")
                    continue
                if not todo:
                    parent = fds.pop()
                    return parent, name
                fds.append(self._enter(fds[-1], name, create))
        except OSError as e:
            raise SandboxError(f"cannot open {path}: {e.strerror}") from e
        finally:
            for fd in fds:
                os.close(fd)

    def _enter(self, parent: int, name: str, create: bool) -> int:
        try:
            return os.open(name, DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
        os.mkdir(name, 0o755, dir_fd=parent)
        fd = os.open(name, DIR_FLAGS, dir_fd=parent)
        self._own(fd)
        return fd

    def _own(self, fd: int) -> None:
        if self.owner is not None:
            os.fchown(fd, self.owner, self.owner)

    def read_chunks(self, path: str) -> Iterator[bytes]:
        parent, name = self._walk(path, create=False)
        try:  # O_NONBLOCK: opening a FIFO must not hang the worker
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
        except OSError as e:
            raise SandboxError(f"cannot read {path}: {_reason(e)}") from e
        finally:
            os.close(parent)
        with os.fdopen(fd, "rb", buffering=0) as file:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SandboxError(f"cannot read {path}: not a regular file")
            os.set_blocking(fd, True)
            while chunk := file.read(CHUNK):
                yield chunk

    def write(self, path: str, data: bytes) -> None:
        parent, name = self._walk(path, create=True)
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644, dir_fd=parent)
        except OSError as e:
            raise SandboxError(f"cannot write {path}: {_reason(e)}") from e
        finally:
            os.close(parent)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SandboxError(f"cannot write {path}: not a regular file")
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            self._own(fd)
        except OSError as e:
            raise SandboxError(f"cannot write {path}: {e.strerror}") from e
        finally:
            os.close(fd)


def _link(parent: int, name: str) -> str | None:
    """The target of `name` if it is a symlink, else None (also when it does not exist)."""
    try:
        return os.readlink(name, dir_fd=parent)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.ENOENT):
            return None
        raise


def _reason(e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "it was replaced by a symlink while being opened"
    if e.errno == errno.ENXIO:
        return "not a regular file"
    return e.strerror or str(e)
