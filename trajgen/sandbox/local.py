"""The `local` backend: every command runs in a fresh bubblewrap sandbox over the prompt's work dir.

Only system dirs are visible (read-only); the work dir is the one writable place; the command
runs as nobody in its own PID, IPC, UTS and network namespaces with a scrubbed environment and
rlimits. When a PID namespace's first process dies the kernel kills everything in it, so
killing bwrap on a timeout also ends children that called setsid. File tools work host-side on
the work dir, refusing any path that leads out of it.
"""
from __future__ import annotations

import asyncio
import functools
import os
import posixpath
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable

from trajgen.sandbox import ExecResult, SandboxError

if TYPE_CHECKING:
    from trajgen.sandbox.config import SandboxConfig

OUTPUT_CAP = 50_000  # bytes of command output kept: the first and the last half
NOBODY = 65534
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")
DEFAULT_CWD = "/workspace"


class _Capture:
    """Keeps the head and tail of a stream as it arrives, so a flood of output costs no memory."""

    def __init__(self) -> None:
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = OUTPUT_CAP // 2 - len(self.head)
        self.head += chunk[:room] if room > 0 else b""
        self.tail += chunk[max(room, 0):]
        del self.tail[: -(OUTPUT_CAP // 2)]

    def text(self) -> str:
        cut = self.total - len(self.head) - len(self.tail)
        if cut == 0:
            return (self.head + self.tail).decode("utf-8", "replace")
        head, tail = self.head.decode("utf-8", "replace"), self.tail.decode("utf-8", "replace")
        return f"{head}\n[... {cut} bytes of output cut ...]\n{tail}"


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def run_process(
    argv: list[str],
    timeout: float,
    env: dict[str, str],
    cwd: str | None = None,
    on_timeout: Callable[[], Awaitable[None]] | None = None,
) -> ExecResult:
    """Run argv in a new session with stdout+stderr merged and capped; on timeout kill its group.

    The group is killed after a normal exit (ending background jobs the command left; bwrap
    and docker end them anyway) and when the caller is cancelled too; `on_timeout` kills what
    lives beyond our reach.
    The output pipe is our own, not asyncio's: asyncio's `wait()` would also wait for every
    process holding the pipe, such as a background job that escaped with setsid.
    """
    read_fd, write_fd = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.DEVNULL, stdout=write_fd, stderr=write_fd,
            env=env, cwd=cwd, start_new_session=True,
        )
    except OSError as e:
        os.close(read_fd)
        raise SandboxError(f"cannot start {argv[0]}: {e.strerror}") from e
    finally:
        os.close(write_fd)
    stream = asyncio.StreamReader()
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(stream), os.fdopen(read_fd, "rb", 0)
    )
    capture = _Capture()

    async def pump() -> None:
        while chunk := await stream.read(65536):
            capture.add(chunk)

    reader = asyncio.create_task(pump())
    error = None
    try:
        await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        error = f"timed out after {timeout:g} s; the command and its children were killed"
    finally:  # a cancelled caller (prompt deadline, shutdown) must not leave the command running
        _kill_group(proc.pid)
        await proc.wait()
    if error and on_timeout:
        await on_timeout()
    try:  # a process that escaped the group may still hold the pipe: stop waiting for it
        await asyncio.wait_for(reader, 2)
    except TimeoutError:
        pass
    transport.close()
    return ExecResult(capture.text(), None if error else proc.returncode, error)


def sandbox_env(home: str) -> dict[str, str]:
    """The whole environment of a command: nothing of the runner's (API keys above all) gets in."""
    path = f"/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:{sys.base_prefix}/bin"
    return {"PATH": path, "LANG": "C.UTF-8", "HOME": home, "TERM": "dumb", "PYTHONUNBUFFERED": "1"}


def limit_argv(config: SandboxConfig) -> list[str]:
    """prlimit prefix: CPU seconds, data size (memory), processes and file size, inherited by all."""
    return [
        "prlimit", f"--cpu={config.cpu_seconds}", f"--data={config.memory_mb << 20}",
        f"--nproc={config.max_processes}", f"--fsize={config.file_size_mb << 20}", "--",
    ]


def _under(path: str, dirs: tuple[str, ...]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def _system_binds() -> list[str]:
    """Read-only system dirs (symlinks like /bin -> usr/bin recreated) and the running Python."""
    args: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    prefix = sys.base_prefix
    if not _under(prefix, SYSTEM_DIRS):
        parents = []  # e.g. /root is 0700 on the host: nobody must be able to pass through
        parent = posixpath.dirname(prefix)
        while parent != "/":
            parents.insert(0, parent)
            parent = posixpath.dirname(parent)
        for parent in parents:
            args += ["--perms", "0755", "--dir", parent]
        args += ["--ro-bind", prefix, prefix]
    return args


def _identity() -> tuple[list[str], list[str]]:
    """(bwrap flags, command prefix) that make the command run as nobody.

    As root, a user namespace would map nobody onto host root, which owns /etc/shadow and can
    read it; so bwrap stays in the host user namespace and setpriv really becomes nobody.
    Unprivileged, a user namespace maps our own uid to nobody.
    """
    if os.geteuid() == 0:
        setpriv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        return [], [*setpriv, "--bounding-set=-all", "--inh-caps=-all", "--"]
    return ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)], []


def bwrap_argv(host_dir: str, cwd: str, network: bool, command: str) -> list[str]:
    identity, as_nobody = _identity()
    return [
        "bwrap", *_system_binds(), "--perms", "1777", "--tmpfs", "/tmp", "--dev", "/dev", "--proc", "/proc",
        "--bind", host_dir, cwd, "--chdir", cwd,
        "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try",
        *([] if network else ["--unshare-net"]), *identity,
        "--die-with-parent", "--new-session", "--", *as_nobody, "bash", "-c", command,
    ]


@functools.cache
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot run a sandbox here (one line), or None; probed once per process."""
    if shutil.which("bwrap") is None:
        return "bwrap (bubblewrap) is not installed"
    with tempfile.TemporaryDirectory() as tmp:
        argv = bwrap_argv(tmp, DEFAULT_CWD, False, "true")
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=sandbox_env(DEFAULT_CWD))
        except subprocess.TimeoutExpired:
            return "bwrap did not finish a trivial command within 30 s"
    if proc.returncode == 0:
        return None
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else f"bwrap exited with code {proc.returncode}"


class LocalSandbox:
    """A prompt's host work dir, shown to commands at `cwd`; isolated by bwrap unless allowed not to be."""

    def __init__(self, config: SandboxConfig, host_dir: str, cwd: str, isolated: bool) -> None:
        self.config = config
        self.host_dir = host_dir
        self.cwd = cwd
        self.isolated = isolated
        self._owner = NOBODY if isolated and os.geteuid() == 0 else None  # who runs the commands

    def _own(self, path: str | Path) -> None:
        """Hand a host-created file to the command's uid, so commands can change it."""
        if self._owner is not None:
            os.chown(path, self._owner, self._owner)

    async def run(self, command: str, timeout: float) -> ExecResult:
        if self.isolated:
            argv = bwrap_argv(self.host_dir, self.cwd, self.config.network, command)
        else:
            argv = ["bash", "-c", command]
        env = sandbox_env(self.cwd)
        return await run_process([*limit_argv(self.config), *argv], timeout, env, cwd=self.host_dir)

    def check_path(self, path: str) -> Path:
        """The host path of a sandbox path (relative to cwd, or absolute under it); SandboxError if it leaves the work dir."""
        if not isinstance(path, str) or not path or "\0" in path:
            raise SandboxError("path must be a non-empty string")
        full = posixpath.normpath(posixpath.join(self.cwd, path))
        if not _under(full, (self.cwd,)):
            raise SandboxError(f"path {path!r} is outside the work dir {self.cwd}; only files under it are reachable")
        host = os.path.realpath(os.path.join(self.host_dir, posixpath.relpath(full, self.cwd)))
        if not _under(host, (self.host_dir,)):
            raise SandboxError(f"path {path!r} passes through a symlink that leads outside the work dir {self.cwd}")
        return Path(host)

    async def read_file(self, path: str) -> bytes:
        target = self.check_path(path)
        if target.exists() and not target.is_file():
            raise SandboxError(f"cannot read {path}: not a regular file")
        try:
            return target.read_bytes()
        except OSError as e:
            raise SandboxError(f"cannot read {path}: {e.strerror}") from e

    async def write_file(self, path: str, data: bytes) -> None:
        target = self.check_path(path)
        if target.exists() and not target.is_file():
            raise SandboxError(f"cannot write {path}: not a regular file")
        try:
            for parent in reversed(target.parents):
                if not parent.exists():
                    parent.mkdir()
                    self._own(parent)
            target.write_bytes(data)
            self._own(target)
        except OSError as e:
            raise SandboxError(f"cannot write {path}: {e.strerror}") from e

    async def close(self) -> None:
        if not self.config.keep:
            shutil.rmtree(self.host_dir, ignore_errors=True)


def _mount_point(cwd: str | None) -> str:
    """Where the work dir appears; it cannot replace a system dir or the sandbox's /dev and /proc."""
    if cwd is None:
        return DEFAULT_CWD
    point = "/" + posixpath.normpath(cwd).lstrip("/")
    if not posixpath.isabs(cwd) or point == "/" or _under(point, (*SYSTEM_DIRS, "/dev", "/proc", sys.base_prefix)):
        raise SandboxError(f"cwd {cwd!r} cannot hold the work dir: give an absolute path outside system dirs")
    return point


def open_local(config: SandboxConfig, key: str, cwd: str | None) -> LocalSandbox:
    """Create the prompt's work dir (fresh: a retried prompt starts clean) and its sandbox."""
    problem = bwrap_problem()
    if problem and not config.unsafe_local:
        raise SandboxError(
            f"the local sandbox needs bubblewrap, which cannot run here: {problem} "
            "(use the docker backend, or unsafe_local to run commands without isolation)"
        )
    if not key or "/" in key or key in (".", ".."):
        raise SandboxError(f"sandbox key {key!r} is not a plain file name")
    point = _mount_point(cwd)
    os.makedirs(config.root_dir, mode=0o700, exist_ok=True)
    host_dir = os.path.join(os.path.realpath(config.root_dir), key)
    shutil.rmtree(host_dir, ignore_errors=True)
    os.mkdir(host_dir)
    sandbox = LocalSandbox(config, host_dir, host_dir if problem else point, isolated=problem is None)
    sandbox._own(host_dir)
    return sandbox
