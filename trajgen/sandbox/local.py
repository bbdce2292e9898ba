"""The `local` backend: a prompt's commands run in one bubblewrap sandbox over its work dir.

Only system dirs are visible (read-only); the work dir is the one writable place, with a sized
private /tmp; the sandbox has its own PID, IPC, UTS, cgroup and network namespaces, a scrubbed
environment, rlimits (open files: its share of the machine's table, shares.py) and a seccomp
filter (seccomp.py). Run as root, each sandbox has its own uid (roots.take_uid), a cgroup with
memory and process limits (cgroups.py) that its bwrap is in before it starts anything (gate.py),
a devpts instance with its share of the machine's PTYs (the three kept for the worker's next
sandbox once its processes are gone: slots.py) on a read-only / and /dev its worker made once
(process_view), and a work dir that is a tmpfs of a fixed size; its command loop is not dumpable,
out of its commands' reach (_identity). bubblewrap reads its options from a memfd, so the host
path of the work dir is not in any command line the sandbox can see. The sandbox starts at the prompt's first
command and runs every command of the prompt through supervise.sh (supervisor.py), which gives
each command what a fresh sandbox would: its own session, timeout and output cap, an empty /tmp,
and nothing of it left running afterwards. When a PID namespace's first process dies the kernel
kills everything in it, so killing bwrap (a cancelled command, the prompt's end) ends it all.
File tools work host-side on the work dir (hostfiles.py), never following a link out of it.
"""
from __future__ import annotations

import asyncio
import functools
import os
import posixpath
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import AsyncIterator

from trajgen.sandbox import Backend, ExecResult, SandboxConfig, SandboxError, cgroups, roots, seccomp, shares, slots
from trajgen.sandbox.binds import SYSTEM_DIRS, system_view, under
from trajgen.sandbox.gate import Gate, gated
from trajgen.sandbox.hostfiles import WorkDir
from trajgen.sandbox.process import run_process
from trajgen.sandbox.supervisor import LOOP_ARGV, LOST, Channel, Supervisor, process_channel
from trajgen.sandbox.visible import Visible

NOBODY = 65534
DEFAULT_CWD = "/workspace"
NEW_PRIVILEGES_OFF = ["--no-new-privs", "--bounding-set=-all", "--inh-caps=-all", "--"]  # setpriv's last options


def sandbox_env(home: str) -> dict[str, str]:
    """The whole environment of a command: nothing of the runner's (API keys above all) gets in."""
    path = f"/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:{sys.base_prefix}/bin"
    return {"PATH": path, "LANG": "C.UTF-8", "HOME": home, "TERM": "dumb", "PYTHONUNBUFFERED": "1"}


def ulimit_args(config: SandboxConfig) -> list[str]:
    """bash `ulimit` options for a command in the sandbox's loop: CPU seconds, data size (memory),
    processes, file size (KiB), open files (shares.py); set in the command's forked shell, no program to exec."""
    return ["-t", str(config.cpu_seconds), "-d", str(config.memory_mb << 10), "-u", str(config.max_processes),
            "-f", str(config.file_size_mb << 10), "-n", str(shares.open_files(config.slots, config.max_processes))]


def prlimit_argv(config: SandboxConfig) -> list[str]:
    """The same limits as a prefix, for a command run without the loop (--unsafe_local): one small
    exec instead of a second bash."""
    return ["prlimit", f"--cpu={config.cpu_seconds}", f"--data={config.memory_mb << 20}",
            f"--nproc={config.max_processes}", f"--fsize={config.file_size_mb << 20}",
            f"--nofile={shares.open_files(config.slots, config.max_processes)}", "--"]


@dataclass(frozen=True)
class Devices:
    """A root runner's sandbox / and /dev: the read-only ones its process made (process_view), with the
    sandbox's own devpts instance (slots.Slot.pts) on its /dev/pts."""
    view: str
    pts: str


VIEW_POINTS = ("/tmp", "/proc", DEFAULT_CWD)  # what bubblewrap mounts on in the view (bwrap_options)
_MAKING_VIEW = threading.Lock()  # sandboxes open in threads: one makes the view, the others wait for it


