"""The backend-neutral entry points the runner calls.

The parent process builds one `SandboxConfig` per run (with `new_root_dir`) and pickles it to the
workers; each worker opens one sandbox per prompt with `open_sandbox`. The parent calls `cleanup`
at exit and after a worker crash, so nothing a crashed worker left behind survives the run.
"""
from __future__ import annotations

import asyncio
import importlib
import os

from trajgen.sandbox import RUN_TAG, SESSION_TAG, Backend, Sandbox, SandboxConfig, SandboxError, cgroups, shares, slots
from trajgen.sandbox.local import bwrap_problem
from trajgen.sandbox.process import watch_children_with_pidfds
from trajgen.sandbox.roots import new_root_dir, own_mount_table, release_root, remove_root

__all__ = ["BACKENDS", "SandboxConfig", "open_sandbox", "cleanup", "reap", "bwrap_problem", "check_images",
           "new_root_dir", "limit_notices", "prepare_host", "prepare_worker", "runs_images", "runtime_problem"]

# backend name -> the module that declares its `BACKEND`, imported only when a run selects it: a local run loads
# no container SDK
BACKENDS: dict[str, str] = {
    "local": "trajgen.sandbox.local",
    "docker": "trajgen.sandbox.docker",
    "apptainer": "trajgen.sandbox.apptainer",
    "modal": "trajgen.sandbox.modal_sandbox",
}


def backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise SandboxError(f"unknown sandbox backend {name!r} (expected one of {', '.join(BACKENDS)})")
    return importlib.import_module(BACKENDS[name]).BACKEND


def open_sandbox(config: SandboxConfig, key: str, image: str | None = None, cwd: str | None = None) -> Sandbox:
    """One prompt's sandbox; `key` names its work dir or container. Nothing runs until its `start` or first use."""
    return backend(config.backend).open(config, key, image, cwd)


def runs_images(name: str) -> bool:
    """Whether a row's `image` means anything to this backend."""
    return backend(name).check_image is not None


def limit_notices(config: SandboxConfig) -> list[str]:
    """What the sandboxes cannot limit on this machine, to say once at the start of a run."""
    notices = backend(config.backend).limit_notices
    return notices() if notices else []


def runtime_problem(name: str) -> str | None:
    """Why the backend's runtime cannot run on this machine, or None."""
    problem = backend(name).runtime_problem
    return problem() if problem else None


def prepare_host(config: SandboxConfig) -> list[str]:
    """Change what this machine's sandboxes need changed on it (as root only), before the first one
    starts; the lines that say what was changed, or is left to do (docs/sandboxes.md)."""
    if config.backend == "modal":  # its sandboxes run on Modal's machines
        return []
    return [line] if (line := shares.widen_file_table()) else []


def prepare_worker(config: SandboxConfig) -> None:
    """In a worker process before its first thread: its children are watched by pidfd, and as root, a
    local run's worker gets a mount table of its own (roots.own_mount_table). Without one, which a process
    with threads cannot have (a Ray actor), its sandboxes work the same, only slower as the machine's
    table grows."""
    watch_children_with_pidfds()
    if config.backend == "local" and os.geteuid() == 0:
        try:
            own_mount_table()
        except OSError:
            pass


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
    if remove := backend(config.backend).remove:
        remove(SESSION_TAG, config.label)


def reap(config: SandboxConfig) -> None:
    """Remove what earlier invocations of this run left (a runner killed with -9 cleans nothing up).

    Call only while holding the run directory's lock: then no live runner owns a sandbox of this run.
    """
    if not config.run_id:
        return
    cgroups.remove(run_id=config.run_id)
    if (remove := backend(config.backend).remove) and not config.keep:
        remove(RUN_TAG, config.run_id)


async def check_images(images: list[str], config: SandboxConfig) -> dict[str, str | None]:
    """Check (pulling or building if needed) each distinct image once, in parallel: None if usable, else why not.

    Sandboxes never pull or build, so this is where a run learns up front which images it cannot use.
    """
    check = backend(config.backend).check_image
    if check is None:
        return {}
    distinct = list(dict.fromkeys(images))
    reasons = await asyncio.gather(*(check(image, config) for image in distinct))
    return dict(zip(distinct, reasons))
