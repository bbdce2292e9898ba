"""Per-prompt sandboxes: where the model's commands and file edits happen.

This module holds the data and the protocol; `backends` opens sandboxes by backend name, importing a backend's
module only when a run selects it
(`local`: bubblewrap, `docker`, `apptainer`, `modal`), `process` runs and caps commands. A backend builds one
sandbox per prompt, started while the prompt's first model call runs (or at its first tool call);
the conversation closes it when the prompt ends. Every backend returns plain data, and nothing
here has side effects until a sandbox is opened: a bare `SandboxConfig()` creates no directory.
"""
from __future__ import annotations

import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Protocol

SESSION_TAG = "trajgen.session"  # every sandbox of one invocation (SandboxConfig.label)
RUN_TAG = "trajgen.run"  # every sandbox of one run directory, whichever invocation started it (run_id)


@dataclass
class ExecResult:
    output: str  # stdout and stderr interleaved, already capped (head and tail kept)
    exit_code: int | None  # None when the command did not finish (timeout, limit, sandbox fault)
    error: str | None = None  # why the command did not finish; None for a normal exit


class SandboxError(Exception):
    """The sandbox itself failed (could not start, image missing, path refused)."""


class BackendUnreachable(SandboxError):
    """The backend itself cannot be reached or refuses us (no engine, no credentials): the prompt's
    sandbox fails like any other, but found before the run, when images are checked, it stops the
    run at once instead of failing every prompt."""


@dataclass(frozen=True)
class SandboxConfig:
    """The run's sandbox settings: built once by the parent, pickled to every worker."""

    backend: str = "local"  # a key of backends.BACKENDS
    command_timeout: float = 180
    docker_image: str = "python:3.11-slim"  # used when a row names no image
    docker_root: bool = False  # run container commands as root (images that need it) instead of uid 65534
    network: bool = False
    keep: bool = False  # leave work dirs and containers behind for debugging
    unsafe_local: bool = False  # without bubblewrap, run commands unisolated instead of failing
    root_dir: str = ""  # the run's sandbox root (roots.new_root_dir); required to open a local sandbox
    run_dir: str = ""  # the run directory: never shown in a sandbox, even inside a dir an MCP config names
    label: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # session id on every container and cgroup
    run_id: str = ""  # the run directory's id on every container, so a later invocation can reap what a killed one left
    cpu_seconds: int = 600  # per process
    memory_mb: int = 4096  # the whole sandbox, /tmp and the work dir included (per process where no cgroup)
    disk_mb: int = 1024  # size of the sandbox's /tmp and of its work dir, each
    max_processes: int = 512  # per sandbox
    slots: int = 32  # sandboxes of the run open at once (its concurrency): they share the machine's tables (shares.py)
    file_size_mb: int = 1024  # largest file a command may write
    cpus: float = 1.0  # container backends only
    sif_cache: str = ""  # apptainer: where images are built into SIF files (default ~/.cache/trajgen/sif)
    modal_app: str = "trajgen"  # the Modal app the sandboxes run under
    modal_timeout: int = 3600  # seconds a Modal sandbox may live


class Sandbox(Protocol):
    cwd: str  # the working directory as the model sees it

    async def start(self) -> None:
        """Start what its first command needs (a command loop, a container), ahead of that command;
        a first command starts it anyway."""
        ...

    async def run(self, command: str, timeout: float) -> ExecResult: ...

    def read_chunks(self, path: str) -> AsyncIterator[bytes]:
        """The file's bytes, chunk by chunk, so a caller holds only what it keeps."""
        ...

    async def write_file(self, path: str, data: bytes) -> None: ...

    async def end_processes(self) -> None:
        """Kill every process of the sandbox (what its commands left, its MCP servers and what they
        started) and return once they are gone; the files stay."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class Backend:
    """What the runner needs of a backend, which each backend's module declares as its `BACKEND`: open a
    prompt's sandbox; for backends that run a row's container image, check an image before the first
    request and remove tagged leftovers; what keeps it from running here, what it cannot limit here."""

    open: Callable[[SandboxConfig, str, str | None, str | None], Sandbox]
    check_image: Callable[[str, SandboxConfig], Awaitable[str | None]] | None = None  # None if usable, else why not
    remove: Callable[[str, str], None] | None = None  # remove(tag, value): every sandbox carrying the tag
    runtime_problem: Callable[[], str | None] | None = None  # None if its runtime can run here, else why not
    limit_notices: Callable[[], list[str]] | None = None


async def read_file(sandbox: Sandbox, path: str, max_bytes: int) -> bytes:
    """The whole file, refused (SandboxError) past `max_bytes`: no file can fill a worker's memory."""
    data = bytearray()
    async with aclosing(sandbox.read_chunks(path)) as chunks:
        async for chunk in chunks:
            data += chunk
            if len(data) > max_bytes:
                raise SandboxError(f"{path} is larger than {max_bytes} bytes; too large for this tool")
    return bytes(data)
