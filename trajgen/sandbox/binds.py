"""Which host paths a bubblewrap sandbox shows on its own (the system dirs), and how a path under none of
them is made reachable; shared by the local backend and what an MCP config makes visible (visible.py)."""
from __future__ import annotations

import posixpath

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")


def under(path: str, dirs: tuple[str, ...]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def passable_parents(path: str, skip: tuple[str, ...] = SYSTEM_DIRS) -> list[str]:
    """bwrap options making each parent of `path` but those under `skip` a passable dir: e.g. /root is
    0700 on the host, and the sandbox's uid must be able to pass through."""
    args: list[str] = []
    parent = posixpath.dirname(path)
    while parent != "/" and not under(parent, skip):
        args[:0] = ["--perms", "0755", "--dir", parent]
        parent = posixpath.dirname(parent)
    return args
