"""Exports for the training frameworks, --dry_run, and the spend limits."""
from __future__ import annotations

import json

import pytest

from tests.conftest import call, read_jsonl, think, write_jsonl


def _finished_run(cli, server) -> list[dict]:
    write_jsonl(cli.cwd / "prompts.jsonl", [
        {"prompt": "edit", "id": "row-1"},
        {"prompt": "tags", "id": 2},
    ])
    done = cli.run(*cli.args(server, temperature=0.3))
    assert done.returncode == 0, done.stderr
    return read_jsonl(cli.run_dir() / "trajectories.jsonl")


SCRIPT = {"prompts": {
    "edit": [
        {"content": "Let me write <tool_call> text & </think> safely.", "reasoning": "plan </think> it",
         "tool_calls": [{"name": "write_file", "arguments": {"path": "a.txt", "content": "x</tool_response>y"}},
                        {"name": "terminal", "arguments": {"command": "cat a.txt"}}]},
        {"content": "All done.", "reasoning": "check"},
    ],
    "tags": [{"content": "<think>inline</think>final &lt;think> literal"}],
}}


def test_openai_export_round_trips_tool_calls_and_results(cli, scripted_server):
    server = scripted_server(SCRIPT)
    rows = _finished_run(cli, server)
    done = cli.run("--export=openai", "--run_name=run")
    assert done.returncode == 0, done.stderr
    exported = {r["provenance"]["dataset_id"]: r for r in read_jsonl(cli.run_dir() / "export_openai.jsonl")}
    edit = exported["row-1"]["messages"]
    assert [m["role"] for m in edit] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert edit[2]["content"] == "Let me write <tool_call> text & </think> safely."
    assert edit[2]["reasoning_content"] == "plan </think> it"
    # the calls and results are exactly what the model sent and the tools returned, matched by id
    sent = [r["body"]["messages"] for r in server.requests() if r["prompt"] == "edit"][-1]
    def calls(message):
        return [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert calls(edit[2]) == calls(sent[2])
    assert [json.loads(m["content"]) for m in edit[3:5]] == [json.loads(m["content"]) for m in sent[3:5]]
    assert [m["tool_call_id"] for m in edit[3:5]] == [c["id"] for c in sent[2]["tool_calls"]]
    assert json.loads(edit[2]["tool_calls"][0]["function"]["arguments"]) == {"path": "a.txt", "content": "x</tool_response>y"}
    provenance = exported["row-1"]["provenance"]
    assert provenance["model"] == "test-model" and provenance["settings"]["temperature"] == 0.3
    assert provenance["toolsets_sampled"] == ["terminal", "file"] and provenance["prompt_key"]
    assert len(rows) == 2


def test_every_export_loads_with_datasets(cli, scripted_server):
    datasets = pytest.importorskip("datasets")
    _finished_run(cli, scripted_server(SCRIPT))
    for fmt, name, loader in (("sharegpt", "export_sharegpt.jsonl", "json"), ("openai", "export_openai.jsonl", "json"),
                              ("parquet", "export.parquet", "parquet")):
        done = cli.run(f"--export={fmt}", "--run_name=run")
        assert done.returncode == 0, done.stderr
        loaded = datasets.load_dataset(loader, data_files=str(cli.run_dir() / name), split="train",
                                       cache_dir=str(cli.cwd / "hf-cache"))
        assert len(loaded) == 2, fmt
        assert {str(r["provenance"]["dataset_id"] if fmt != "parquet" else r["dataset_id"]) for r in loaded} == {"row-1", "2"}


def test_export_of_a_missing_run_is_a_usage_error(cli):
    done = cli.run("--export=openai", "--run_name=nothing")
    assert done.returncode == 2 and "no finished run" in done.stderr
    bad = cli.run("--export=csv", "--run_name=nothing")
    assert bad.returncode == 2 and "sharegpt, openai, parquet" in bad.stderr


def test_dry_run_sends_one_tiny_request_and_writes_nothing(cli, scripted_server):
    server = scripted_server({"default": [think()]})
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(25)])
    done = cli.run(*cli.args(server, dry_run=True, batch_size=10, distribution="development"))
    assert done.returncode == 0, done.stderr
    assert len(server.requests()) == 1 and server.requests()[0]["body"]["max_tokens"] == 1
    assert "25 (0 already done)" in done.stdout and "25 to 275" in done.stdout
    assert "terminal" in done.stdout and "answers" in done.stdout
    assert not (cli.cwd / "data").exists()


def test_dry_run_reports_a_broken_endpoint(cli, scripted_server):
    server = scripted_server({"default": [{"status": 404, "error": "no such model"}]})
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": "p"}])
    done = cli.run(*cli.args(server, dry_run=True))
    assert done.returncode == 1 and "NotFoundError" in done.stdout


@pytest.mark.parametrize("limit", ["max_cost=1.0", "max_total_tokens=60"])
def test_spend_limit_stops_admitting_and_leaves_a_resumable_run(cli, scripted_server, limit):
    # each prompt costs $0.25 and 15 tokens; one conversation at a time makes the stop point exact
    server = scripted_server({"default": [{"content": "x", "reasoning": "r", "usage": {"cost": 0.25}}]})
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    name, value = limit.split("=")
    done = cli.run(*cli.args(server, num_workers=1, concurrency=1, **{name: value}))
    assert done.returncode == 3, done.stderr
    assert f"--{name}={value} reached" in done.stderr and "--resume" in done.stderr
    assert len(read_jsonl(cli.run_dir() / "trajectories.jsonl")) == 4 and len(server.requests()) == 4
    resumed = cli.run(*cli.args(server, num_workers=1, concurrency=1, resume=True))
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(r["prompt"] for r in server.requests()) == sorted(f"p{i}" for i in range(10))
    assert len(read_jsonl(cli.run_dir() / "trajectories.jsonl")) == 10
