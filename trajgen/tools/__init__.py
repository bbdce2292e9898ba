"""Tool implementations. Each module lists its tools as `ToolSpec`s; `trajgen/registry.py` gathers them.

A tool is a plain async function `fn(ctx, **arguments) -> dict`. The dict always has
`success` (bool) and `error` (str or None); statistics read `success`, never the text.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from trajgen.sandbox import Sandbox


@dataclass
class ToolSettings:
    """The run's settings that tools read: built once by the parent, pickled to every worker."""

    base_url: str = ""  # the run's endpoint and key, for tools that call a model
    api_key: str = ""
    model: str = ""
    vision_model: str = ""  # vision_analyze's model; "" means the run's model
    vision_base_url: str = ""  # vision_analyze's endpoint; "" means the run's endpoint
    vision_api_key: str = ""  # "" means the run's key, sent only to the run's own endpoint
    image_model: str = ""  # image_generate through the endpoint's images API; "" means FAL (FAL_KEY)
    browser_executable: str = ""  # chromium for the browser tools; "" means $CHROMIUM_PATH, else `chromium` on PATH
    allow_private_urls: bool = False  # web_extract and the browser may reach loopback/private addresses
    browser_memory_mb: int = 4096  # the memory cgroup of a worker's browser (--sandbox_memory), when run as root
    run_id: str = ""  # the run directory's id, on the browser's cgroup so the run's end or next invocation removes it
    tool_timeout: float = 60.0  # seconds an MCP tool call may take, its server's start included


@dataclass
class ToolContext:
    """What a tool may use during one prompt: its lazily created sandbox, the run's settings,
    per-prompt state, and cleanups that run when the prompt ends (however it ends)."""

    sandbox: Callable[[], Awaitable[Sandbox]]
    command_timeout: float = 180.0
    settings: ToolSettings = field(default_factory=ToolSettings)
    state: dict[str, Any] = field(default_factory=dict)
    cleanups: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # files made for the user, by path relative to the run directory: they travel home in the
    # prompt's outcome and the parent writes them (a worker never writes the run directory)
    files: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolSpec:
    name: str
    toolset: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    fn: Callable[..., Awaitable[dict]]
    unavailable: Callable[[ToolSettings], str | None] | None = None  # why it cannot be offered here

    def schema(self) -> dict:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }
