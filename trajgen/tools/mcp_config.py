"""The MCP config: servers in the shape Claude Desktop, Cursor and VS Code use, checked at load (the
shapes by a JSON schema per kind of server, each of its errors said in one line of our own).

Kept apart from trajgen/tools/mcp.py so that reading a config (and --list_distributions) needs
no MCP SDK.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import orjson

from trajgen.distributions import TOOLSETS
from trajgen.errors import UsageError
from trajgen.suggest import did_you_mean

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
KEYS = {"command", "args", "env", "cwd", "url", "type", "headers"}
OAUTH_KEYS = {"auth", "oauth"}  # Cursor's and others' OAuth settings: a sign-in in a browser
ENV_REFERENCE = re.compile(r"\$\{env:([^}]*)\}")  # VS Code's and Cursor's ${env:NAME}
TYPES = {"command": ("stdio",), "url": ("http", "streamable-http", "streamableHttp", "sse")}
CONTAINERS = ("docker", "podman", "nerdctl")  # `docker run -i IMAGE`: a container of its own, which no sandbox starts


@dataclass(frozen=True)
class Server:
    name: str  # its key in the config, and its toolset's name
    command: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None  # the server's working directory (default: the prompt's work dir)
    url: str = ""
    sse: bool = False  # the url speaks the older SSE transport (the probe found no streamable HTTP)
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # sent to a url server; secrets


class ServerFailed(Exception):
    """A server that cannot start or list its tools at the probe: the run cannot offer it."""


STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
CONFIG = jsonschema.Draft202012Validator({
    "type": "object", "required": ["mcpServers"], "properties": {"mcpServers": {"type": "object", "minProperties": 1}}})
SERVERS = {  # by kind; `additionalProperties`: the keys that do not go with it
    "command": jsonschema.Draft202012Validator({
        "type": "object", "additionalProperties": False, "properties": {
            "command": {"type": "string", "minLength": 1}, "args": {"type": "array", "items": {"type": "string"}},
            "env": STRINGS, "cwd": {"type": "string", "minLength": 1}, "type": {"enum": TYPES["command"]}}}),
    "url": jsonschema.Draft202012Validator({
        "type": "object", "additionalProperties": False, "properties": {
            "url": {"type": "string", "pattern": "^https?://[^/]"}, "type": {"enum": TYPES["url"]},
            "headers": STRINGS | {"propertyNames": {"minLength": 1}}}}),
}
SAID = {  # what a schema's error says, by the server's kind and the key at fault ("": a key that does not go)
    ("command", "command"): '"command" must be a non-empty string',
    ("command", "cwd"): '"cwd" must be a non-empty string',
    ("command", "args"): '"args" must be a list of strings',
    ("command", "env"): '"env" must map names to strings',
    ("command", ""): '"headers" go with "url" (a command server gets "env")',
    ("url", "url"): '"url" must be an http(s) URL, with only "type" and "headers" beside it',
    ("url", ""): '"url" must be an http(s) URL, with only "type" and "headers" beside it',
    ("url", "headers"): '"headers" must map names to strings',
}


def load_config(path: str) -> tuple[Server, ...]:
    """The servers of a Claude Desktop style config; UsageError (one line) for anything wrong in it."""
    try:
        data = orjson.loads(Path(path).read_bytes())
    except (OSError, orjson.JSONDecodeError) as e:
        raise UsageError(f"--mcp_config {path}: {getattr(e, 'strerror', None) or e}")
    if not CONFIG.is_valid(data):
        raise UsageError(f'--mcp_config {path}: needs a non-empty "mcpServers" object')
    return tuple(_server(path, name, entry) for name, entry in data["mcpServers"].items())


def _server(path: str, name: str, entry: object) -> Server:
    where = f"--mcp_config {path}: server {name!r}"
    if not NAME.fullmatch(name):
        raise UsageError(f"{where}: a name is 1-64 letters, digits, _ or -")
    if name in TOOLSETS:
        raise UsageError(f"{where} has the name of the built-in toolset {name}")
    if not isinstance(entry, dict):
        raise UsageError(f'{where}: needs an object with "command" or "url"')
    if unknown := set(entry) - KEYS - OAUTH_KEYS:
        raise UsageError(f"{where}: unknown key {min(unknown)!r}{did_you_mean(min(unknown), sorted(KEYS))}")
    if ("command" in entry) == ("url" in entry):
        raise UsageError(f'{where}: needs exactly one of "command" or "url"')
    if oauth := set(entry) & OAUTH_KEYS:
        raise UsageError(f'{where}: OAuth ("{min(oauth)}") needs a sign-in in a browser, which a batch run cannot do; '
                         'pass a token through "headers" instead, e.g. {"Authorization": "Bearer ${env:TOKEN}"}')
    kind = "command" if "command" in entry else "url"
    if error := jsonschema.exceptions.best_match(SERVERS[kind].iter_errors(entry)):
        key = str(error.path[0]) if error.path else ""
        raise UsageError(f"{where}: type {entry['type']!r} does not go with {kind!r}" if key == "type"
                         else f"{where}: {SAID[kind, key]}")
    if kind == "url":
        return Server(name, url=entry["url"], sse=entry.get("type") == "sse",
                      headers=_headers(where, entry.get("headers", {})))
    command = entry["command"]
    if os.path.basename(command) in CONTAINERS:
        raise UsageError(f'{where}: "{command}" starts a container of its own, which a sandbox cannot; run the '
                         "server's own command inside --terminal_backend=docker with --docker_image=IMAGE, "
                         'or serve it over HTTP and give its "url" (docs/mcp.md)')
    return Server(name, command, tuple(entry.get("args", ())), tuple(entry.get("env", {}).items()), entry.get("cwd"))


def _headers(where: str, headers: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The headers with each ${env:NAME} replaced by that variable's value. The values are never
    quoted in an error: they are secrets."""

    def value(key: str, text: str) -> str:
        def variable(match: re.Match) -> str:
            if match[1] not in os.environ:
                raise UsageError(f"{where}: header {key} names ${{env:{match[1]}}}, which is not set")
            return os.environ[match[1]]
        filled = ENV_REFERENCE.sub(variable, text)
        if any(ch in filled for ch in "\r\n\0"):
            raise UsageError(f"{where}: the value of header {key} holds a line break or NUL")
        return filled
    return tuple((key, value(key, text)) for key, text in headers.items())
