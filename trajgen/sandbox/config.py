"""Sandbox settings and the backend-neutral entry points the runner calls.

The parent process builds one `SandboxConfig` per run and pickles it to the workers; each
worker opens one sandbox per prompt with `open_sandbox`. The parent calls `cleanup` at exit
and after a worker crash, so nothing a crashed worker left behind survives the run.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from trajgen.sandbox import Sandbox, SandboxError
from trajgen.sandbox.docker import DockerSandbox, check_image, remove_containers
from trajgen.sandbox.local import bwrap_problem, open_local

__all__ = ["SandboxConfig", "open_sandbox", "cleanup", "bwrap_problem", "check_images"]


@dataclass
class SandboxConfig:
    backend: str = "local"  # "local" (bubblewrap) or "docker"
    command_timeout: float = 180
    docker_image: str = "python:3.11-slim"  # used when a row names no image
    network: bool = False
    keep: bool = False  # leave work dirs and containers behind for debugging
    unsafe_local: bool = False  # without bubblewrap, run commands unisolated instead of failing
    root_dir: str = field(default_factory=lambda: new_root_dir())
    label: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # session id on every container
    cpu_seconds: int = 600  # per process
    memory_mb: int = 4096  # local: per process (RLIMIT_DATA); docker: per container
    max_processes: int = 512  # local: per uid (RLIMIT_NPROC); docker: per container
    file_size_mb: int = 1024  # largest file a command may write
    cpus: float = 1.0  # docker only


ROOT_PREFIX = "trajgen-sandboxes-"


def new_root_dir() -> str:
    """The run's sandbox root, named after the runner's pid so a later run can tell it is stale."""
    sweep_stale_roots()
    return tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{os.getpid()}-")


def sweep_stale_roots() -> None:
    """A runner killed with -9 cannot clean up: remove roots whose runner is gone."""
    for path in Path(tempfile.gettempdir()).glob(f"{ROOT_PREFIX}*"):
        pid = path.name.removeprefix(ROOT_PREFIX).split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


def open_sandbox(config: SandboxConfig, key: str, image: str | None = None, cwd: str | None = None) -> Sandbox:
    """One prompt's sandbox; `key` names its work dir or container. Docker starts lazily, at first use."""
    if config.backend == "local":
        return open_local(config, key, cwd)
    if config.backend == "docker":
        return DockerSandbox(config, key, image or config.docker_image, cwd or "/workspace")
    raise SandboxError(f"unknown sandbox backend {config.backend!r} (expected 'local' or 'docker')")


def cleanup(config: SandboxConfig) -> None:
    """Remove every work dir under root_dir and every container of this session; safe to repeat.

    With `keep` nothing is removed: the user asked to inspect the sandboxes afterwards.
    """
    if config.keep:
        return
    shutil.rmtree(config.root_dir, ignore_errors=True)
    if config.backend == "docker":
        remove_containers(config.label)


async def check_images(images: list[str], config: SandboxConfig) -> dict[str, str | None]:
    """Check (pulling if needed) each distinct image once, in parallel: None if usable, else why not.

    Sandboxes never pull (`docker run --pull never`), so this is where a run learns up front
    which images it cannot use. Other backends use no images: everything is usable.
    """
    distinct = list(dict.fromkeys(images))
    if config.backend != "docker":
        return {image: None for image in distinct}
    reasons = await asyncio.gather(*(check_image(image) for image in distinct))
    return dict(zip(distinct, reasons))
