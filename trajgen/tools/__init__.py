"""Tool implementations. Each module lists its tools as `ToolSpec`s; `model_tools.py` is the registry.

A tool is a plain async function `fn(ctx, **arguments) -> dict`. The dict always has
`success` (bool) and `error` (str or None); statistics read `success`, never the text.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from trajgen.sandbox import Sandbox


@dataclass
class ToolContext:
    """What a tool may use during one prompt: its lazily created sandbox and the run's limits."""

    sandbox: Callable[[], Awaitable[Sandbox]]
    command_timeout: float = 180.0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolSpec:
    name: str
    toolset: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    fn: Callable[..., Awaitable[dict]] | None  # None: registered but not built
    unavailable: str | None = None  # why the tool cannot be offered here, if it cannot

    def schema(self) -> dict:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }
