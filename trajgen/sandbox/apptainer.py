"""The `apptainer` backend (alias `singularity`): one Apptainer instance per prompt, driven through its CLI.

For HPC clusters, where Docker is not allowed. A row's image is a `docker://` reference (a bare
`python:3.11-slim` means `docker://python:3.11-slim`) built once into a SIF cache under a file
lock, into a temporary name renamed when whole, or a local `.sif` file used as it is. A prompt's
instance has no home, a clean environment, a throw-away tmpfs over the image, no network unless
asked, and its work dir (under the run's sandbox root, like the local backend's) bound at the
row's cwd. Commands go through `exec instance://NAME` and every call ends with `kill -9 -1`, as
with docker: the instance's own PID 1 survives it, nothing the call started does. The runtime's
CLI gets an environment built from scratch (its own configuration variables, no API key), and only
LANG, TERM and PYTHONUNBUFFERED cross into the instance, as APPTAINERENV_ variables.

Limits: CPU seconds, file size, data size and open files (its share of the machine's file table,
shares.py) per process (ulimit in every call's shell) always;
memory, processes and CPUs per instance (cgroups) only when the runner is root, since Apptainer
run by a user needs cgroups v2 with systemd delegation for them. Run as root, commands run as a
uid of their own per prompt (roots.take_uid, `--security uid:N,gid:N`: per-uid limits such as
inotify instances are then per prompt) in a work dir that is a tmpfs of --sandbox_disk MB; run
as a user (the usual case on a cluster), they run as that user inside the instance's namespaces.
The instance's name carries the run id and session label, so `remove` finds every instance of a
run or a session with `instance list --json`.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import posixpath
import shutil
import subprocess
from pathlib import Path
from typing import AsyncIterator

from trajgen import locks
from trajgen.sandbox import RUN_TAG, SESSION_TAG, Backend, ExecResult, SandboxConfig, SandboxError, roots, shares
from trajgen.sandbox.process import last_line, run_cli, run_process, stream_stdout
from trajgen.sandbox.shell import ONE_CALL, READ, WRITE

RUNTIMES = ("apptainer", "singularity")  # the same CLI under its old name
BUILD_TIMEOUT = 900.0
CONTROL_TIMEOUT = 120.0  # instance start / stop / list
DEFAULT_CACHE = "~/.cache/trajgen/sif"
NAME_PREFIX = "trajgen"  # instance names: trajgen-<run id>-<session label>-<prompt part>
PASSED = {"LANG": "C.UTF-8", "TERM": "dumb", "PYTHONUNBUFFERED": "1"}  # what docker sets, nothing more
# per-process limits in the call's shell ($1 CPU seconds, $2 file size in 512-byte blocks, $3 data in KB, $4 open
# files), shifted off before what follows: a command (ONE_CALL's $1), or a long-lived process's argv
LIMITS = ('ulimit -t "$1" 2>/dev/null; ulimit -f "$2" 2>/dev/null; ulimit -d "$3" 2>/dev/null; '
          'ulimit -n "$4" 2>/dev/null; shift 4; ')
LIMITED_CALL = LIMITS + ONE_CALL
LIMITED_PROCESS = LIMITS + 'exec "$@"'


@functools.cache
def runtime() -> str | None:
    """The runtime's CLI on PATH: apptainer, else singularity."""
    return next((name for name in RUNTIMES if shutil.which(name)), None)


def runtime_problem() -> str | None:
    return None if runtime() else "neither apptainer nor singularity is on PATH"


def runtime_env(passed: dict[str, str] | None = None) -> dict[str, str]:
    """The CLI's whole environment: its own settings and what instances may see (PASSED, then
    `passed`), none of the runner's secrets."""
    own = ("APPTAINER_", "SINGULARITY_")
    env = {k: v for k, v in os.environ.items()
           if k.startswith(own) or k in ("PATH", "HOME", "XDG_RUNTIME_DIR", "DBUS_SESSION_BUS_ADDRESS")}
    return env | {f"{runtime().upper()}ENV_{k}": v for k, v in (PASSED | (passed or {})).items()}


def limit_notices() -> list[str]:
    if os.geteuid() == 0:
        return []
    return ["the runner is not root: apptainer instances get per-process limits only (CPU time, data and file "
            "size); no memory, process or CPU limit per instance, and no size limit on their work dirs"]


