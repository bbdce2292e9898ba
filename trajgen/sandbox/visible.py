"""What an MCP server's config names, made visible read-only in its local sandbox at its own path.

The local sandbox shows only the system dirs, so a server in a venv under /tmp or a home directory,
the Python that venv was made from, a `server.py` of the user's own given in `args`, the config's
`cwd`, and the cache `uvx` runs from would all be missing (a path under /tmp is hidden by the
sandbox's own /tmp). Each is bound read-only after that /tmp. uv's dirs are writable tmpfs roots
(uv writes its locks there) over their entries bound read-only: nothing of the host is written.
Only what the config names: never `/` or a home directory whole, never a secret dir (~/.ssh...),
never the run directory or the sandbox root (hidden again inside a bound dir).
"""
from __future__ import annotations

import functools
import os
import posixpath
import shutil
import subprocess
from dataclasses import dataclass

from trajgen.sandbox import SandboxError
from trajgen.sandbox.binds import SYSTEM_DIRS, passable_parents, under

SYSTEM = (*SYSTEM_DIRS, "/dev", "/proc")  # shown already, or the sandbox's own
SECRETS = (".ssh", ".gnupg", ".aws", ".azure", ".kube", ".docker", ".config/gcloud", ".password-store",
           ".local/share/keyrings", ".netrc", ".git-credentials", ".pypirc", ".npmrc")  # under a home directory
BROAD = ("/", "/home", "/root", "/tmp", "/var", "/run", "/srv", "/mnt", "/media", "/opt")  # never shown whole
UV = ("uv", "uvx")
HOST_ASKED = 30  # seconds `uv` or `pyenv` may take to say where their files are


@dataclass(frozen=True)
class Visible:
    argv: tuple[str, ...]  # the command as found on the host's PATH; a relative file in args made absolute
    env: tuple[tuple[str, str], ...]  # where the caches are; offline without the network
    binds: tuple[str, ...]  # host paths shown read-only at their own path, in this order
    scratch: tuple[str, ...]  # uv's dirs: a writable tmpfs each, under their entries' binds
    masks: tuple[str, ...]  # inside a bound dir, hidden again: the run directory, the sandbox root, secrets
    cwd: str | None  # the config's cwd: the server's working directory instead of the work dir

    def bwrap_args(self) -> list[str]:
        """bubblewrap's options showing all of it, to follow the sandbox's /tmp."""
        args: list[str] = []
        for path in self.binds:
            args += passable_parents(path)
            args += ["--perms", "1777", "--tmpfs", path] if path in self.scratch else ["--ro-bind", path, path]
        for path in self.masks:
            args += ["--tmpfs", path] if os.path.isdir(path) else ["--ro-bind", "/dev/null", path]
        return args


def plan(command: str, args: tuple[str, ...], cwd: str | None, network: bool, hidden: tuple[str, ...]) -> Visible:
    """What the server `command args` (in `cwd`) needs shown; SandboxError, naming the fix, for a command
    not on the PATH or a path that cannot be shown."""
    home = os.path.expanduser("~")
    secrets = tuple(posixpath.join(home, s) for s in SECRETS)
    hidden = tuple(os.path.realpath(h) for h in hidden if h)
    if cwd is not None:
        cwd = os.path.abspath(os.path.expanduser(cwd))
        if not os.path.isdir(cwd):
            raise SandboxError(f'"cwd" {cwd} is not a directory on this machine')
    executable = _find(command, cwd)
    named: list[str] = [cwd] if cwd else []
    argv = [executable]
    for arg in args:
        option, eq, value = arg.partition("=") if arg.startswith("-") else ("", "", arg)
        path = _named_path(value, cwd)
        if path is not None:
            named.append(path)
            if value.startswith("~") or (not os.path.isabs(value) and cwd is None):  # no shell expands it there,
                arg = f"{option}{eq}{path}"  # and the server works in the work dir, not the runner's directory
        argv.append(arg)
    env: dict[str, str] = {}
    scratch: list[str] = []
    binds = [p for e in (executable, *_interpreters(executable)) for p in _installation(e, home)]
    name = posixpath.basename(executable)
    if name in UV and not network:  # with the network, uv fills a cache of the work dir's, as on a new machine
        roots, uv_env = _uv_places(executable)
        scratch, env = list(roots), {**env, **uv_env, "UV_OFFLINE": "1"}
        binds += _installation(uv_env["UV_PYTHON"], home) if "UV_PYTHON" in uv_env else []
    for path in (*named, *binds):
        _check(path, home, secrets, hidden)
    shown = _without_nested([p for p in (*binds, *named) if not under(p, SYSTEM)])
    shown = sorted({*shown, *scratch, *_entries(scratch)}, key=lambda p: (p.count("/"), p))  # a root before its entries
    masks = [m for m in (*hidden, *secrets) if os.path.lexists(m) and any(under(m, (p,)) and m != p for p in shown)]
    return Visible(tuple(argv), tuple(env.items()), tuple(shown), tuple(scratch), tuple(masks), cwd)


def _find(command: str, cwd: str | None) -> str:
    """`command` as the host runs it: by its path, or found on the host's PATH (a pyenv shim followed
    to the Python it stands for)."""
    if "/" in command:
        path = os.path.abspath(os.path.join(cwd or os.getcwd(), os.path.expanduser(command)))
        if not os.path.isfile(path):
            raise SandboxError(f'"command" {command}: no such file on this machine')
        return path
    found = shutil.which(command)
    if found is None:
        hint = {"uvx": " (install uv: pip install uv)", "uv": " (install uv: pip install uv)",
                "npx": " (install Node.js, which brings npx)", "node": " (install Node.js)"}.get(command, "")
        raise SandboxError(f'"command" {command} is not on the PATH ({os.environ.get("PATH", "")}){hint}; '
                           "install it, or give its absolute path")
    shims = posixpath.dirname(found)
    pyenv = posixpath.join(posixpath.dirname(shims), "libexec", "pyenv")
    if posixpath.basename(shims) == "shims" and os.path.isfile(pyenv):
        return _pyenv_which(pyenv, command) or found
    return os.path.abspath(found)


