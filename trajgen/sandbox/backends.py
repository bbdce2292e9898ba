"""The backend-neutral entry points the runner calls.

The parent process builds one `SandboxConfig` per run (with `new_root_dir`) and pickles it to the
workers; each worker opens one sandbox per prompt with `open_sandbox`. The parent calls `cleanup`
at exit and after a worker crash, so nothing a crashed worker left behind survives the run.
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Awaitable, Callable

from trajgen.sandbox import (Sandbox, SandboxConfig, SandboxError, apptainer, cgroups, docker, modal_sandbox, shares,
                             slots)
from trajgen.sandbox.local import bwrap_problem, open_local
from trajgen.sandbox.roots import new_root_dir, release_root, remove_root

__all__ = ["SandboxConfig", "open_sandbox", "cleanup", "reap", "bwrap_problem", "check_images", "new_root_dir",
           "limit_notices", "prepare_host", "runs_images"]

SESSION_TAG = "trajgen.session"  # every sandbox of one invocation (SandboxConfig.label)
RUN_TAG = "trajgen.run"  # every sandbox of one run directory, whichever invocation started it (run_id)


@dataclass(frozen=True)
class Backend:
    """What the runner needs of a backend: open a prompt's sandbox; for backends that run a row's
    container image, check an image before the first request and remove tagged leftovers."""

    open: Callable[[SandboxConfig, str, str | None, str | None], Sandbox]
    check_image: Callable[[str, SandboxConfig], Awaitable[str | None]] | None = None  # None if usable, else why not
    remove: Callable[[str, str], None] | None = None  # remove(tag, value): every sandbox carrying the tag


BACKENDS: dict[str, Backend] = {
    "local": Backend(open_local),
    "docker": Backend(docker.open_docker, docker.check_image, docker.remove_containers),
    "apptainer": Backend(apptainer.open_apptainer, apptainer.check_image, apptainer.remove_instances),
    "modal": Backend(modal_sandbox.open_modal, modal_sandbox.check_image, modal_sandbox.remove_sandboxes),
}


def open_sandbox(config: SandboxConfig, key: str, image: str | None = None, cwd: str | None = None) -> Sandbox:
    """One prompt's sandbox; `key` names its work dir or container. Containers start lazily, at first use."""
    backend = BACKENDS.get(config.backend)
    if backend is None:
        raise SandboxError(f"unknown sandbox backend {config.backend!r} (expected one of {', '.join(BACKENDS)})")
    return backend.open(config, key, image, cwd)


def runs_images(backend: str) -> bool:
    """Whether a row's `image` means anything to this backend."""
    return BACKENDS[backend].check_image is not None


def limit_notices(config: SandboxConfig) -> list[str]:
    """What the sandboxes cannot limit on this machine, to say once at the start of a run."""
    if config.backend == "apptainer":
        return apptainer.limit_notices()
    if config.backend != "local" or bwrap_problem():
        return []
    notices = []
    if os.geteuid() != 0:
        notices.append("the runner is not root: sandboxes share its uid, their work dirs have no size limit, "
                       "their PTYs no share of the machine's, and commands can read their command loop's memory")
    if reason := cgroups.problem():
        notices.append(f"sandboxes get no cgroup ({reason}): memory and processes are limited per process "
                       "and per uid only, and /tmp pages are not counted")
    return notices


def prepare_host(config: SandboxConfig) -> list[str]:
    """Change what this machine's sandboxes need changed on it (as root only), before the first one
    starts; the lines that say what was changed, or is left to do (docs/sandboxes.md)."""
    if config.backend == "modal":  # its sandboxes run on Modal's machines
        return []
    return [line] if (line := shares.widen_file_table()) else []


def cleanup(config: SandboxConfig) -> None:
    """Remove every work dir under root_dir, every cgroup and container of this session; safe to repeat.

    With `keep` the work dirs and containers stay: the user asked to inspect them afterwards.
    """
    slots.drop(config)  # the uids, groups and PTY instances this process kept for its next sandboxes
    cgroups.remove(label=config.label)
    if config.run_id:  # the workers' browsers' (tools/browser.py): the run directory's lock makes them this session's
        cgroups.remove(run_id=config.run_id, label=f"{cgroups.BROWSER}-*")
    if config.keep:
        return
    if config.root_dir:
        remove_root(config.root_dir)
        release_root(config.root_dir)
    if remove := BACKENDS[config.backend].remove:
        remove(SESSION_TAG, config.label)


def reap(config: SandboxConfig) -> None:
    """Remove what earlier invocations of this run left (a runner killed with -9 cleans nothing up).

    Call only while holding the run directory's lock: then no live runner owns a sandbox of this run.
    """
    if not config.run_id:
        return
    cgroups.remove(run_id=config.run_id)
    if (remove := BACKENDS[config.backend].remove) and not config.keep:
        remove(RUN_TAG, config.run_id)


async def check_images(images: list[str], config: SandboxConfig) -> dict[str, str | None]:
    """Check (pulling or building if needed) each distinct image once, in parallel: None if usable, else why not.

    Sandboxes never pull or build, so this is where a run learns up front which images it cannot use.
    """
    check = BACKENDS[config.backend].check_image
    if check is None:
        return {}
    distinct = list(dict.fromkeys(images))
    reasons = await asyncio.gather(*(check(image, config) for image in distinct))
    return dict(zip(distinct, reasons))
