"""A missing export, --dry_run, and the spend limits (exports: tests/test_rows_exports.py)."""
from __future__ import annotations

import json
import re
import threading

import pytest

from tests.conftest import read_jsonl, think, write_jsonl
from trajgen import dry_run, store


def prompt_requests(server) -> list[dict]:
    """The server's requests less the probes (a spend limit's before the run, --dry_run's): `ping`."""
    return [r for r in server.requests() if r["prompt"] != "ping"]


def test_export_of_a_missing_run_is_a_usage_error(inline):
    done = inline.run("--export=openai", "--run_name=nothing")
    assert done.returncode == 2 and "no finished run" in done.stderr
    bad = inline.run("--export=csv", "--run_name=nothing")
    assert bad.returncode == 2 and "hf, openai, sharegpt, hermes, parquet" in bad.stderr


def test_dry_run_sends_one_tiny_request_and_writes_nothing(inline, scripted_server):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(25)])
    done = inline.run(*inline.args(server, dry_run=True, batch_size=10, distribution="development"))
    assert done.returncode == 0, done.stderr
    assert len(server.requests()) == 1 and server.requests()[0]["body"]["max_tokens"] == dry_run.PROBE_TOKENS
    assert "25 (0 already done)" in done.stdout and "25 to 275" in done.stdout
    assert "terminal" in done.stdout and "answers" in done.stdout
    assert "│ reasoning        │ in the test reply" in done.stdout, done.stdout
    assert not (inline.cwd / "data").exists()


def test_dry_run_says_when_the_test_reply_has_no_reasoning(inline, scripted_server):
    server = scripted_server({"default": [{"content": "pong"}]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "p"}])
    done = inline.run(*inline.args(server, dry_run=True))
    assert done.returncode == 0, done.stderr
    assert "│ reasoning        │ none in the test reply" in done.stdout, done.stdout
    assert "kept unless --require_reasoning=False" in done.stdout


def test_dry_run_reports_a_broken_endpoint(inline, scripted_server):
    server = scripted_server({"default": [{"status": 404, "error": "no such model"}]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "p"}])
    done = inline.run(*inline.args(server, dry_run=True))
    assert done.returncode == 1 and "answered HTTP 404 (model or endpoint not found)" in done.stderr
    assert "no such model" in done.stderr


@pytest.mark.parametrize("limit", ["max_cost=1.0", "max_total_tokens=60"])
def test_spend_limit_stops_admitting_and_leaves_a_resumable_run(inline, scripted_server, limit):
    # each prompt costs $0.25 and 15 tokens; one conversation at a time makes the stop point exact
    server = scripted_server({"default": [{"content": "x", "reasoning": "r", "usage": {"cost": 0.25}}]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    name, value = limit.split("=")
    done = inline.run(*inline.args(server, num_workers=1, concurrency=1, **{name: value}))
    assert done.returncode == 3, done.stderr
    assert f"--{name}={value} reached" in done.stderr and "--resume" in done.stderr
    assert len(read_jsonl(inline.run_dir() / "trajectories.jsonl")) == 4 and len(prompt_requests(server)) == 4
    resumed = inline.run(*inline.args(server, num_workers=1, concurrency=1, resume=True))
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(r["prompt"] for r in prompt_requests(server)) == sorted(f"p{i}" for i in range(10))
    assert len(read_jsonl(inline.run_dir() / "trajectories.jsonl")) == 10


def gated_calls(gate: str) -> list[dict]:
    """9 calls, each $0.001 and 15 tokens: 8 turns that call a tool (one not offered: no sandbox to wait for),
    then the answer; every turn but the first is held until `gate` opens."""
    turn = {"tool_calls": [{"name": "no_such_tool", "arguments": {}}], "reasoning": "r", "usage": {"cost": 0.001}}
    return [turn, *[{**turn, "gate": gate}] * 7, {**think(), "usage": {"cost": 0.001}, "gate": gate}]


def replies_sent(server, probes: int = 1) -> int:
    """Replies the server sent whole (3 events each: the message, the usage, [DONE]), less the probes."""
    return server.stats()["stream_events"] // 3 - probes


@pytest.mark.parametrize("limit", ["max_cost=0.002", "max_total_tokens=30"])
def test_a_spend_limit_stops_within_the_replies_in_flight(inline, scripted_server, limit):
    # 8 prompts of 9 calls, 4 at a time, the limit 2 replies: counted as replies arrive, the first turns'
    # replies stop the run and the later calls are cancelled unanswered. Counted as prompts land, none landed:
    # the run waited for the held turns (opened after a minute, it then paid all 36 replies)
    server = scripted_server({"default": gated_calls("later")})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(8)])
    name, value = limit.split("=")
    failing = threading.Timer(60, server.open_gate, ["later"])  # a run that does not stop still ends
    failing.start()
    try:
        done = inline.run(*inline.args(server, num_workers=2, concurrency=4, **{name: value}))
    finally:
        failing.cancel()
    assert done.returncode == 3, done.stderr
    assert replies_sent(server) <= 2 + 4  # the limit, and at most the 4 calls in flight then
    stated = re.search(r"reached; this invocation paid \$(\d+\.\d{4}), (\d+) tokens", done.stderr)
    # a reply sent as its call was cancelled is paid and not received: the runner cannot count it
    assert 0.002 <= float(stated[1]) <= 0.001 * replies_sent(server) and 30 <= int(stated[2]) <= 15 * replies_sent(server)


def test_a_spend_limit_closes_the_streams_in_flight_and_the_resume_finishes_them(inline, scripted_server):
    """Reaching --max_cost cancels the prompts in flight at once: their streams close, so a provider
    that bills generated tokens stops generating; the resume runs them again."""
    long = {"content": "y" * 1000, "reasoning": "r", "pieces": 1, "chunk_delay": 0.02}  # 1,000 chunks, 20 s
    server = scripted_server({"default": [{"content": "x", "reasoning": "r", "usage": {"cost": 1.0}}],
                              "prompts": {"long": [long]}})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "long"}, {"prompt": "cheap"}])
    done = inline.run(*inline.args(server, num_workers=1, concurrency=2, max_cost=0.5))
    assert done.returncode == 3, done.stderr
    assert "--max_cost=0.5 reached" in done.stderr
    assert server.stats()["stream_events"] < 1000  # the long generation was cut, not waited for
    assert [r["conversations"][1]["value"] for r in read_jsonl(inline.run_dir() / "trajectories.jsonl")] == ["cheap"]
    server.set_script({"default": [{"content": "x", "reasoning": "r"}]})  # the resume need not wait 20 s again
    resumed = inline.run(*inline.args(server, num_workers=1, concurrency=2, resume=True))
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(r["conversations"][1]["value"] for r in read_jsonl(inline.run_dir() / "trajectories.jsonl")) == [
        "cheap", "long"]


def test_max_cost_against_an_endpoint_that_reports_no_cost_is_refused_before_any_prompt(inline, scripted_server):
    server = scripted_server({"default": [think()]})  # usage with tokens, no cost: as vLLM and OpenAI send it
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    for flags in ({}, {"dry_run": True}):
        done = inline.run(*inline.args(server, max_cost=1.0, **flags))
        assert done.returncode == 2, done.stderr
        said = done.stderr.strip().splitlines()[-1]
        assert said.startswith("error: --max_cost: the endpoint reports no cost") and "--price_per_mtok" in said
    assert prompt_requests(server) == [] and not store.entries(inline.run_dir())  # the lock only, as a usage error
    # at a stated price ($1,000 and $2,000 per million: 10 and 5 tokens, $0.02 a reply), the limit applies
    done = inline.run(*inline.args(server, num_workers=1, concurrency=1, max_cost=0.05, price_per_mtok="1000,2000"))
    assert done.returncode == 3, done.stderr
    assert "--max_cost=0.05 reached; this invocation paid $0.0600" in done.stderr
    statistics = json.loads((inline.run_dir() / "statistics.json").read_text())
    assert statistics["cost"] == 0.06 and len(prompt_requests(server)) == 3


# a complete reply that carries no usage at all
WITHOUT_USAGE = {"body": {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "x", "reasoning": "r"}, "finish_reason": "stop"}]}}


def test_tokens_a_reply_did_not_report_are_unknown_not_zero(inline, scripted_server):
    server = scripted_server({"default": [WITHOUT_USAGE]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(2)])
    for limit in ({"max_total_tokens": 100}, {"max_cost": 1.0, "price_per_mtok": "1"}):
        refused = inline.run(*inline.args(server, **limit))
        assert refused.returncode == 2 and "the endpoint's replies carry no" in refused.stderr, refused.stderr
    assert prompt_requests(server) == []
    done = inline.run(*inline.args(server))
    assert done.returncode == 0, done.stderr
    assert [r["metadata"]["usage"]["replies_without_usage"] for r in read_jsonl(
        inline.run_dir() / "trajectories.jsonl")] == [1, 1]
    statistics = json.loads((inline.run_dir() / "statistics.json").read_text())
    assert statistics["tokens"] == {"prompt": None, "completion": None, "reasoning": None, "replies_without_usage": 2}
    assert re.search(r"tokens prompt / completion / reasoning\s+│\s+n/a \(2 replies without usage\)", done.stdout)