def process_view(root: str) -> str:
    """The / this process's sandboxes under `root` are shown (roots.new_view), made at the first; a
    worker's own mount table (backends.prepare_worker) keeps it out of the other workers'."""
    path = os.path.join(os.path.realpath(root), f"{os.getpid()}.view")  # never a sandbox key (dataset.py: hex-n)
    with _MAKING_VIEW:
        if not os.path.ismount(path):
            roots.new_view(path, system_view(), VIEW_POINTS)
    return path


def bwrap_system_binds() -> list[str]:
    """bubblewrap's options showing the system dirs (binds.system_view) one by one."""
    return system_view().bwrap_args()


def _identity(uid: int, loop: bool = True) -> tuple[list[str], list[str]]:
    """(bwrap options, the prefix that makes the command loop run as `uid`; or, not `loop`, any
    other process of the sandbox, which becomes `uid` in full).

    As root, a user namespace would map the uid onto host root, which owns /etc/shadow and can
    read it; so bwrap stays in the host user namespace and setpriv really becomes the uid, with no
    capabilities and no way back through a setuid binary. The command loop is started with
    another effective uid (roots.loop_uid), which bash drops for `uid` at once: a process started
    with differing real and effective uids, or that changes its effective uid, is not dumpable, so
    no command can read or write the loop's memory through /proc nor learn the marker that ends
    its output. Each command's exec makes it an ordinary (dumpable) process of `uid` again.
    Unprivileged, a user namespace maps our own uid to nobody, and the loop is dumpable.
    """
    if os.geteuid() == 0:
        if not loop:
            return [], ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *NEW_PRIVILEGES_OFF]
        other = roots.loop_uid(uid)
        setpriv = ["setpriv", f"--ruid={uid}", f"--euid={other}", f"--rgid={uid}", f"--egid={other}", "--clear-groups"]
        return [], [*setpriv, *NEW_PRIVILEGES_OFF]
    return ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)], []


def bwrap_options(host_dir: str, cwd: str, network: bool, tmp_mb: int, uid: int, seccomp_fd: int,
                  devices: Devices | None = None, loop: bool = True, env: dict[str, str] | None = None,
                  shown: Visible | None = None) -> tuple[list[str], list[str]]:
    """(bubblewrap's options, the command prefix that drops to `uid`); `devices`: the sandbox's / (whole,
    with the work dir at its default place and no MCP config's paths to show; else its /dev) and PTY
    instance, instead of bwrap's;
    `env`: the command's whole environment instead of bwrap's own; `shown`: what an MCP server's
    config names, after the sandbox's /tmp (which would hide what is under /tmp), and its cwd."""
    identity, as_uid = _identity(uid, loop)
    setenv = [] if env is None else ["--clearenv", *(a for k, v in env.items() for a in ("--setenv", k, v))]
    if devices is None:
        root, dev = bwrap_system_binds(), ["--dev", "/dev"]
    elif shown is None and cwd in VIEW_POINTS:  # bwrap can make no other mount point in the view
        root, dev = ["--dev-bind", devices.view, "/"], ["--dev-bind", devices.pts, "/dev/pts"]
    else:
        root = bwrap_system_binds()
        dev = ["--dev-bind", f"{devices.view}/dev", "/dev", "--dev-bind", devices.pts, "/dev/pts"]
    options = [
        *root, "--size", str(tmp_mb << 20), "--perms", "1777", "--tmpfs", "/tmp",
        *(shown.bwrap_args() if shown else []), *dev, "--proc", "/proc",
        "--bind", host_dir, cwd, "--chdir", shown.cwd if shown and shown.cwd else cwd,
        "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try",
        *([] if network else ["--unshare-net"]), *identity,
        "--die-with-parent", "--new-session", "--seccomp", str(seccomp_fd), *setenv,
    ]
    return options, as_uid


def bwrap_argv(host_dir: str, cwd: str, network: bool, tmp_mb: int, uid: int, command: list[str],
               devices: Devices | None = None, loop: bool = True, env: dict[str, str] | None = None,
               shown: Visible | None = None) -> tuple[list[str], list[int]]:
    """The bwrap command line running `command` (bwrap's options in a memfd: `--args FD`) and the fds it must inherit."""
    seccomp_fd = seccomp.memfd(seccomp.program(network), "trajgen-seccomp")
    options, as_uid = bwrap_options(host_dir, cwd, network, tmp_mb, uid, seccomp_fd, devices, loop, env, shown)
    args_fd = seccomp.memfd(b"".join(o.encode() + b"\0" for o in options), "trajgen-bwrap-args")
    return ["bwrap", "--args", str(args_fd), "--", *as_uid, *command], [seccomp_fd, args_fd]


