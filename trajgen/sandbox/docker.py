"""The `docker` backend: one container per prompt, driven through the `docker` CLI.

The container is the boundary: no network unless asked; CPU, memory and process limits; every
capability dropped but the few a root shell needs, no-new-privileges, and commands run as uid
65534 unless `docker_root`; a session label so `cleanup` can find every container an invocation
(or a crashed worker) left, and a run label so the next invocation can reap what a runner killed
with -9 left. PID 1 is a tiny root shell loop that prepares the work dir, reaps orphans
and survives `kill -9 -1`, which is how every terminal call ends, on time or not, together with
everything it started, setsid or not: nothing a call starts outlives it.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
from typing import AsyncIterator

from trajgen.sandbox import ExecResult, SandboxConfig, SandboxError
from trajgen.sandbox.process import last_line, run_cli, run_process, stream_stdout

PULL_TIMEOUT = 900.0
CONTROL_TIMEOUT = 120.0  # docker run / rm / inspect
REAPER = "while :; do sleep 2147483647 & wait; done"
PREFER_BASH = 'if command -v bash >/dev/null 2>&1; then exec bash -c "$1"; fi; exec sh -c "$1"'
# the call's shell runs the command, then kills every process it may signal (its uid's; all but PID 1 as root)
ONE_CALL = f'({PREFER_BASH}) </dev/null; code=$?; kill -9 -1 2>/dev/null; exit $code'
WRITE = 'mkdir -p "$(dirname "$1")" && cat > "$1"'
READ = '[ ! -e "$1" ] || [ -f "$1" ] || { echo "not a regular file" >&2; exit 1; }; exec cat -- "$1"'
USER = "65534:65534"
SHELL_CAPS = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID")  # a root shell's needs


def docker_env() -> dict[str, str]:
    """What the docker CLI needs (DOCKER_HOST, its config), and none of the runner's other variables."""
    return {k: v for k, v in os.environ.items() if k.startswith("DOCKER_") or k in ("PATH", "HOME")}


async def _docker(*args: str, timeout: float, stdin: bytes | None = None) -> tuple[int | None, bytes, str]:
    """Run one docker CLI command: (exit code or None on timeout, stdout, stderr's text)."""
    return await run_cli(["docker", *args], docker_env(), timeout, stdin)


class DockerSandbox:
    """A prompt's container, started at first use from an image that must already be local."""

    def __init__(self, config: SandboxConfig, key: str, image: str, cwd: str) -> None:
        self.config = config
        self.key = key
        self.image = image
        self.cwd = cwd
        self._id: str | None = None
        self._lock = asyncio.Lock()

    async def _container(self) -> str:
        async with self._lock:
            if self._id is None:
                self._id = await self._start()
        return self._id

    async def _start(self) -> str:
        c = self.config
        code, out, err = await _docker(
            "run", "-d", "--pull", "never", *([] if c.network else ["--network", "none"]),
            "--cpus", f"{c.cpus:g}", "--memory", f"{c.memory_mb}m", "--memory-swap", f"{c.memory_mb}m",
            "--pids-limit", str(c.max_processes), "--ulimit", f"cpu={c.cpu_seconds}",
            "--ulimit", f"fsize={c.file_size_mb << 20}", "--cap-drop", "ALL",
            *(f"--cap-add={cap}" for cap in SHELL_CAPS), "--security-opt", "no-new-privileges",
            "--tmpfs", f"/tmp:size={c.disk_mb}m,mode=1777",
            "--label", f"trajgen.session={c.label}", "--label", f"trajgen.run={c.run_id}",
            "--label", f"trajgen.key={self.key}",
            "-e", "LANG=C.UTF-8", "-e", "TERM=dumb", "-e", "PYTHONUNBUFFERED=1",
            "-w", self.cwd, "--entrypoint", "sh", self.image, "-c", REAPER,
            timeout=CONTROL_TIMEOUT,
        )
        if code != 0:
            raise SandboxError(f"cannot start a container from image {self.image}: {last_line(err)}")
        cid = out.decode().strip()
        if not c.docker_root:  # the work dir belongs to the commands' user; PID 1 stays root, out of their reach
            code, _, err = await _docker("exec", "-u", "0", cid, "chown", USER, self.cwd, timeout=CONTROL_TIMEOUT)
            if code != 0:
                raise SandboxError(f"cannot prepare {self.cwd} in image {self.image}: {last_line(err)}")
        return cid

    @property
    def _user(self) -> list[str]:
        return ["-u", "0" if self.config.docker_root else USER]

    async def run(self, command: str, timeout: float) -> ExecResult:
        cid = await self._container()

        async def kill_all() -> None:  # killing the docker CLI leaves the command running inside
            await _docker("exec", *self._user, cid, "sh", "-c", "kill -9 -1", timeout=CONTROL_TIMEOUT)

        argv = ["docker", "exec", *self._user, cid, "sh", "-c", ONE_CALL, "sh", command]
        return await run_process(argv, timeout, docker_env(), on_timeout=kill_all)

    async def read_chunks(self, path: str) -> AsyncIterator[bytes]:
        cid = await self._container()
        argv = ["docker", "exec", *self._user, cid, "sh", "-c", READ, "sh", path]
        async for chunk in stream_stdout(argv, docker_env(), self.config.command_timeout, path):
            yield chunk

    async def write_file(self, path: str, data: bytes) -> None:
        cid = await self._container()
        code, _, err = await _docker(
            "exec", "-i", *self._user, cid, "sh", "-c", WRITE, "sh", path, stdin=data, timeout=self.config.command_timeout
        )
        if code != 0:
            raise SandboxError(f"cannot write {path}: {last_line(err)}")

    async def close(self) -> None:
        if self._id is not None and not self.config.keep:
            await _docker("rm", "-f", self._id, timeout=CONTROL_TIMEOUT)
            self._id = None


def open_docker(config: SandboxConfig, key: str, image: str | None, cwd: str | None) -> DockerSandbox:
    return DockerSandbox(config, key, image or config.docker_image, cwd or "/workspace")


async def check_image(image: str, config: SandboxConfig) -> str | None:
    """None if the image is local or could be pulled, else a one-line reason."""
    try:
        code, _, _ = await _docker("image", "inspect", image, timeout=CONTROL_TIMEOUT)
        if code == 0:
            return None
        code, _, err = await _docker("pull", "--quiet", image, timeout=PULL_TIMEOUT)
    except SandboxError as e:
        return str(e)
    return None if code == 0 else f"image {image} is not available locally and pulling it failed: {last_line(err)}"


def remove_containers(tag: str, value: str) -> None:
    """Force-remove every container labelled <tag>=<value>; quiet when docker is absent."""
    try:
        listed = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label={tag}={value}"],
            capture_output=True, text=True, timeout=CONTROL_TIMEOUT, env=docker_env(),
        )
        if ids := listed.stdout.split():
            subprocess.run(["docker", "rm", "-f", *ids], capture_output=True, timeout=CONTROL_TIMEOUT, env=docker_env())
    except (OSError, subprocess.TimeoutExpired):
        pass
