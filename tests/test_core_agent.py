"""The agent loop in process, against the scripted fake model and a real local sandbox."""
from __future__ import annotations

import json

import pytest

import model_tools
from tests.conftest import arun
from trajgen import agent, errors
from trajgen.conventions import openai
from trajgen.model import Reply, ScriptedModel, tool_call
from trajgen.outcome import Status, decide
from trajgen.sandbox.backends import SandboxConfig, bwrap_problem, cleanup, open_sandbox
from trajgen.tools import ToolContext
from trajgen.task import ModelSettings, Task

SETTINGS = ModelSettings(model="fake", base_url="http://127.0.0.1:1/v1", api_key="k", max_turns=2,
                         system_prompt="SYSTEM", ephemeral_system_prompt="STEER",
                         prefill_messages=[{"role": "user", "content": "PREFILL"}])
TASK = Task(key="key-1", prompt_index=0, batch_num=0, prompt="make a file", image=None, cwd=None, extra={"id": "a"},
            toolsets_sampled=["terminal", "file"], toolsets_offered=["terminal", "file"])
TOOLS = model_tools.offered_tools(["terminal", "file"], {})


@pytest.fixture
def ctx(tmp_path):
    if bwrap_problem():
        pytest.skip(f"bubblewrap cannot run here: {bwrap_problem()}")
    config = SandboxConfig(root_dir=str(tmp_path / "sb"))
    sandbox = open_sandbox(config, "p1")

    async def get():
        return sandbox

    yield ToolContext(sandbox=get)
    arun(sandbox.close())
    cleanup(config)


def converse(model: ScriptedModel, ctx: ToolContext, settings: ModelSettings = SETTINGS) -> agent.Conversation:
    return arun(agent.run_conversation(TASK.prompt, model, settings, TOOLS, [t.schema() for t in TOOLS], ctx))


def test_tools_run_in_the_sandbox_and_the_row_keeps_what_was_sent(ctx):
    model = ScriptedModel([
        Reply({"content": "", "reasoning": "write it",
               "tool_calls": [tool_call("write_file", json.dumps({"path": "a.txt", "content": "hi"}), "c1"),
                              tool_call("terminal", json.dumps({"command": "cat a.txt"}))]},
              {"prompt_tokens": 10, "completion_tokens": 2, "cost": 0.5}),
        Reply({"content": "<think>done</think>It says hi."}, {"prompt_tokens": 20, "completion_tokens": 3}),
    ])
    conv = converse(model, ctx)
    assert conv.completed and len(model.requests) == 2
    sent = model.requests[1]["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "user", "assistant", "tool", "tool"]
    assert sent[0]["content"] == "SYSTEM\n\nSTEER" and sent[4]["tool_call_id"] == "c1"
    assert sent[5]["tool_call_id"] == "call_1_1" and "hi" in sent[5]["content"]
    row = agent.render_row(TASK, conv, SETTINGS)
    text = json.dumps(row)
    assert "STEER" not in text and "PREFILL" not in text
    assert [t["from"] for t in row["conversations"]] == ["system", "human", "gpt", "tool", "tool", "gpt"]
    assert row["conversations"][2]["value"].startswith("<think>\nwrite it\n</think>")
    assert row["metadata"]["turns_with_reasoning"] == 2 and row["metadata"]["hallucinated_tools"] == []
    assert row["metadata"]["usage"] | {"wall_seconds": 0} == {
        "prompt_tokens": 30, "completion_tokens": 5, "reasoning_tokens": 0, "cost": 0.5, "api_calls": 2,
        "wall_seconds": 0, "replayed": 0, "stalls": 0}
    assert row["tool_stats"]["write_file"] == row["tool_stats"]["terminal"] == {"count": 1, "success": 1, "failure": 0}
    assert decide(TASK, row=row).status is Status.OK
    # the exact parts: the export replays the last request (minus what is never written) and the reply
    messages = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in openai.messages(row)]
    assert messages[:-1] == [{"role": "system", "content": "SYSTEM"}, *sent[2:]]
    assert messages[-1] == {"role": "assistant", "content": "<think>done</think>It says hi."}
    assert row["tools"] == model.requests[1]["tools"] and row["conversations"][2]["reasoning"] == "write it"


def test_the_turn_budget_forces_a_final_call_that_forbids_tools(ctx):
    again = Reply({"content": "more", "tool_calls": [tool_call("terminal", json.dumps({"command": "true"}))]})
    model = ScriptedModel([again, again, again])
    conv = converse(model, ctx)
    assert [r["forbid_tools"] for r in model.requests] == [False, False, True]
    assert model.requests[2]["messages"][-1]["content"] == agent.FINAL_ANSWER_REQUEST
    assert not conv.completed and "tool_calls" not in conv.messages[-1]
    row = agent.render_row(TASK, conv, SETTINGS)
    assert row["partial"] and row["api_calls"] == 3 and row["tool_stats"]["terminal"]["count"] == 2
    assert decide(TASK, row=row).status is Status.OK  # without reasoning: --require_reasoning acts at the merge


def test_a_tool_that_was_not_offered_fails_and_is_named(ctx):
    model = ScriptedModel([Reply({"content": "", "tool_calls": [tool_call("web_search", "{}", "w")]}),
                           Reply({"content": "ok", "reasoning": "r"})])
    row = agent.render_row(TASK, converse(model, ctx), SETTINGS)
    assert row["metadata"]["hallucinated_tools"] == ["web_search"]
    assert row["tool_stats"]["web_search"] == {"count": 1, "success": 0, "failure": 1}
    assert "unknown tool" in row["conversations"][-2]["value"]


def test_errors_become_failed_outcomes_with_a_traceback_only_when_unforeseen(ctx):
    with pytest.raises(ZeroDivisionError) as raised:
        converse(ScriptedModel([ZeroDivisionError("boom")]), ctx)
    unforeseen = decide(TASK, error=raised.value)
    assert unforeseen.status is Status.FAILED and unforeseen.reason == "InternalError"  # never a Python internal
    assert "Traceback" in unforeseen.traceback and unforeseen.message == "ZeroDivisionError: boom"
    timeout = decide(TASK, error=errors.PromptTimeout("prompt ran past --prompt_timeout=1s"))
    assert (timeout.reason, timeout.traceback) == ("PromptTimeout", None)
    api = decide(TASK, error=errors.APIConnectionError())
    assert api.reason == "APIConnectionError" and api.traceback is None


def test_a_tool_call_cut_by_the_token_limit_is_never_run_and_its_row_is_discarded_as_truncated():
    """finish_reason `length` in the middle of a tool call: its arguments may be cut short, so it is
    not run (no sandbox is ever asked for), and the row says so; nobody trains on it."""
    async def no_sandbox():
        raise AssertionError("a truncated tool call reached the sandbox")

    cut = Reply({"content": "", "reasoning": "write it",
                 "tool_calls": [tool_call("terminal", '{"command": "rm -rf /tmp/x && echo do', "c1")]},
                {"prompt_tokens": 10, "completion_tokens": 64}, finish_reason="length")
    model = ScriptedModel([Reply({"content": "", "reasoning": "r", "tool_calls": [tool_call("web_search", "{}", "w")]},
                                 finish_reason="tool_calls"), cut])
    conv = converse(model, ToolContext(sandbox=no_sandbox))
    assert conv.truncated and not conv.completed and len(model.requests) == 2
    assert [c["function"]["name"] for c in conv.messages[-1]["tool_calls"]] == ["terminal"]
    assert len(conv.results) == 1  # the first turn's call (not offered: it fails without a sandbox), not the cut one
    row = agent.render_row(TASK, conv, SETTINGS)
    assert (row["truncated"], row["completed"], row["partial"]) == (True, False, False)
    assert row["metadata"]["finish_reasons"] == ["tool_calls", "length"]
    assert row["conversations"][-1]["tool_calls"][0]["arguments"] == {
        "_raw": '{"command": "rm -rf /tmp/x && echo do'}
    outcome = decide(TASK, row=row)
    assert (outcome.status, outcome.reason) == (Status.DISCARDED, "truncated")
    assert outcome.usage["completion_tokens"] == 64 and json.loads(outcome.row)["truncated"]


def test_a_reply_cut_by_the_token_limit_without_tool_calls_completes():
    """A cut answer has no call to run: the conversation ends as completed, its finish reason in the row."""
    conv = converse(ScriptedModel([Reply({"content": "The answer is", "reasoning": "r"}, finish_reason="length")]),
                    ToolContext(sandbox=lambda: None))
    row = agent.render_row(TASK, conv, SETTINGS)
    assert conv.completed and not row["truncated"] and row["metadata"]["finish_reasons"] == ["length"]
    assert decide(TASK, row=row).status is Status.OK