_PROBING = threading.Lock()  # the first prompts of a worker ask at once: one probe answers them all


def bwrap_problem() -> str | None:
    """Why bubblewrap cannot run a sandbox here (one line), or None; probed once per process."""
    with _PROBING:
        return _bwrap_problem()


@functools.cache
def _bwrap_problem() -> str | None:
    if shutil.which("bwrap") is None:
        return "bwrap (bubblewrap) is not installed"
    try:
        seccomp.program(False)
    except OSError as e:
        return str(e)
    # the work dir bound is the temp dir itself: a probe killed midway (a Ray actor stopped while it
    # starts) leaves nothing behind
    argv, fds = bwrap_argv(tempfile.gettempdir(), DEFAULT_CWD, False, 1, NOBODY, ["true"])
    # `true` as the namespace's first process: bwrap's own init would tell bwrap the exit code and be
    # left to exit alone, an orphan, a zombie for good when the runner is PID 1 (a container without an init)
    argv.insert(1, "--as-pid-1")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=sandbox_env(DEFAULT_CWD),
                              pass_fds=fds)
    except subprocess.TimeoutExpired:
        return "bwrap did not finish a trivial command within 30 s"
    finally:
        for fd in fds:
            os.close(fd)
    if proc.returncode == 0:
        return None
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else f"bwrap exited with code {proc.returncode}"


class LocalSandbox:
    """A prompt's host work dir, shown to commands at `cwd`; isolated by bwrap unless allowed not to be."""

    def __init__(self, config: SandboxConfig, host_dir: str, cwd: str, isolated: bool,
                 slot: slots.Slot | None = None, devices: Devices | None = None) -> None:
        self.config = config
        self.host_dir = host_dir
        self.cwd = cwd
        self.isolated = isolated
        self.uid = slot.uid if slot else NOBODY
        self._slot = slot
        self._group = slot.group if slot else None
        self._devices = devices
        self.files = WorkDir(host_dir, cwd, self.uid if slot else None)

        self._supervisor = Supervisor(self._start) if isolated else None

    async def _start(self) -> Channel:
        """bwrap running the command loop with the limits for each command, in the sandbox's cgroup."""
        loop = [*LOOP_ARGV, *ulimit_args(self.config)]
        argv, fds, gate = gated(*bwrap_argv(self.host_dir, self.cwd, self.config.network, self.config.disk_mb,
                                            self.uid, loop, self._devices), self._group)
        return await process_channel(argv, fds, sandbox_env(self.cwd), self.host_dir, gate)

    async def start(self) -> None:
        if self._supervisor:
            await self._supervisor.start()

    async def run(self, command: str, timeout: float) -> ExecResult:
        if self._supervisor is None:
            return await run_process([*prlimit_argv(self.config), "bash", "-c", command], timeout,
                                     sandbox_env(self.cwd), cwd=self.host_dir)
        ooms = self._group.oom_kills() if self._group else 0
        result = await self._supervisor.run(command, timeout)
        if self._group and self._group.oom_kills() > ooms and result.error in (None, LOST):
            result.error = (f"the sandbox hit its memory limit ({self.config.memory_mb} MB, its /tmp and work dir "
                            "included); the kernel killed a process of the command")
        return result

    def process_argv(self, command: list[str], env: dict[str, str],
                     shown: Visible | None = None) -> tuple[list[str], list[int], Gate | None]:
        """The argv that runs `command` as a long-lived process of this sandbox (same uid, seccomp
        filter, cgroup, network and limits as its commands, in its work dir or `shown.cwd`, with
        `shown`'s paths visible read-only), the fds it must inherit and the gate into the sandbox's
        cgroup to start it through (gate.start); unisolated (--unsafe_local), a plain limited process.
        Started with `env` as its environment, `command` gets exactly `env` (bwrap sets it from its
        options' memfd): no value is on a command line, which every local user may read."""
        if not self.isolated:
            return [*prlimit_argv(self.config), *command], [], None
        return gated(*bwrap_argv(self.host_dir, self.cwd, self.config.network, self.config.disk_mb, self.uid,
                                 [*prlimit_argv(self.config), *command], self._devices, loop=False, env=env,
                                 shown=shown), self._group)

    def check_path(self, path: str) -> None:
        """SandboxError if `path` (relative to cwd, or absolute under it) leads out of the work dir."""
        self.files.check(path)

    async def read_chunks(self, path: str) -> AsyncIterator[bytes]:
        chunks = self.files.read_chunks(path)
        while chunk := await asyncio.to_thread(next, chunks, b""):
            yield chunk

    async def write_file(self, path: str, data: bytes) -> None:
        await asyncio.to_thread(self.files.write, path, data)

    async def end_processes(self) -> None:
        """The cgroup holds every process of the sandbox: the command loop's PID namespace, and each
        MCP server's (a bubblewrap of its own) with whatever it started. Without one, only the loop's."""
        if self._group:
            try:
                await asyncio.to_thread(self._group.kill)
            except OSError as e:
                raise SandboxError(f"cannot end the processes of the sandbox: {e}") from e
        if self._supervisor:  # the loop's bwrap is reaped; the next command starts a new one
            await self._supervisor.stop()

    async def close(self) -> None:
        if self._supervisor:
            await self._supervisor.stop()
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        if not self.config.keep:  # detached first: its pages are no longer charged to the slot's group once its
            roots.remove_work_dir(self.host_dir)  # processes are gone (give_back), when the next sandbox may take it
        slot, self._slot = self._slot, None
        if slot:
            slots.give_back(slot, self.config)


def _mount_point(cwd: str | None) -> str:
    """Where the work dir appears; it cannot replace a system dir or the sandbox's /dev and /proc."""
    if cwd is None:
        return DEFAULT_CWD
    point = "/" + posixpath.normpath(cwd).lstrip("/")
    if not posixpath.isabs(cwd) or point == "/" or under(point, (*SYSTEM_DIRS, "/dev", "/proc", sys.base_prefix)):
        raise SandboxError(f"cwd {cwd!r} cannot hold the work dir: give an absolute path outside system dirs")
    return point


def open_local(config: SandboxConfig, key: str, image: str | None, cwd: str | None) -> LocalSandbox:
    """Create the prompt's work dir (fresh: a retried prompt starts clean), its identity and cgroup."""
    problem = bwrap_problem()
    if problem and not config.unsafe_local:
        raise SandboxError(
            f"the local sandbox needs bubblewrap, which cannot run here: {problem} "
            "(use the docker backend, or unsafe_local to run commands without isolation)"
        )
    if not config.root_dir:
        raise SandboxError("no sandbox root: SandboxConfig.root_dir must be set (roots.new_root_dir)")
    point = _mount_point(cwd)
    isolated = problem is None
    slot = None
    try:  # a kept work dir must outlive the run as a plain directory
        slot = slots.take(config) if isolated and os.geteuid() == 0 else None
        devices = Devices(process_view(config.root_dir), slot.pts) if slot else None
        host_dir = roots.new_work_dir(config.root_dir, key, config.disk_mb, slot.uid if slot else None,
                                      sized=isolated and not config.keep)
    except (OSError, ValueError) as e:
        if slot:
            slots.free(slot)
        raise SandboxError(f"cannot prepare the sandbox of {key}: {getattr(e, 'strerror', None) or e}") from e
    return LocalSandbox(config, host_dir, point if isolated else host_dir, isolated, slot, devices)


def limit_notices() -> list[str]:
    """What the local sandboxes cannot limit on this machine, to say once at the start of a run."""
    if bwrap_problem():
        return []
    notices = []
    if os.geteuid() != 0:
        notices.append("the runner is not root: sandboxes share its uid, their work dirs have no size limit, "
                       "their PTYs no share of the machine's, and commands can read their command loop's memory")
    if reason := cgroups.problem():
        notices.append(f"sandboxes get no cgroup ({reason}): memory and processes are limited per process "
                       "and per uid only, and /tmp pages are not counted")
    return notices


BACKEND = Backend(open_local, limit_notices=limit_notices)
