"""The backend-neutral entry points the runner calls.

The parent process builds one `SandboxConfig` per run (with `new_root_dir`) and pickles it to the
workers; each worker opens one sandbox per prompt with `open_sandbox`. The parent calls `cleanup`
at exit and after a worker crash, so nothing a crashed worker left behind survives the run.
"""
from __future__ import annotations

import asyncio
import os
from typing import Callable

from trajgen.sandbox import Sandbox, SandboxConfig, SandboxError, cgroups
from trajgen.sandbox.docker import check_image, open_docker, remove_containers
from trajgen.sandbox.local import bwrap_problem, open_local
from trajgen.sandbox.roots import new_root_dir, release_root, remove_root

__all__ = ["SandboxConfig", "open_sandbox", "cleanup", "bwrap_problem", "check_images", "new_root_dir", "limit_notices"]

BACKENDS: dict[str, Callable[[SandboxConfig, str, str | None, str | None], Sandbox]] = {
    "local": open_local,
    "docker": open_docker,
}


def open_sandbox(config: SandboxConfig, key: str, image: str | None = None, cwd: str | None = None) -> Sandbox:
    """One prompt's sandbox; `key` names its work dir or container. Docker starts lazily, at first use."""
    backend = BACKENDS.get(config.backend)
    if backend is None:
        raise SandboxError(f"unknown sandbox backend {config.backend!r} (expected one of {', '.join(BACKENDS)})")
    return backend(config, key, image, cwd)


def limit_notices(config: SandboxConfig) -> list[str]:
    """What the local sandboxes cannot limit on this machine, to say once at the start of a run."""
    if config.backend != "local" or bwrap_problem():
        return []
    notices = []
    if os.geteuid() != 0:
        notices.append("the runner is not root: sandboxes share its uid and their work dirs have no size limit")
    if reason := cgroups.problem():
        notices.append(f"sandboxes get no cgroup ({reason}): memory and processes are limited per process "
                       "and per uid only, and /tmp pages are not counted")
    return notices


def cleanup(config: SandboxConfig) -> None:
    """Remove every work dir under root_dir, every cgroup and container of this session; safe to repeat.

    With `keep` the work dirs and containers stay: the user asked to inspect them afterwards.
    """
    cgroups.remove_run(config.label)
    if config.keep:
        return
    if config.root_dir:
        remove_root(config.root_dir)
        release_root(config.root_dir)
    if config.backend == "docker":
        remove_containers(config.label)


async def check_images(images: list[str], config: SandboxConfig) -> dict[str, str | None]:
    """Check (pulling if needed) each distinct docker image once, in parallel: None if usable, else why not.

    Sandboxes never pull (`docker run --pull never`), so this is where a run learns up front
    which images it cannot use.
    """
    distinct = list(dict.fromkeys(images))
    reasons = await asyncio.gather(*(check_image(image) for image in distinct))
    return dict(zip(distinct, reasons))
