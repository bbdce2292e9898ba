"""The `docker` backend: one container per prompt, driven through the Docker SDK for Python (docker_client.py).

The container is the boundary: no network unless asked; CPU, memory, process and open-file limits
(the last its share of the machine's file table, shares.py); the local backend's seccomp filter in
place of Docker's default one (seccomp.docker_profile: AIO, io_uring, keyrings, namespaces and
every socket family but AF_UNIX denied with the network off); every capability dropped but the few
a root shell needs, no-new-privileges, and commands run as a uid of their own (roots.take_uid:
per-uid limits such as inotify instances are then per prompt, as in the local backend) unless
`docker_root`; a root runner whose engine is on this machine binds a devpts instance with the
container's share of the machine's PTYs at /dev/pts (roots.new_devpts); a session label so
`cleanup` can find every container an invocation (or a crashed worker) left, and a run label so the
next invocation can reap what a runner killed with -9 left. PID 1 is a tiny root shell that reaps
orphans and survives `kill -9 -1`, which is how every terminal call ends, on time or not, together
with everything it started, setsid or not: nothing a call starts outlives it. In an image with
bash, a prompt's commands go through one exec running the command loop (supervise.sh, as the local
backend runs it, but from a copy of bash its user cannot read: no command can read its memory),
which empties /tmp after each; a timeout or a lost loop kills every process of the commands' user
(PID 1 and the files stay) and the next command starts a new loop. Other images get one exec per
call. Every call goes through the Docker SDK, no `docker` process of its own.
"""
from __future__ import annotations

import asyncio
import os
from contextlib import asynccontextmanager
from typing import AsyncIterator

from trajgen import locks
from trajgen.sandbox import Backend, BackendUnreachable, ExecResult, SandboxConfig, SandboxError, roots, seccomp, shares
from trajgen.sandbox.docker_client import STDOUT, EngineError, Exec, call, pull, run_exec, start_exec, sync_call
from trajgen.sandbox.process import Capture, last_line
from trajgen.sandbox.shell import KILL_ALL, MERGED, READ, REAPER, WRITE
from trajgen.sandbox.supervisor import LOOP_ARGV, Channel, Supervisor

PULL_TIMEOUT = 900.0
CONTROL_TIMEOUT = 120.0  # container create / start / rm, image inspect
HAS_BASH = ("sh", "-c", "command -v bash >/dev/null")  # what the command loop needs of an image
# The loop's bash: a root-owned copy its user may execute but not read. The kernel makes a process that
# execs a file it cannot read non-dumpable, so no command (each the exec of the image's own, readable
# bash) may read the loop's memory or fds, where the marker that ends each answer lies.
LOOP_BASH = "/dev/.trajgen-bash"
PREPARE = ('chown "$1" "$2" && if bash=$(command -v bash); then '
           f'cp "$bash" {LOOP_BASH} && chmod 111 {LOOP_BASH}; fi')  # run as root before any command
SHELL_CAPS = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID")  # a root shell's needs

_loop_images: dict[str, bool] = {}  # image -> whether it can run the command loop; asked once per process


