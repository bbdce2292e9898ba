"""The tool registry, as a public entry point: see trajgen/registry.py."""
from trajgen.registry import ALL_TOOL_NAMES, REGISTRY, dispatch, offered_tools, toolset_tools, unavailable_tools, unavailable_toolsets

__all__ = ["ALL_TOOL_NAMES", "REGISTRY", "dispatch", "offered_tools", "toolset_tools", "unavailable_tools",
           "unavailable_toolsets"]
