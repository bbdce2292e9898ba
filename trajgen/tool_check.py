"""`--list_tools`: every toolset's tools and whether each can run here, before a run spends anything.

The same checks a run makes (each tool's `unavailable`, the sandbox backend's), with why and what
to do. No request leaves the machine: the Docker engine is asked only on a local socket or loopback,
and Modal only whether its SDK and credentials are present.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from trajgen import help_text, registry
from trajgen.distributions import TOOLSETS
from trajgen.errors import UsageError
from trajgen.options import DEFAULT_BASE_URL, RunOptions
from trajgen.plan import SANDBOX_TOOLSETS
from trajgen.sandbox import SandboxError
from trajgen.sandbox.backends import BACKENDS, bwrap_problem, runtime_problem

FETCHING = ("web_extract",)  # tools outside the browser toolset that fetch a URL the model names


def listing(opts: RunOptions) -> str:
    if opts.backend not in BACKENDS:
        raise UsageError(f"--terminal_backend must be one of {', '.join(BACKENDS)}, got {opts.backend!r}")
    api_key = opts.api_key or os.environ.get("OPENROUTER_API_KEY") or os.environ.get("OPENAI_API_KEY") or ""
    unavailable = registry.unavailable_tools(opts.tool_settings(api_key))
    sandbox = sandbox_problem(opts)
    key_missing = ("no API key for the default endpoint: set OPENROUTER_API_KEY or OPENAI_API_KEY"
                   if not api_key and (opts.vision_base_url or opts.base_url) == DEFAULT_BASE_URL
                   and not opts.vision_api_key else None)
    toolsets = {}
    for toolset in TOOLSETS:
        tools = []
        for tool in registry.toolset_tools(toolset):
            reason = unavailable.get(tool.name)
            if reason is None and toolset in SANDBOX_TOOLSETS and sandbox:
                reason = "its sandbox cannot run (below)"
            if reason is None and toolset == "vision":
                reason = key_missing
            tools.append((tool.name, reason, _reach(opts) if tool.name in FETCHING or toolset == "browser" else ""))
        toolsets[toolset] = tools
    return help_text.tools_text(opts.backend, toolsets, sandbox)


def _reach(opts: RunOptions) -> str:
    if opts.allow_private_urls:
        return " (any address: --allow_private_urls)"
    return " (public addresses only; --allow_private_urls lets it reach private ones)"


def sandbox_problem(opts: RunOptions) -> str | None:
    """Why the terminal and file tools' sandbox cannot run under the chosen backend, and what to do."""
    backend = opts.backend
    if backend == "local":
        problem = bwrap_problem()
        if problem and not opts.unsafe_local:
            return (f"bubblewrap cannot run here ({problem}): apt-get install bubblewrap, or pass --unsafe_local "
                    "(plain directories, weaker isolation)")
        return None
    if backend == "docker":
        return _docker_problem()
    if backend == "apptainer":
        problem = runtime_problem(backend)
        return f"{problem}: install Apptainer, or choose another --terminal_backend" if problem else None
    if importlib.util.find_spec("modal") is None:
        return "the modal SDK is not installed: pip install 'trajgen-batch-runner[modal]'"
    if not (os.environ.get("MODAL_TOKEN_ID") or Path.home().joinpath(".modal.toml").exists()):
        return "no Modal credentials: run `modal token set`, or set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET"
    return None


def _docker_problem() -> str | None:
    """Asks the engine for its version when it listens on this machine; says so when it does not."""
    from trajgen.sandbox import docker_client

    try:
        if not docker_client.on_this_machine():
            return None  # a remote engine is not asked here: the run checks it before the first prompt
        docker_client.sync_call("version")
    except SandboxError as e:
        return f"{e}: start the Docker engine, or set DOCKER_HOST"
    return None