def _local_sif(image: str) -> bool:
    return image.endswith(".sif") and "://" not in image


def source(image: str) -> str:
    """What `build` reads: the image as given if it names a scheme, else a Docker registry reference."""
    return image if "://" in image else f"docker://{image}"


def sif_path(image: str, config: SandboxConfig) -> str:
    """The SIF file an instance of `image` starts from: a local .sif itself, else its file in the cache."""
    if _local_sif(image):
        return os.path.abspath(image)
    cache = os.path.expanduser(config.sif_cache or DEFAULT_CACHE)
    return os.path.join(cache, hashlib.sha256(source(image).encode()).hexdigest()[:32] + ".sif")


def instance_name(config: SandboxConfig, key: str) -> str:
    return f"{NAME_PREFIX}-{config.run_id}-{config.label}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


class ApptainerSandbox:
    """A prompt's instance, started at first use from a SIF file that must already exist."""

    def __init__(self, config: SandboxConfig, key: str, image: str, cwd: str) -> None:
        self.config = config
        self.key = key
        self.image = image
        self.cwd = cwd
        self.name = instance_name(config, key)
        self.host_dir: str | None = None
        self._started = False
        self._lock = asyncio.Lock()
        self._uid: tuple[int, int] | None = None  # (the commands' uid, the fd holding it), as root

    async def _instance(self) -> str:
        async with self._lock:
            if not self._started:
                await self._start()
                self._started = True
        return self.name

    async def _start(self) -> None:
        c = self.config
        if problem := runtime_problem():
            raise SandboxError(problem)
        if not c.root_dir:
            raise SandboxError("no sandbox root: SandboxConfig.root_dir must be set (roots.new_root_dir)")
        root = os.geteuid() == 0
        try:  # as root a sized tmpfs owned by the commands' uid; a kept one must outlive the run as a plain dir
            if root and self._uid is None:
                self._uid = await asyncio.to_thread(roots.take_uid)
            self.host_dir = await asyncio.to_thread(roots.new_work_dir, c.root_dir, self.key, c.disk_mb,
                                                    self._uid[0] if root else None, root and not c.keep)
        except (OSError, ValueError) as e:
            raise SandboxError(f"cannot prepare the sandbox of {self.key}: {getattr(e, 'strerror', None) or e}") from e
        limits = ["--memory", f"{c.memory_mb}M", "--pids-limit", str(c.max_processes), "--cpus", f"{c.cpus:g}"]
        code, _, err = await run_cli([
            runtime(), "instance", "start", "--containall", "--no-home", "--cleanenv", "--writable-tmpfs",
            *([] if c.network else ["--net", "--network", "none"]), *(limits if root else []),
            "--bind", f"{self.host_dir}:{self.cwd}", sif_path(self.image, c), self.name,
        ], runtime_env(), CONTROL_TIMEOUT)
        if code != 0:
            raise SandboxError(f"cannot start an instance of image {self.image}: {last_line(err)}")

    def _exec(self, *argv: str) -> list[str]:
        user = ["--security", f"uid:{self._uid[0]},gid:{self._uid[0]}"] if self._uid else []
        return [runtime(), "exec", *user, "--pwd", self.cwd, f"instance://{self.name}", *argv]

    def _limits(self) -> list[str]:
        c = self.config
        return [str(c.cpu_seconds), str(c.file_size_mb << 11), str(c.memory_mb << 10),
                str(shares.open_files(c.slots, c.max_processes))]

    async def start(self) -> None:
        await self._instance()

    async def run(self, command: str, timeout: float) -> ExecResult:
        await self._instance()
        argv = self._exec("sh", "-c", LIMITED_CALL, "sh", *self._limits(), command)
        return await run_process(argv, timeout, runtime_env(), on_timeout=self.end_processes)

    async def process_argv(self, command: list[str]) -> list[str]:
        """The CLI argv that runs `command` as a long-lived process of this instance, with stdin and
        stdout as its pipes: the commands' uid, limits and work dir. The CLI needs runtime_env(), with
        the process's own variables as `passed`. It ends when its stdin closes, or with the instance."""
        await self._instance()
        return self._exec("sh", "-c", LIMITED_PROCESS, "sh", *self._limits(), *command)

    async def end_processes(self) -> None:
        """Killing the CLI would leave a command running inside: it is killed from inside."""
        if self._started:
            await run_cli(self._exec("sh", "-c", "kill -9 -1"), runtime_env(), CONTROL_TIMEOUT)

    async def read_chunks(self, path: str) -> AsyncIterator[bytes]:
        await self._instance()
        async for chunk in stream_stdout(self._exec("sh", "-c", READ, "sh", path), runtime_env(),
                                         self.config.command_timeout, path):
            yield chunk

    async def write_file(self, path: str, data: bytes) -> None:
        await self._instance()
        code, _, err = await run_cli(self._exec("sh", "-c", WRITE, "sh", path), runtime_env(),
                                     self.config.command_timeout, stdin=data)
        if code != 0:
            raise SandboxError(f"cannot write {path}: {last_line(err)}")

    async def close(self) -> None:
        if not self.config.keep:  # a kept instance keeps running as its uid, which a later sandbox may be given
            if self._started:
                await run_cli([runtime(), "instance", "stop", self.name], runtime_env(), CONTROL_TIMEOUT)
                self._started = False
            if self.host_dir:
                await asyncio.to_thread(roots.remove_work_dir, self.host_dir)
                self.host_dir = None
        if self._uid is not None:
            locks.release(self._uid[1])
            self._uid = None


