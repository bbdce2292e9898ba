"""A missing export, --dry_run, and the spend limits (exports: tests/test_rows_exports.py)."""
from __future__ import annotations

import re

import pytest

from tests.conftest import call, read_jsonl, think, write_jsonl


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
    assert len(server.requests()) == 1 and server.requests()[0]["body"]["max_tokens"] == 1
    assert "25 (0 already done)" in done.stdout and "25 to 275" in done.stdout
    assert "terminal" in done.stdout and "answers" in done.stdout
    assert not (inline.cwd / "data").exists()


def test_dry_run_reports_a_broken_endpoint(inline, scripted_server):
    server = scripted_server({"default": [{"status": 404, "error": "no such model"}]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "p"}])
    done = inline.run(*inline.args(server, dry_run=True))
    assert done.returncode == 1 and "NotFoundError" in done.stdout


@pytest.mark.parametrize("limit", ["max_cost=1.0", "max_total_tokens=60"])
def test_spend_limit_stops_admitting_and_leaves_a_resumable_run(inline, scripted_server, limit):
    # each prompt costs $0.25 and 15 tokens; one conversation at a time makes the stop point exact
    server = scripted_server({"default": [{"content": "x", "reasoning": "r", "usage": {"cost": 0.25}}]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    name, value = limit.split("=")
    done = inline.run(*inline.args(server, num_workers=1, concurrency=1, **{name: value}))
    assert done.returncode == 3, done.stderr
    assert f"--{name}={value} reached" in done.stderr and "--resume" in done.stderr
    assert len(read_jsonl(inline.run_dir() / "trajectories.jsonl")) == 4 and len(server.requests()) == 4
    resumed = inline.run(*inline.args(server, num_workers=1, concurrency=1, resume=True))
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(r["prompt"] for r in server.requests()) == sorted(f"p{i}" for i in range(10))
    assert len(read_jsonl(inline.run_dir() / "trajectories.jsonl")) == 10


@pytest.mark.parametrize("limit", ["max_cost=0.002", "max_total_tokens=30"])
def test_a_spend_limit_stops_within_the_replies_in_flight(inline, scripted_server, limit):
    # 8 prompts of 9 calls (8 tool calls, then the answer), 4 at a time: each reply $0.001 and 15 tokens, so
    # the limit is 2 replies; counted only as prompts land, 4 prompts paid 36 replies before the stop
    server = scripted_server({"default": [*[{**call("terminal", command="echo hi"), "usage": {"cost": 0.001}}] * 8,
                                          {**think(), "usage": {"cost": 0.001}}]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(8)])
    name, value = limit.split("=")
    done = inline.run(*inline.args(server, num_workers=2, concurrency=4, **{name: value}))
    assert done.returncode == 3, done.stderr
    billed = sum(r["status"] == 200 for r in server.requests())
    assert billed <= 2 + 4, f"{billed} replies paid"  # the limit, and at most the 4 calls in flight then
    stated = re.search(r"reached; this invocation paid \$(\d+\.\d{4}), (\d+) tokens", done.stderr)
    assert 0.002 <= float(stated[1]) <= billed * 0.001 and 30 <= int(stated[2]) <= billed * 15


def test_a_spend_limit_closes_the_streams_in_flight_and_the_resume_finishes_them(cli, scripted_server):
    """Reaching --max_cost cancels the prompts in flight at once: their streams close, so a provider
    that bills generated tokens stops generating; the resume runs them again."""
    long = {"content": "y" * 1000, "reasoning": "r", "pieces": 1, "chunk_delay": 0.02}  # 1,000 chunks, 20 s
    server = scripted_server({"default": [{"content": "x", "reasoning": "r", "usage": {"cost": 1.0}}],
                              "prompts": {"long": [long]}})
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": "long"}, {"prompt": "cheap"}])
    done = cli.run(*cli.args(server, num_workers=1, concurrency=2, max_cost=0.5))
    assert done.returncode == 3, done.stderr
    assert "--max_cost=0.5 reached" in done.stderr
    assert server.stats()["stream_events"] < 1000  # the long generation was cut, not waited for
    assert [r["conversations"][1]["value"] for r in read_jsonl(cli.run_dir() / "trajectories.jsonl")] == ["cheap"]
    server.set_script({"default": [{"content": "x", "reasoning": "r"}]})  # the resume need not wait 20 s again
    resumed = cli.run(*cli.args(server, num_workers=1, concurrency=2, resume=True))
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(r["conversations"][1]["value"] for r in read_jsonl(cli.run_dir() / "trajectories.jsonl")) == [
        "cheap", "long"]
