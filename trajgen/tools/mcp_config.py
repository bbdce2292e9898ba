"""The MCP config: servers in the shape Claude Desktop, Cursor and VS Code use, checked at load.

Kept apart from trajgen/tools/mcp.py so that reading a config (and --list_distributions) needs
no MCP SDK.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import orjson

from trajgen.distributions import TOOLSETS
from trajgen.errors import UsageError

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
KEYS = {"command", "args", "env", "url", "type"}
TYPES = {"command": ("stdio",), "url": ("http", "streamable-http", "streamableHttp", "sse")}


@dataclass(frozen=True)
class Server:
    name: str  # its key in the config, and its toolset's name
    command: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    url: str = ""
    sse: bool = False  # the url speaks the older SSE transport (the probe found no streamable HTTP)


class ServerFailed(Exception):
    """A server that cannot start or list its tools at the probe: the run cannot offer it."""


def load_config(path: str) -> tuple[Server, ...]:
    """The servers of a Claude Desktop style config; UsageError (one line) for anything wrong in it."""
    try:
        data = orjson.loads(Path(path).read_bytes())
    except (OSError, orjson.JSONDecodeError) as e:
        raise UsageError(f"--mcp_config {path}: {getattr(e, 'strerror', None) or e}")
    entries = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(entries, dict) or not entries:
        raise UsageError(f'--mcp_config {path}: needs a non-empty "mcpServers" object')
    return tuple(_server(path, name, entry) for name, entry in entries.items())


def _server(path: str, name: str, entry: object) -> Server:
    where = f"--mcp_config {path}: server {name!r}"
    if not NAME.fullmatch(name):
        raise UsageError(f"{where}: a name is 1-64 letters, digits, _ or -")
    if name in TOOLSETS:
        raise UsageError(f"{where} has the name of the built-in toolset {name}")
    if not isinstance(entry, dict) or ("command" in entry) == ("url" in entry):
        raise UsageError(f'{where}: needs exactly one of "command" or "url"')
    if unknown := set(entry) - KEYS:
        raise UsageError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    kind = "command" if "command" in entry else "url"
    if "type" in entry and entry["type"] not in TYPES[kind]:
        raise UsageError(f"{where}: type {entry['type']!r} does not go with {kind!r}")
    if kind == "url":
        url = entry["url"]
        if not isinstance(url, str) or not re.match(r"https?://[^/]", url) or set(entry) - {"url", "type"}:
            raise UsageError(f'{where}: "url" must be an http(s) URL, alone')
        return Server(name, url=url, sse=entry.get("type") == "sse")
    command, args, env = entry["command"], entry.get("args", []), entry.get("env", {})
    if not isinstance(command, str) or not command:
        raise UsageError(f'{where}: "command" must be a non-empty string')
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise UsageError(f'{where}: "args" must be a list of strings')
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise UsageError(f'{where}: "env" must map names to strings')
    return Server(name, command, tuple(args), tuple(env.items()))