def _mount_point(cwd: str | None) -> str:
    """Where the work dir appears: an absolute path other than /; `:` and `,` would break the bind spec."""
    if cwd is None:
        return "/workspace"
    point = posixpath.normpath(cwd)
    if not posixpath.isabs(cwd) or point == "/" or any(ch in point for ch in ":,"):
        raise SandboxError(f"cwd {cwd!r} cannot hold the work dir: give an absolute path other than / without ':' or ','")
    return point


def open_apptainer(config: SandboxConfig, key: str, image: str | None, cwd: str | None) -> ApptainerSandbox:
    return ApptainerSandbox(config, key, image or config.docker_image, _mount_point(cwd))


async def check_image(image: str, config: SandboxConfig) -> str | None:
    """None if the image's SIF file exists or could be built now, else a one-line reason.

    One build per image however many workers or runners ask at once (a lock beside the file), and
    the file appears only whole (built under a temporary name, then renamed).
    """
    if problem := runtime_problem():
        return problem
    path = sif_path(image, config)
    if _local_sif(image):
        return None if os.path.isfile(path) else f"{path}: no such SIF file"
    if os.path.isfile(path):
        return None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = await asyncio.to_thread(locks.acquire, Path(path + ".lock"), True)
    except OSError as e:
        return f"cannot use the SIF cache {os.path.dirname(path)}: {e.strerror}"
    partial = path + ".partial"
    try:
        if os.path.isfile(path):  # built by another worker or runner while we waited
            return None
        Path(partial).unlink(missing_ok=True)  # what a killed build left
        code, _, err = await run_cli([runtime(), "build", partial, source(image)], runtime_env(), BUILD_TIMEOUT)
        if code != 0:
            return f"cannot build image {source(image)}: {last_line(err)}"
        os.rename(partial, path)
        return None
    except SandboxError as e:
        return str(e)
    finally:
        Path(partial).unlink(missing_ok=True)
        locks.release(fd)


def remove_instances(tag: str, value: str) -> None:
    """Stop every instance whose name carries <tag>=<value>; quiet when the runtime is absent."""
    if runtime() is None:
        return
    position = {RUN_TAG: 1, SESSION_TAG: 2}[tag]
    try:
        listed = subprocess.run([runtime(), "instance", "list", "--json"], capture_output=True, text=True,
                                timeout=CONTROL_TIMEOUT, env=runtime_env())
        names = [i.get("instance", "") for i in json.loads(listed.stdout or "{}").get("instances", [])]
        for name in names:
            parts = name.split("-")
            if len(parts) == 4 and parts[0] == NAME_PREFIX and parts[position] == value:
                subprocess.run([runtime(), "instance", "stop", name], capture_output=True, timeout=CONTROL_TIMEOUT,
                               env=runtime_env())
    except (OSError, subprocess.TimeoutExpired, ValueError, AttributeError):
        pass


BACKEND = Backend(open_apptainer, check_image, remove_instances, runtime_problem, limit_notices)
