"""Which host paths a bubblewrap sandbox shows on its own (the system dirs), and how a path under none of
them is made reachable; shared by the local backend and what an MCP config makes visible (visible.py)."""
from __future__ import annotations

import functools
import os
import posixpath
import sys
from dataclasses import dataclass

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")


def under(path: str, dirs: tuple[str, ...]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def parents_to_pass(path: str, skip: tuple[str, ...] = SYSTEM_DIRS) -> list[str]:
    """The parents of `path`, outermost first, but those under `skip`: e.g. /root is 0700 on the host,
    and the sandbox's uid must be able to pass through it."""
    parents: list[str] = []
    parent = posixpath.dirname(path)
    while parent != "/" and not under(parent, skip):
        parents.insert(0, parent)
        parent = posixpath.dirname(parent)
    return parents


def passable_parents(path: str, skip: tuple[str, ...] = SYSTEM_DIRS) -> list[str]:
    """bwrap options making each parent of `path` but those under `skip` a passable dir."""
    return _passable(parents_to_pass(path, skip))


def _passable(dirs: list[str] | tuple[str, ...]) -> list[str]:
    return [a for d in dirs for a in ("--perms", "0755", "--dir", d)]


@dataclass(frozen=True)
class SystemView:
    """What every local sandbox shows read-only at its own path: the system dirs, those that are symlinks
    (/bin -> usr/bin) recreated, and the running Python, its parents outside them made passable."""
    links: tuple[tuple[str, str], ...]  # (path, target)
    dirs: tuple[str, ...]
    parents: tuple[str, ...]  # made 0755, outermost first

    def bwrap_args(self) -> list[str]:
        links = [a for path, target in self.links for a in ("--symlink", target, path)]
        return [*links, *_passable(self.parents), *(a for d in self.dirs for a in ("--ro-bind", d, d))]


@functools.cache
def system_view() -> SystemView:
    """Found once per process: the host's layout does not change under a run."""
    links = tuple((d, os.readlink(d)) for d in SYSTEM_DIRS if os.path.islink(d))
    dirs = tuple(d for d in SYSTEM_DIRS if not os.path.islink(d) and os.path.isdir(d))
    prefix = sys.base_prefix  # on the commands' PATH (local.sandbox_env); an MCP server is shown its own (visible.py)
    if under(prefix, SYSTEM_DIRS):
        return SystemView(links, dirs, ())
    return SystemView(links, (*dirs, prefix), tuple(parents_to_pass(prefix)))
