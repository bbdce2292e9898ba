"""The tool registry: every tool's schema, its toolset, and dispatch of a model's tool call.

Tools are plain async functions listed as `ToolSpec`s by the modules in `trajgen/tools/`.
A tool that cannot run here (no search provider, no chromium...) says why through its
`unavailable` check, so a run that samples it says so instead of silently dropping it.
"""
from __future__ import annotations

import functools

import jsonschema
import orjson

from trajgen.distributions import TOOLSETS

from trajgen.tools import ToolContext, ToolSettings, ToolSpec
from trajgen.tools.browser import TOOLS as BROWSER_TOOLS
from trajgen.tools.files import TOOLS as FILE_TOOLS
from trajgen.tools.images import TOOLS as IMAGE_TOOLS
from trajgen.tools.terminal import TOOLS as TERMINAL_TOOLS
from trajgen.tools.vision import TOOLS as VISION_TOOLS
from trajgen.tools.web import TOOLS as WEB_TOOLS

REGISTRY: dict[str, ToolSpec] = {
    t.name: t for t in [*TERMINAL_TOOLS, *FILE_TOOLS, *WEB_TOOLS, *VISION_TOOLS, *IMAGE_TOOLS, *BROWSER_TOOLS]
}
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


def offered_tools(toolsets: list[str], unavailable: dict[str, str], mcp_tools: tuple[ToolSpec, ...] = ()) -> list[ToolSpec]:
    """The tools of `toolsets`, built-in or MCP (which are always available: the probe started them)."""
    return [t for ts in toolsets for t in [*toolset_tools(ts), *(m for m in mcp_tools if m.toolset == ts)]
            if t.name not in unavailable]


async def dispatch(name: str, raw_arguments: str, offered: dict[str, ToolSpec], ctx: ToolContext) -> dict:
    """Run one tool call, its arguments checked against the tool's schema first (an optional one sent as
    null counts as left out); every mistake of the model comes back as a failed result, never an exception."""
    spec = offered.get(name)
    if spec is None:
        return {"success": False, "error": f"unknown tool {name!r}; available tools: {', '.join(offered) or 'none'}"}
    try:
        arguments = orjson.loads(raw_arguments or "{}")
    except orjson.JSONDecodeError as e:
        return {"success": False, "error": f"arguments are not valid JSON: {e}"}
    if not isinstance(arguments, dict):
        return {"success": False, "error": "arguments must be a JSON object"}
    required = spec.parameters.get("required", ())
    arguments = {k: v for k, v in arguments.items() if v is not None or k in required}  # null: left out
    if error := argument_error(spec.parameters, arguments):
        return {"success": False, "error": f"bad arguments for {name}: {error}"}
    try:
        return await spec.fn(ctx, **arguments)
    except Exception as e:  # a tool's own bug must not end the conversation; it counts as that tool's failure
        return {"success": False, "error": f"{type(e).__name__}: {e}"}


def argument_error(schema: dict, arguments: dict) -> str | None:
    """What is wrong with a tool call's arguments by the tool's own JSON schema, in one line, or None."""
    validator = _validator(orjson.dumps(schema, option=orjson.OPT_SORT_KEYS))
    error = jsonschema.exceptions.best_match(validator.iter_errors(arguments)) if validator else None
    if error is None:
        return None
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
    return f"`{where}`: {error.message}" if where else error.message


@functools.lru_cache(maxsize=1024)
def _validator(schema: bytes) -> jsonschema.protocols.Validator | None:
    """One validator per schema, in the schema's own draft (2020-12 when it names none); `integer`
    means a JSON integer (5, not 5.0 or true) as the tools take it. None for a schema jsonschema
    cannot read (an MCP server's own mistake, which its server judges)."""
    loaded = orjson.loads(schema)
    cls = jsonschema.validators.validator_for(loaded, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(loaded)
    except jsonschema.SchemaError:
        return None
    strict = cls.TYPE_CHECKER.redefine("integer", lambda _, value: type(value) is int)
    return jsonschema.validators.extend(cls, type_checker=strict)(loaded)