class DockerSandbox:
    """A prompt's container, started at first use from an image that must already be local."""

    def __init__(self, config: SandboxConfig, key: str, image: str, cwd: str) -> None:
        self.config = config
        self.key = key
        self.image = image
        self.cwd = cwd
        self._id: str | None = None
        self._lock = asyncio.Lock()
        self._loop: Supervisor | None = None  # set at the container's start if the image has bash
        self._uid: tuple[int, int] | None = None  # (the commands' uid, the fd holding it) once started
        self._pts: str | None = None  # the host's devpts instance bound at /dev/pts, when it has one

    async def _container(self) -> str:
        async with self._lock:
            if self._id is None:
                self._id = await self._start()
                if await self._runs_loop(self._id):
                    self._loop = Supervisor(self._open_loop)
        return self._id

    async def _runs_loop(self, cid: str) -> bool:
        if self.image not in _loop_images:
            async with _control(f"cannot look into image {self.image}"):
                _loop_images[self.image] = await run_exec(cid, self._user, HAS_BASH, lambda *_: None) == 0
        return _loop_images[self.image]

    async def _open_loop(self) -> Channel:
        """The command loop as one exec over the container's work dir, talking on that exec's stdin and stdout."""
        cid = await self._container()
        async with _control("cannot start the command loop"):
            argv = [LOOP_BASH, *LOOP_ARGV[1:]] if self._uid else LOOP_ARGV  # root reads any file: no copy for it
            loop = await start_exec(cid, self._user, argv, stdin=True)

        async def kill() -> None:
            try:
                if self._id == cid:  # a removed container has nothing left to kill
                    await self._kill_all(cid)
            finally:
                loop.close()

        return Channel(loop, loop, kill)

    def _spec(self) -> dict:
        """What `docker run` would send for the container: the limits and labels above."""
        c = self.config
        files = shares.open_files(c.slots, c.max_processes)
        mounts = [{"Type": "bind", "Source": self._pts, "Target": "/dev/pts"}] if self._pts else []
        return {
            "Image": self.image, "Entrypoint": ["sh"], "Cmd": ["-c", REAPER], "WorkingDir": self.cwd,
            "Env": ["LANG=C.UTF-8", "TERM=dumb", "PYTHONUNBUFFERED=1"],
            "Labels": {"trajgen.session": c.label, "trajgen.run": c.run_id, "trajgen.key": self.key},
            "HostConfig": {
                "NetworkMode": "default" if c.network else "none", "NanoCpus": round(c.cpus * 1e9),
                "Memory": c.memory_mb << 20, "MemorySwap": c.memory_mb << 20, "PidsLimit": c.max_processes,
                "Ulimits": [{"Name": "cpu", "Soft": c.cpu_seconds, "Hard": c.cpu_seconds},
                            {"Name": "fsize", "Soft": c.file_size_mb << 20, "Hard": c.file_size_mb << 20},
                            {"Name": "nofile", "Soft": files, "Hard": files}],
                "CapDrop": ["ALL"], "CapAdd": list(SHELL_CAPS),
                "SecurityOpt": ["no-new-privileges", f"seccomp={seccomp.docker_profile(c.network)}"],
                "Tmpfs": {"/tmp": f"size={c.disk_mb}m,mode=1777"}, "Mounts": mounts,
            },
        }

    async def _start(self) -> str:
        if not self.config.docker_root and self._uid is None:  # a start tried again keeps the uid it took
            try:
                self._uid = await asyncio.to_thread(roots.take_uid)
            except OSError as e:
                raise SandboxError(f"cannot take a uid for the sandbox of {self.key}: {e.strerror or e}") from e
        if _engine_is_local() and self.config.root_dir:
            try:
                self._pts = await asyncio.to_thread(roots.new_devpts, self.config.root_dir, self.key,
                                                    shares.ptys(self.config.slots))
            except (OSError, ValueError) as e:
                raise SandboxError(f"cannot prepare the PTYs of {self.key}: {getattr(e, 'strerror', None) or e}") from e
        async with _control(f"cannot start a container from image {self.image}"):
            cid = (await call("create_container_from_config", self._spec()))["Id"]
            await call("start", cid)
        if not self.config.docker_root:  # the work dir is the commands' user's; PID 1 and the loop's bash stay root's
            output = Capture()
            async with _control(f"cannot prepare {self.cwd} in image {self.image}"):
                code = await run_exec(cid, "0", ["sh", "-c", PREPARE, "sh", self._user, self.cwd],
                                      lambda _, data: output.add(data))
            if code != 0:
                raise SandboxError(f"cannot prepare {self.cwd} in image {self.image}: {last_line(output.text())}")
        return cid

    async def _kill_all(self, cid: str) -> None:
        """End every process of the commands' user (every process but PID 1 under docker_root)."""
        async with _control("cannot stop the command"):
            await run_exec(cid, self._user, KILL_ALL, lambda *_: None)

    @property
    def _user(self) -> str:
        return f"{self._uid[0]}:{self._uid[0]}" if self._uid else "0"

    async def start_process(self, command: list[str], env: dict[str, str]) -> Exec:
        """`command` as a long-lived process of this container, its stdin attached: the commands'
        user, in the work dir, the image's environment plus `env` (through the API: no command line
        holds it). It ends when its stdin closes, or with the container."""
        return await start_exec(await self._container(), self._user, command, stdin=True, env=env)

    async def start(self) -> None:
        await self._container()
        if self._loop is not None:
            await self._loop.start()

    async def run(self, command: str, timeout: float) -> ExecResult:
        cid = await self._container()
        if self._loop is not None:
            return await self._loop.run(command, timeout)
        output = Capture()
        try:
            async with asyncio.timeout(timeout):
                code = await run_exec(cid, self._user, ["sh", "-c", MERGED, "sh", command], lambda _, data: output.add(data))
        except TimeoutError:  # the command runs on inside without our connection: kill all it left
            await self._kill_all(cid)
            return ExecResult(output.text(), None, f"timed out after {timeout:g} s; the command and its children were killed")
        if code is None:
            return ExecResult(output.text(), None, "the Docker engine did not report the command's exit status")
        return ExecResult(output.text(), code)

    async def read_chunks(self, path: str) -> AsyncIterator[bytes]:
        cid = await self._container()
        errors = Capture()
        timeout = self.config.command_timeout
        try:
            async with asyncio.timeout(timeout):
                ex = await start_exec(cid, self._user, ["sh", "-c", READ, "sh", path])
                try:
                    async for stream, data in ex.frames():
                        if stream == STDOUT:
                            yield data
                        else:
                            errors.add(data)
                    code = await ex.exit_code()
                finally:
                    ex.close()
        except TimeoutError:
            raise SandboxError(f"cannot read {path}: no end within {timeout:g} s") from None
        if code != 0:
            raise SandboxError(f"cannot read {path}: {last_line(errors.text())}")

    async def write_file(self, path: str, data: bytes) -> None:
        cid = await self._container()
        errors = Capture()
        timeout = self.config.command_timeout
        try:
            async with asyncio.timeout(timeout):
                code = await run_exec(cid, self._user, ["sh", "-c", WRITE, "sh", path],
                                      lambda _, chunk: errors.add(chunk), stdin=data)
        except TimeoutError:
            raise SandboxError(f"cannot write {path}: no end within {timeout:g} s") from None
        if code != 0:
            raise SandboxError(f"cannot write {path}: {last_line(errors.text())}")

    async def end_processes(self) -> None:
        """Every process of the commands' user, MCP servers (`docker exec`s of that user) included,
        whether or not the command loop runs now; the loop's connection is closed."""
        if self._loop is not None and self._loop.running:
            await self._loop.stop()  # which kills them all
        elif self._id is not None:
            await self._kill_all(self._id)

    async def close(self) -> None:
        if self._id is not None and not self.config.keep:
            try:
                async with _control("cannot remove the container"):
                    await call("remove_container", self._id, force=True)
            except SandboxError:  # gone already, or left to the run's cleanup, which removes by label
                pass
            self._id = None
        if self._loop is not None:  # a kept container's loop is killed; a removed one's connection closed
            await self._loop.stop()
        if self._pts is not None:  # a kept container keeps its own reference to the instance
            await asyncio.to_thread(roots.remove_work_dir, self._pts)
            self._pts = None
        if self._uid is not None:
            locks.release(self._uid[1])
            self._uid = None


def _engine_is_local() -> bool:
    """Whether a root runner can give containers a devpts instance of their own: the engine runs on
    this machine (a unix socket) and sees its mounts."""
    host = os.environ.get("DOCKER_HOST", "unix://")
    return os.geteuid() == 0 and host.startswith("unix://") and not os.environ.get("DOCKER_CONTEXT")


@asynccontextmanager
async def _control(what: str, timeout: float = CONTROL_TIMEOUT) -> AsyncIterator[None]:
    """A call to the engine bounded by `timeout`; its failure one SandboxError line that starts with `what`."""
    try:
        async with asyncio.timeout(timeout):
            yield
    except BackendUnreachable:  # says all by itself, and must stay what it is
        raise
    except SandboxError as e:
        raise SandboxError(f"{what}: {e}") from None
    except TimeoutError:
        raise SandboxError(f"{what}: the Docker engine did not answer within {timeout:g} s") from None


def open_docker(config: SandboxConfig, key: str, image: str | None, cwd: str | None) -> DockerSandbox:
    return DockerSandbox(config, key, image or config.docker_image, cwd or "/workspace")


async def check_image(image: str, config: SandboxConfig) -> str | None:
    """None if the image is local or could be pulled (with the CLI's registry logins), else a one-line reason."""
    try:
        async with _control(f"cannot inspect image {image}"):
            try:
                await call("inspect_image", image)
                return None
            except EngineError as e:
                if e.status != 404:
                    raise
        async with _control(f"image {image} is not available locally and pulling it failed", PULL_TIMEOUT):
            await pull(image)
    except BackendUnreachable:
        raise
    except SandboxError as e:
        return str(e)
    return None


def remove_containers(tag: str, value: str) -> None:
    """Force-remove every container labelled <tag>=<value>; quiet when there is no engine."""
    try:
        for container in sync_call("containers", all=True, quiet=True, filters={"label": f"{tag}={value}"}):
            sync_call("remove_container", container["Id"], force=True)
    except SandboxError:
        pass


BACKEND = Backend(open_docker, check_image, remove_containers)
