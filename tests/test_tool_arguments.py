"""A tool call's arguments checked against the tool's own JSON schema before the tool runs (registry.dispatch)."""
from __future__ import annotations

import orjson

from trajgen.registry import REGISTRY, dispatch
from trajgen.tools import ToolContext, ToolSpec
from tests.conftest import arun


async def _no_sandbox():
    raise AssertionError("a refused call must not reach the sandbox")


def _recording(schema: dict) -> tuple[dict[str, ToolSpec], list[dict]]:
    """A tool that records what it was called with, under `schema`."""
    calls: list[dict] = []

    async def fn(ctx, /, **arguments) -> dict:
        calls.append(arguments)
        return {"success": True, "error": None}

    return {"t": ToolSpec("t", "test", "", schema, fn)}, calls


def test_arguments_that_break_the_schema_come_back_to_the_model_naming_the_argument():
    ctx, offered = ToolContext(sandbox=_no_sandbox), {name: REGISTRY[name] for name in ("read_file", "terminal")}
    said = {arguments: arun(dispatch(tool, arguments, offered, ctx)) for tool, arguments in [
        ("read_file", '{"path": 3}'), ("read_file", '{"path": "a", "limit": "5"}'),
        ("read_file", '{"path": "a", "offset": 0}'), ("read_file", '{"path": "a", "limit": 5.0}'),
        ("read_file", '{"path": "a", "limit": true}'), ("read_file", '{}'),
        ("terminal", '{"command": "ls", "cwd": "/"}')]}
    assert {a: r["error"] for a, r in said.items()} == {
        '{"path": 3}': "bad arguments for read_file: `path`: 3 is not of type 'string'",
        '{"path": "a", "limit": "5"}': "bad arguments for read_file: `limit`: '5' is not of type 'integer'",
        '{"path": "a", "offset": 0}': "bad arguments for read_file: `offset`: 0 is less than the minimum of 1",
        '{"path": "a", "limit": 5.0}': "bad arguments for read_file: `limit`: 5.0 is not of type 'integer'",
        '{"path": "a", "limit": true}': "bad arguments for read_file: `limit`: True is not of type 'integer'",
        '{}': "bad arguments for read_file: 'path' is a required property",
        '{"command": "ls", "cwd": "/"}': "bad arguments for terminal: Additional properties are not allowed "
                                         "('cwd' was unexpected)"}
    assert all(r == {"success": False, "error": r["error"]} for r in said.values())


def test_an_optional_argument_sent_as_null_is_left_out_and_a_required_one_is_refused():
    offered, calls = _recording({"type": "object", "properties": {"a": {"type": "string"}, "n": {"type": "integer"}},
                                 "required": ["a"], "additionalProperties": False})
    ctx = ToolContext(sandbox=_no_sandbox)
    assert arun(dispatch("t", orjson.dumps({"a": "x", "n": None}).decode(), offered, ctx))["success"] is True
    refused = arun(dispatch("t", orjson.dumps({"a": None}).decode(), offered, ctx))
    assert refused == {"success": False, "error": "bad arguments for t: `a`: None is not of type 'string'"}
    assert calls == [{"a": "x"}]


def test_nested_arguments_are_named_by_their_path_and_a_schema_that_is_not_one_checks_nothing():
    urls = {"type": "array", "items": {"type": "string"}}
    offered, calls = _recording({"type": "object", "properties": {"urls": urls}})
    ctx = ToolContext(sandbox=_no_sandbox)
    nested = arun(dispatch("t", '{"urls": ["a", 3]}', offered, ctx))
    assert nested["error"] == "bad arguments for t: `urls[1]`: 3 is not of type 'string'"
    unreadable, calls_there = _recording({"type": "object", "properties": {"a": {"type": "strin"}}})  # a server's slip
    assert arun(dispatch("t", '{"a": 1}', unreadable, ctx))["success"] is True and calls_there == [{"a": 1}]
    assert calls == []