@functools.cache
def _pyenv_which(pyenv: str, command: str) -> str | None:
    """What a pyenv shim runs (asked once per worker: a server starts in every prompt)."""
    return _ask([pyenv, "which", command])


def _named_path(value: str, cwd: str | None) -> str | None:
    """The host path an argument names, if it is one: an absolute or ~ path that exists, or a file
    relative to the config's cwd (else the runner's directory)."""
    if not value or value.startswith("-"):
        return None
    path = os.path.expanduser(value)
    if not os.path.isabs(path):
        if "\0" in path or not os.path.isfile(path := os.path.join(cwd or os.getcwd(), path)):
            return None
    return os.path.abspath(path) if os.path.lexists(path) else None


def _installation(executable: str, home: str) -> list[str]:
    """What an executable needs: its prefix (the dir above its bin/; the bin dir itself under a broad
    dir such as ~/.local), through every symlink, and a venv's base Python (its pyvenv.cfg `home`)."""
    needed: list[str] = []
    todo, seen = [executable], set()
    while todo:
        path = os.path.abspath(todo.pop())
        if path in seen or not os.path.lexists(path):
            continue
        seen.add(path)
        directory = posixpath.dirname(path)
        prefix = posixpath.dirname(directory)
        if posixpath.basename(directory) == "bin" and not _broad(prefix, home):
            needed.append(prefix)
            if os.path.isfile(config := posixpath.join(prefix, "pyvenv.cfg")):
                base = _venv_home(config)
                if base:
                    todo += [posixpath.join(base, n) for n in ("python3", "python") if os.path.lexists(
                        posixpath.join(base, n))]
        else:
            needed.append(directory if posixpath.basename(directory) == "bin" else path)
        if os.path.islink(path):
            todo.append(posixpath.join(directory, os.readlink(path)))
    return needed


def _broad(path: str, home: str) -> bool:
    return path in BROAD or path in (home, posixpath.join(home, ".local")) or path == posixpath.dirname(home)


def _venv_home(config: str) -> str | None:
    try:
        with open(config, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition("=")
                if key.strip() == "home":
                    return value.strip()
    except OSError:
        pass
    return None


def _interpreters(executable: str) -> list[str]:
    """A script's interpreter named on its #! line (a console script's Python, say)."""
    try:
        with open(executable, "rb") as f:
            first = f.readline(512)
    except OSError:
        return []
    words = first[2:].decode(errors="replace").split() if first.startswith(b"#!") else []
    return [words[0]] if words and words[0] != "/usr/bin/env" and os.path.isabs(words[0]) else []


def _check(path: str, home: str, secrets: tuple[str, ...], hidden: tuple[str, ...]) -> None:
    """SandboxError for a path that must not be shown: too broad, a secret, or the run's own files."""
    for each in dict.fromkeys((path, os.path.realpath(path))):
        if each in BROAD or under(home, (each,)):
            raise SandboxError(f"{path} would show the whole of {each} to the server, {home} included; "
                               "name the server's own file or directory instead")
        if under(each, secrets):
            raise SandboxError(f"{path} holds secrets ({each}): it is never shown in a sandbox")
        if under(each, hidden):
            raise SandboxError(f"{path} is inside the run's own files ({each}): it is never shown in a sandbox")


def _without_nested(paths: list[str]) -> list[str]:
    """Each path once, none inside another (a bind over a read-only bind cannot make its mount point)."""
    kept: list[str] = []
    for path in sorted(set(paths), key=len):
        if not under(path, tuple(kept)):
            kept.append(path)
    return kept


def _entries(roots: list[str]) -> list[str]:
    """A cache root's entries, each to be bound read-only inside its writable tmpfs (uv's interpreter
    records are not: uv rewrites them for the sandbox's view of the interpreters)."""
    return [posixpath.join(root, e) for root in roots for e in sorted(os.listdir(root))
            if not e.startswith(("interpreter-v", "sdists-v", ".lock", ".tmp"))]


@functools.cache
def _uv_places(uv: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """uv's cache, tools and Python dirs on this machine, and the variables that point the sandbox's uv at
    them (its HOME there is the work dir); UV_PYTHON pins the interpreter the cached environments were
    made with, or uv's search there would find another and build its environment anew."""
    uv = posixpath.join(posixpath.dirname(uv), "uv")
    places = {"UV_CACHE_DIR": _ask([uv, "cache", "dir"]), "UV_TOOL_DIR": _ask([uv, "tool", "dir"]),
              "UV_PYTHON_INSTALL_DIR": _ask([uv, "python", "dir"]),
              "UV_PYTHON": _ask([uv, "python", "find", "--system"])}
    env = {k: v for k, v in places.items() if v and os.path.exists(v)}
    roots = tuple(env[k] for k in ("UV_CACHE_DIR", "UV_TOOL_DIR", "UV_PYTHON_INSTALL_DIR") if k in env)
    return roots, {**env, "UV_PYTHON_DOWNLOADS": "never"}


def _ask(argv: list[str]) -> str | None:
    """The last line a host tool prints, or None if it fails."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=HOST_ASKED, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[-1].strip() if done.returncode == 0 and lines else None
