"""The tool registry: every tool's schema, its toolset, and dispatch of a model's tool call.

Tools are plain async functions listed as `ToolSpec`s by the modules in `trajgen/tools/`.
Toolsets whose tools are not built yet are registered with their schemas and a reason, so a
run that samples them says so instead of silently dropping them.
"""
from __future__ import annotations

import inspect

import orjson

from toolset_distributions import TOOLSETS

from trajgen.tools import ToolContext, ToolSettings, ToolSpec
from trajgen.tools.files import TOOLS as FILE_TOOLS
from trajgen.tools.terminal import TOOLS as TERMINAL_TOOLS

def _not_built(settings: ToolSettings) -> str:
    return "not built yet in this version"


def _planned(name: str, toolset: str, description: str, properties: dict, required: list[str]) -> ToolSpec:
    parameters = {"type": "object", "properties": properties, "required": required}
    return ToolSpec(name, toolset, description, parameters, fn=None, unavailable=_not_built)


_S = {"type": "string"}
PLANNED_TOOLS = [
    _planned("web_search", "web", "Search the web.", {"query": _S, "limit": {"type": "integer"}}, ["query"]),
    _planned("web_extract", "web", "Fetch pages as markdown.", {"urls": {"type": "array", "items": _S}}, ["urls"]),
    _planned("vision_analyze", "vision", "Ask a vision model about an image.",
             {"image_url": _S, "question": _S}, ["image_url", "question"]),
    _planned("image_generate", "image_gen", "Generate an image.", {"prompt": _S, "size": _S}, ["prompt"]),
    _planned("browser_navigate", "browser", "Open a URL in the browser.", {"url": _S}, ["url"]),
    _planned("browser_snapshot", "browser", "The page's accessibility tree with numbered refs.", {}, []),
    _planned("browser_click", "browser", "Click an element by ref.", {"ref": _S}, ["ref"]),
    _planned("browser_type", "browser", "Type text into an element by ref.", {"ref": _S, "text": _S}, ["ref", "text"]),
    _planned("browser_scroll", "browser", "Scroll the page.", {"direction": {"type": "string", "enum": ["up", "down"]}},
             ["direction"]),
    _planned("browser_back", "browser", "Go back in history.", {}, []),
]

REGISTRY: dict[str, ToolSpec] = {t.name: t for t in [*TERMINAL_TOOLS, *FILE_TOOLS, *PLANNED_TOOLS]}
ALL_TOOL_NAMES: tuple[str, ...] = tuple(REGISTRY)


def toolset_tools(toolset: str) -> list[ToolSpec]:
    return [t for t in REGISTRY.values() if t.toolset == toolset]


def unavailable_tools(settings: ToolSettings) -> dict[str, str]:
    """Tool name -> one-line reason, for the tools that cannot be offered with these settings."""
    reasons = {}
    for tool in REGISTRY.values():
        reason = tool.unavailable(settings) if tool.unavailable else None
        if reason:
            reasons[tool.name] = reason
    return reasons


def unavailable_toolsets(unavailable: dict[str, str]) -> dict[str, str]:
    """Toolset -> reason, for toolsets none of whose tools can be offered."""
    reasons = {}
    for toolset in TOOLSETS:
        tools = toolset_tools(toolset)
        if tools and all(t.name in unavailable for t in tools):
            reasons[toolset] = unavailable[tools[0].name]
    return reasons


def offered_tools(toolsets: list[str], unavailable: dict[str, str]) -> list[ToolSpec]:
    return [t for ts in toolsets for t in toolset_tools(ts) if t.name not in unavailable]


async def dispatch(name: str, raw_arguments: str, offered: dict[str, ToolSpec], ctx: ToolContext) -> dict:
    """Run one tool call; every mistake of the model comes back as a failed result, never an exception."""
    spec = offered.get(name)
    if spec is None:
        return {"success": False, "error": f"unknown tool {name!r}; available tools: {', '.join(offered) or 'none'}"}
    try:
        arguments = orjson.loads(raw_arguments or "{}")
    except orjson.JSONDecodeError as e:
        return {"success": False, "error": f"arguments are not valid JSON: {e}"}
    if not isinstance(arguments, dict):
        return {"success": False, "error": "arguments must be a JSON object"}
    try:
        inspect.signature(spec.fn).bind(ctx, **arguments)
    except TypeError as e:
        return {"success": False, "error": f"bad arguments for {name}: {e}"}
    try:
        return await spec.fn(ctx, **arguments)
    except Exception as e:  # a tool's own bug must not end the conversation; it counts as that tool's failure
        return {"success": False, "error": f"{type(e).__name__}: {e}"}
