"""A long-lived process with stdio pipes inside a prompt's sandbox, for a library that starts it.

The MCP SDK starts a server's process itself and passes it no file descriptors, while a local
sandbox's bwrap reads its options and seccomp filter from memfds. So the process started there is
bash, which opens those memfds again through /proc under the numbers bwrap expects, then becomes
the sandbox's argv: the host path of the work dir stays out of every command line. In a docker
sandbox the process is a `docker exec -i` into the prompt's container, in an apptainer one an
`apptainer exec` into its instance. A modal sandbox runs no process on this machine: its process
comes from ModalSandbox.start_process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from trajgen.sandbox import Sandbox, SandboxError, apptainer
from trajgen.sandbox.docker import DockerSandbox
from trajgen.sandbox.docker_client import docker_env
from trajgen.sandbox.local import LocalSandbox, sandbox_env


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]  # of the process started on the host (not of the command inside)
    cwd: str | None
    fds: tuple[int, ...] = ()  # memfds this process holds open until the started process has read them

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


async def launch(sandbox: Sandbox, command: list[str], env: dict[str, str]) -> Launch:
    """How to start `command` in `sandbox` with `env` over the sandbox's own environment;
    SandboxError for a backend whose processes do not run on this machine."""
    if isinstance(sandbox, DockerSandbox):
        return Launch(await sandbox.process_argv(command, env), docker_env(), None)
    if isinstance(sandbox, apptainer.ApptainerSandbox):
        return Launch(await sandbox.process_argv(command), apptainer.runtime_env(env), None)
    if not isinstance(sandbox, LocalSandbox):
        raise SandboxError(f"the {type(sandbox).__name__} backend runs no process on this machine")
    argv, fds = sandbox.process_argv(command, {**sandbox_env(sandbox.cwd), **env})
    if fds:
        pid = os.getpid()
        argv = ["bash", "-c", 'exec "$@" ' + " ".join(f"{fd}</proc/{pid}/fd/{fd}" for fd in fds), "bash", *argv]
    return Launch(argv, sandbox_env(sandbox.cwd), sandbox.host_dir, tuple(fds))
