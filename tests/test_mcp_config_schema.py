"""The MCP config's shapes checked by a JSON schema per kind of server, each fault said in one line of its own."""
from __future__ import annotations

import json

import pytest

from trajgen.errors import UsageError
from trajgen.tools import mcp_config


@pytest.mark.parametrize("servers, said", [
    ([], 'needs a non-empty "mcpServers" object'),
    ({}, 'needs a non-empty "mcpServers" object'),
    ({"a": {"command": ""}}, "server 'a': \"command\" must be a non-empty string"),
    ({"a": {"command": "x", "args": ["-m", 3]}}, "server 'a': \"args\" must be a list of strings"),
    ({"a": {"command": "x", "env": {"K": 1}}}, "server 'a': \"env\" must map names to strings"),
    ({"a": {"command": "x", "type": "sse"}}, "server 'a': type 'sse' does not go with 'command'"),
    ({"a": {"url": "http://h/mcp", "type": "stdio"}}, "server 'a': type 'stdio' does not go with 'url'"),
    ({"a": {"url": "http://h/mcp", "env": {}}}, "server 'a': \"url\" must be an http(s) URL, with only \"type\" and"),
    ({"a": {"url": "http://h/mcp", "headers": {"": "v"}}}, "server 'a': \"headers\" must map names to strings"),
])
def test_each_shape_fault_is_one_line_naming_the_server_and_key(tmp_path, servers, said):
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": servers}))
    with pytest.raises(UsageError) as raised:
        mcp_config.load_config(str(path))
    assert str(raised.value).startswith(f"--mcp_config {path}: ") and said in str(raised.value)
    assert "\n" not in str(raised.value)


def test_a_good_config_gives_its_servers(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAJGEN_TEST_TOKEN", "t0k")
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {
        "git": {"command": "uvx", "args": ["mcp-server-git"], "env": {"A": "1"}, "cwd": "/w", "type": "stdio"},
        "docs": {"url": "https://h/sse", "type": "sse",
                 "headers": {"Authorization": "Bearer ${env:TRAJGEN_TEST_TOKEN}"}}}}))
    assert mcp_config.load_config(str(path)) == (
        mcp_config.Server("git", "uvx", ("mcp-server-git",), (("A", "1"),), "/w"),
        mcp_config.Server("docs", url="https://h/sse", sse=True, headers=(("Authorization", "Bearer t0k"),)))
