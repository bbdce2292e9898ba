"""Replies are checked where they arrive (trajgen/model.py), and what a prompt paid survives its
failure; in process, against the scripted fake model. No sandbox: the only tool called is one
that was not offered, which never reaches one."""
from __future__ import annotations

import asyncio
import json

import pytest

from trajgen import agent, errors
from trajgen.model import Metered, Reply, ScriptedModel, checked, reply_usage, tool_call
from trajgen.outcome import Status, decide
from trajgen.tools import ToolContext
from trajgen.task import ModelSettings, Task

SETTINGS = ModelSettings(model="fake", base_url="http://127.0.0.1:1/v1", api_key="k", max_turns=3)
TASK = Task(key="key-1", prompt_index=0, batch_num=0, prompt="look it up", image=None, cwd=None, extra={},
            toolsets_sampled=[], toolsets_offered=[])
PAID = {"prompt_tokens": 10, "completion_tokens": 2, "cost": 0.25}


def converse(model) -> agent.Conversation:
    async def no_sandbox():
        raise AssertionError("no tool here needs a sandbox")
    return asyncio.run(agent.run_conversation(TASK.prompt, model, SETTINGS, [], [], ToolContext(sandbox=no_sandbox)))


def calls(*tool_calls) -> dict:
    return {"content": None, "tool_calls": list(tool_calls)}


@pytest.mark.parametrize("message, says", [
    (calls({"id": "a", "type": "function"}), "without a function"),
    (calls({"id": "a", "function": {"arguments": "{}"}}), "function name is missing"),
    (calls({"id": "a", "function": {"name": 5, "arguments": "{}"}}), "function name is not a string"),
    (calls({"id": "a", "function": {"name": "x"}}), "arguments are not a JSON string or object"),
    (calls({"id": 3, "function": {"name": "x", "arguments": "{}"}}), "id is not a string"),
    (calls(tool_call("x", "{}", "a"), tool_call("y", "{}", "a")), "two tool calls with the id 'a'"),
    (calls("lookup"), "without a function"),
    ({"content": None, "tool_calls": {"id": "a"}}, "tool_calls that are not a list"),
    ({"content": [{"type": "text", "text": "hi"}]}, "content that is not text"),
])
def test_a_reply_the_loop_cannot_use_faithfully_is_malformed_and_keeps_its_usage(message, says):
    with pytest.raises(errors.MalformedResponse) as raised:
        checked(message, PAID)
    assert says in str(raised.value) and raised.value.usage == PAID
    assert type(raised.value) is errors.MalformedResponse


@pytest.mark.parametrize("content", [None, "", "  \n"])
def test_an_empty_answer_is_its_own_failure(content):
    with pytest.raises(errors.EmptyAnswer):
        checked({"content": content, "reasoning": "I thought about it"}, PAID)


@pytest.mark.parametrize("usage, says", [("lots", "not an object"), ({"prompt_tokens": "10"}, "prompt_tokens \"10\""),
                                         ({"completion_tokens": -1}, "completion_tokens -1")])
def test_usage_that_is_not_a_count_is_malformed(usage, says):
    with pytest.raises(errors.MalformedResponse, match=says):
        reply_usage(usage)


def test_object_arguments_and_a_missing_id_are_repaired_and_the_row_replays_what_was_sent():
    model = ScriptedModel([
        Reply(calls({"type": "function", "function": {"name": "lookup", "arguments": {"q": "ü", "n": 1}}})),
        Reply({"content": "found", "reasoning": "r"}),
    ])
    conv = converse(model)
    sent = model.requests[1]["messages"]
    assert sent[-2]["tool_calls"] == [{"id": "call_1_0", "type": "function",
                                      "function": {"name": "lookup", "arguments": '{"q":"ü","n":1}'}}]
    assert sent[-1]["tool_call_id"] == "call_1_0"
    assert conv.messages[:len(sent)] == sent  # the transcript the row is made from is what the model saw
    outcome = decide(TASK, row=agent.render_row(TASK, conv, SETTINGS))
    assert outcome.status is Status.OK and b"call_1_0" in outcome.row


def test_a_prompt_that_fails_after_paid_replies_carries_all_it_paid():
    model = Metered(ScriptedModel([Reply(calls(tool_call("lookup", "{}", "a")), PAID),
                                   Reply(calls(tool_call("lookup", "{}", "b"), tool_call("lookup", "{}", "b")), PAID)]))
    with pytest.raises(errors.MalformedResponse) as raised:
        converse(model)
    outcome = decide(TASK, error=raised.value, usage=model.usage)
    assert (outcome.status, outcome.reason, outcome.traceback) == (Status.FAILED, "MalformedResponse", None)
    assert outcome.usage == {"prompt_tokens": 20, "completion_tokens": 4, "reasoning_tokens": 0, "cost": 0.5}


def test_a_row_that_is_not_json_fails_in_the_worker_with_a_named_class():
    conv = converse(ScriptedModel([Reply({"content": "done", "reasoning": "r"}, PAID)]))
    row = agent.render_row(TASK, conv, SETTINGS)
    row["tool_stats"][5] = {"count": 1}  # what a non-string tool name used to make
    outcome = decide(TASK, row=row)
    assert (outcome.status, outcome.reason, outcome.row) == (Status.FAILED, "RowNotSerializable", None)
    assert "Dict key must be str" in outcome.message and outcome.usage["cost"] == 0.25
    good = decide(TASK, row=agent.render_row(TASK, conv, SETTINGS))
    assert json.loads(good.row)["metadata"]["usage"]["cost"] == 0.25 and good.usage["cost"] == 0.25


def test_the_proxy_comes_from_the_environment_and_no_proxy_is_honoured(monkeypatch):
    from trajgen.chat_calls import env_proxy
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
    monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1")
    assert env_proxy("https://openrouter.ai/api/v1/chat/completions") == "http://proxy.internal:3128"
    assert env_proxy("https://127.0.0.1:8000/v1/chat/completions") is None
    assert env_proxy("http://example.org/v1/chat/completions") is None  # no HTTP_PROXY set


def test_null_token_counts_read_as_absent_and_other_non_counts_are_refused():
    assert reply_usage({"prompt_tokens": None, "completion_tokens": 3, "completion_tokens_details": None})["prompt_tokens"] == 0
    with pytest.raises(errors.MalformedResponse):
        reply_usage({"prompt_tokens": "12"})


def test_a_reply_without_token_counts_says_so_and_a_stated_price_costs_a_reply_without_a_cost():
    assert reply_usage(None) == {"prompt_tokens": 0, "completion_tokens": 0, "reasoning_tokens": 0, "cost": None,
                                 "replies_without_usage": 1}
    assert reply_usage({"cost": 0.5}, (1.0, 4.0)) == {**reply_usage(None), "cost": 0.5}
    assert reply_usage(None, (1.0, 4.0))["cost"] is None  # no tokens to price
    assert reply_usage({"prompt_tokens": 1000, "completion_tokens": 500}, (1.0, 4.0))["cost"] == 0.003
    assert reply_usage({"prompt_tokens": 1000, "completion_tokens": 500, "cost": 0.5}, (1.0, 4.0))["cost"] == 0.5
