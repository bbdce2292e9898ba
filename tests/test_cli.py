"""The spine: one run of the real CLI as a subprocess, end to end, and the rest in process
(tests/support/inline.py), against the loopback scripted server."""
from __future__ import annotations

import json

import pytest

from tests.conftest import call, read_jsonl, think, write_jsonl
from toolset_distributions import DISTRIBUTIONS, get_distribution, sample_toolsets
from trajgen import export
from trajgen.errors import UsageError

ROW_KEYS = {"prompt_index", "conversations", "metadata", "completed", "partial", "truncated", "api_calls",
            "toolsets_used", "tool_stats", "tool_error_counts", "tools", "verify", "reward"}


def test_multi_turn_run_writes_the_four_kinds_of_files(cli, scripted_server):
    script = {"prompts": {
        "make a file": [
            call("write_file", path="hello.txt", content="hi there\n"),
            call("terminal", command="cat hello.txt; exit 3"),
            call("read_file", path="missing.txt"),
            {"content": "Done: wrote hello.txt", "reasoning": "all good"},
        ],
    }, "default": [think("plain answer")]}
    server = scripted_server(script)
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": "make a file", "id": "a1"}, {"prompt": "just answer"},
                                            {"prompt": "third"}])
    done = cli.run(*cli.args(server, batch_size=2))
    assert done.returncode == 0, done.stderr
    run_dir = cli.run_dir()
    assert {p.name for p in run_dir.iterdir()} >= {"batch_0.jsonl", "batch_1.jsonl", "checkpoint.json",
                                                   "statistics.json", "trajectories.jsonl"}
    rows = {r["prompt_index"]: r for r in read_jsonl(run_dir / "trajectories.jsonl")}
    assert sorted(rows) == [0, 1, 2]
    row = rows[0]
    assert set(row) == ROW_KEYS
    assert row["metadata"]["id"] == "a1" and row["metadata"]["batch_num"] == 0 and row["metadata"]["model"] == "test-model"
    assert row["completed"] is True and row["partial"] is False and row["api_calls"] == 4
    assert row["toolsets_used"] == ["terminal", "file"]
    convo = row["conversations"]
    assert [t["from"] for t in convo] == ["system", "human", "gpt", "tool", "gpt", "tool", "gpt", "tool", "gpt"]
    assert convo[2]["tool_calls"][0]["name"] == "write_file"
    assert convo[2]["tool_calls"][0]["arguments"] == {"path": "hello.txt", "content": "hi there\n"}
    assert convo[2]["value"].startswith("<think>\nI need a tool\n</think>\n<tool_call>\n")
    # tool results are matched to calls by id, and the terminal really ran in the sandbox
    assert convo[5]["tool_call_id"] == convo[4]["tool_calls"][0]["id"]
    terminal_result = json.loads(convo[5]["value"].removeprefix("<tool_response>\n").removesuffix("\n</tool_response>"))
    assert terminal_result["content"]["exit_code"] == 3 and "hi there" in terminal_result["content"]["output"]
    stats = row["tool_stats"]
    assert stats["write_file"] == {"count": 1, "success": 1, "failure": 0}
    assert stats["terminal"] == {"count": 1, "success": 1, "failure": 0}  # a non-zero exit is a normal result
    assert stats["read_file"] == {"count": 1, "success": 0, "failure": 1}
    assert row["tool_error_counts"]["read_file"] == 1
    # every row lists every tool of the registry, so all rows share one schema
    assert set(rows[1]["tool_stats"]) == set(stats) and rows[1]["tool_stats"]["terminal"]["count"] == 0
    statistics = json.loads((run_dir / "statistics.json").read_text())
    assert statistics["ok"] == 3 and statistics["failed"]["total"] == 0 and statistics["total_batches"] == 2
    assert not any((cli.cwd / "home").iterdir())  # nothing written to the user's home directory
    assert statistics["tool_statistics"]["read_file"]["failure_rate"] == 1.0
    assert statistics["api_calls"] == 6


def test_trajectories_load_with_datasets(inline, scripted_server):
    datasets = pytest.importorskip("datasets")
    server = scripted_server({"default": [call("terminal", command="echo '</tool_call> <think>'"), think("ok")]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(6)])
    assert inline.run(*inline.args(server)).returncode == 0
    loaded = datasets.load_dataset("json", data_files=str(inline.run_dir() / "trajectories.jsonl"), split="train",
                                   cache_dir=str(inline.cwd / "hf-cache"))
    assert len(loaded) == 6
    gpt = loaded[0]["conversations"][2]
    # content containing our own tags cannot break the envelope
    assert gpt["value"].count("<tool_call>") == 1 and gpt["value"].count("</tool_call>") == 1
    tool = loaded[0]["conversations"][3]["value"]
    assert tool.count("</tool_response>") == 1


def test_bad_dataset_lines_stop_the_run_before_any_request(inline, scripted_server):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "good"}, "not json", "[1, 2]", {"text": "no prompt"},
                                            {"prompt": 5}, {"prompt": "  "}])
    done = inline.run(*inline.args(server))
    assert done.returncode == 2
    for line, reason in [(2, "not valid JSON"), (3, "not a JSON object"), (4, "no 'prompt' field"),
                         (5, "non-empty string"), (6, "non-empty string")]:
        assert f"prompts.jsonl:{line}: " in done.stderr and reason in done.stderr
    assert "Traceback" not in done.stderr
    assert not inline.run_dir().exists() and server.requests() == []
    skipped = inline.run(*inline.args(server, skip_invalid=True))
    assert skipped.returncode == 0, skipped.stderr
    assert len(read_jsonl(inline.run_dir() / "trajectories.jsonl")) == 1
    assert json.loads((inline.run_dir() / "statistics.json").read_text())["invalid_lines_skipped"] == 5


def test_usage_errors_exit_2_with_one_line(inline, scripted_server):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "x"}])
    unknown = inline.run(*inline.args(server, distribution="nope"))
    assert unknown.returncode == 2 and "unknown distribution 'nope'" in unknown.stderr and "terminal_only" in unknown.stderr
    missing = inline.run(*inline.args(server, dataset_file="absent.jsonl"))
    assert missing.returncode == 2 and "absent.jsonl: no such file" in missing.stderr
    assert "Traceback" not in unknown.stderr + missing.stderr
    assert not (inline.cwd / "data").exists()


@pytest.mark.parametrize("argv, named, suggested", [
    (["--max_cots=5"], "--max_cots", "--max_cost"),
    (["--maxcost=5"], "--maxcost", "--max_cost"),
    (["--max_total_token=100"], "--max_total_token", "--max_total_tokens"),
    (["--concurency=64"], "--concurency", "--concurrency"),
    (["--resum"], "--resum", "--resume"),
    (["--requre_reasoning=False"], "--requre_reasoning", "--require_reasoning"),
    (["--samples=3"], "--samples", "did you mean --samples_per_prompt?"),  # what is meant, not the nearest spelling
    (["--workers=3"], "--workers", "did you mean --num_workers?"),
    (["--distribution=terminalonly"], "'terminalonly'", "did you mean terminal_only?"),
    (["--toolsets=terminal,git"], "unknown toolset 'git'", "MCP servers need --mcp_config"),
    (["--toolsets=termnial"], "unknown toolset 'termnial'", "did you mean terminal?"),
    (["--export=trl"], "got 'trl'", "did you mean --export=hf?"),  # the format TRL reads
    (["--export=sharegtp"], "got 'sharegtp'", "did you mean --export=sharegpt?"),
    (["prompts.jsonl"], "'prompts.jsonl'", "--dataset_file=prompts.jsonl"),
    (["--concurrency"], "--concurrency", "an integer"),
    (["--concurrency=many"], "--concurrency=many", "an integer"),
    (["--max_cost=abc"], "--max_cost=abc", "a number"),
    (["--resume=maybe"], "--resume=maybe", "true or false"),
    (["--seed=1", "--seed=2"], "--seed", "given twice"),
    (["--num_workers=many"], "--num_workers", "an integer >= 1, or auto with --executor=ray"),
    (["--num_workers=auto"], "--num_workers", "or auto with --executor=ray"),  # the process pool has no auto
])
def test_a_bad_argument_stops_the_run_before_it_spends_anything(inline, scripted_server, argv, named, suggested):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "x"}])
    base = [a for a in inline.args(server) if a.split("=")[0] not in {b.split("=")[0] for b in argv}]
    done = inline.run(*base, *argv)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and suggested in lines[0], done.stderr
    assert server.stats()["requests"] == 0 and not (inline.cwd / "data").exists()


def test_a_misspelled_verdict_of_export_outcome_gets_the_one_meant():
    with pytest.raises(UsageError, match=r"; got pass; did you mean passed\?$"):
        export.outcomes("failed,pass")


def test_both_spellings_and_every_boolean_form_are_accepted(inline, scripted_server):
    server = scripted_server({"default": [{**think(), "usage": {"cost": 0.001}}]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "x"}])
    first = inline.run(*inline.args(server), "--max-cost=100", "--max-total-tokens", "100000", "--noverbose",
                    "--require_reasoning=true")
    assert first.returncode == 0, first.stderr
    again = inline.run(*inline.args(server), "--resume=TRUE")
    assert again.returncode == 0, again.stderr
    assert inline.run(*inline.args(server), "--resume", "--keep_hallucinated").returncode == 0
    assert len(read_jsonl(inline.run_dir() / "trajectories.jsonl")) == 1
    assert server.stats()["requests"] == 2  # the spend limits' probe, then the prompt


def test_fire_gets_every_value_as_the_flags_parser_read_it(inline, scripted_server):
    """Fire calls main with the checked values: a name of digits stays a name, a string that looks
    like a list stays a string, infinity stays a number."""
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "x"}])
    done = inline.run(*inline.args(server, run_name="007"), "--ephemeral_system_prompt=[1, 2]", "--prompt_timeout=inf")
    assert done.returncode == 0, done.stderr
    assert (inline.cwd / "data" / "007" / "trajectories.jsonl").exists()
    assert server.requests()[0]["body"]["messages"][0]["content"].endswith("[1, 2]")


def test_list_distributions_prints_all(inline):
    done = inline.run("--list_distributions")
    assert done.returncode == 0, done.stderr
    for name in DISTRIBUTIONS:
        assert name in done.stdout


def test_help_lists_every_flag(inline):
    done = inline.run("--help", env={"PAGER": "cat"})
    text = done.stdout + done.stderr
    assert done.returncode == 0
    for flag in ("dataset_file", "batch_size", "concurrency", "providers_allowed", "terminal_backend", "max_samples"):
        assert f"--{flag}" in text


def test_list_flags_accept_comma_lists(inline, scripted_server):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "x"}])
    # Fire turns a,b into a tuple; a single name stays a string
    done = inline.run(*inline.args(server, providers_allowed="a,b", providers_order="c", provider_sort="price"))
    assert done.returncode == 0, done.stderr
    body = server.requests()[0]["body"]
    assert body["provider"] == {"only": ["a", "b"], "order": ["c"], "sort": "price"}


def test_a_slow_prompt_does_not_stall_its_batch(inline, scripted_server):
    server = scripted_server({"prompts": {"slow": [{**think("late"), "delay": 4}]}, "default": [think("fast")]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "slow"}] + [{"prompt": f"fast {i}"} for i in range(7)])
    done = inline.run(*inline.args(server, batch_size=8, num_workers=1, concurrency=8))
    assert done.returncode == 0, done.stderr
    order = [r["conversations"][1]["value"] for r in read_jsonl(inline.run_dir() / "batch_0.jsonl")]
    assert order[-1] == "slow" and len(order) == 8  # the seven others landed while it was still running


def test_one_worker_one_conversation_runs_strictly_in_turn(inline, scripted_server):
    server = scripted_server({"default": [{**call("terminal", command="true"), "delay": 0.2}, {**think(), "delay": 0.2}]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(4)])
    assert inline.run(*inline.args(server, num_workers=1, concurrency=1)).returncode == 0
    prompts = [r["prompt"] for r in server.requests()]
    assert prompts == ["p0", "p0", "p1", "p1", "p2", "p2", "p3", "p3"]


def test_failed_prompt_gives_exit_1_and_is_not_a_row(inline, scripted_server):
    server = scripted_server({"prompts": {"bad": [{"status": 400, "error": "bad request"}]}, "default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "bad"}, {"prompt": "good"}])
    done = inline.run(*inline.args(server))
    assert done.returncode == 1
    rows = read_jsonl(inline.run_dir() / "trajectories.jsonl")
    assert [r["conversations"][1]["value"] for r in rows] == ["good"]
    statistics = json.loads((inline.run_dir() / "statistics.json").read_text())
    assert statistics["failed"] == {"total": 1, "by_class": {"BadRequestError": 1}, "attempts": 1,
                                    "tokens": {"prompt": 0, "completion": 0, "reasoning": 0}, "cost": None}


def test_turn_budget_forces_a_final_answer(inline, scripted_server):
    server = scripted_server({"default": [call("terminal", command="echo again")]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "loop forever"}])
    assert inline.run(*inline.args(server, max_turns=2)).returncode == 0
    row = read_jsonl(inline.run_dir() / "trajectories.jsonl")[0]
    assert row["completed"] is False and row["partial"] is True and row["api_calls"] == 3
    last = server.requests()[-1]["body"]
    assert last["tool_choice"] == "none" and last["tools"] and last["messages"][-1]["role"] == "user"


def test_existing_run_directory_is_refused_without_resume(inline, scripted_server):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "x"}])
    assert inline.run(*inline.args(server)).returncode == 0
    again = inline.run(*inline.args(server))
    assert again.returncode == 2 and "--resume" in again.stderr and "--overwrite" in again.stderr
    assert len(server.requests()) == 1
    assert inline.run(*inline.args(server, overwrite=True)).returncode == 0
    assert len(server.requests()) == 2


def test_sampling_is_seeded_per_prompt_and_never_empty():
    dist = get_distribution("browser_tasks")
    draws = [sample_toolsets(dist, 7, f"key-{i}") for i in range(500)]
    assert draws == [sample_toolsets(dist, 7, f"key-{i}") for i in range(500)]
    assert draws != [sample_toolsets(dist, 8, f"key-{i}") for i in range(500)]
    assert all(draws) and ["browser"] in draws and any("terminal" in d for d in draws)
    low = get_distribution("balanced")
    assert all(sample_toolsets(low, s, "k") for s in range(300))


def test_a_rerun_samples_the_same_toolsets(inline, scripted_server):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(12)])
    for name in ("one", "two"):
        assert inline.run(*inline.args(server, run_name=name, distribution="development", seed=3)).returncode == 0
    sampled = [{r["prompt_index"]: r["metadata"]["toolsets_sampled"]
                for r in read_jsonl(inline.run_dir(n) / "trajectories.jsonl")} for n in ("one", "two")]
    assert sampled[0] == sampled[1] and len({tuple(v) for v in sampled[0].values()}) > 1


def test_the_default_distribution_offers_what_can_run_here_and_its_resume_samples_the_same(inline, scripted_server):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "p0"}])
    first = inline.run(*inline.args(server, distribution="default"))
    assert first.returncode == 0, first.stderr
    [said] = [line for line in first.stderr.splitlines() if "leaves out" in line]
    assert said.startswith("note: the default distribution leaves out what cannot run here: ")
    assert "image_gen (no image backend" in said
    assert "toolset image_gen is unavailable" not in first.stderr  # said once, not once per toolset left out
    assert "image_gen" in json.loads((inline.run_dir() / "manifest.json").read_text())["default_left_out"]

    def sampled(run_name: str) -> list[list[str]]:
        return [r["metadata"]["toolsets_sampled"] for r in read_jsonl(inline.run_dir(run_name) / "trajectories.jsonl")]

    assert "image_gen" not in sampled("run")[0] and "terminal" in sampled("run")[0]
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "p0"}, {"prompt": "p1"}])
    can_now = {"FAL_KEY": "fal-key"}  # image_gen can run now: the run it began still leaves it out
    resumed = inline.run(*inline.args(server, distribution="default", resume=True), env=can_now)
    assert resumed.returncode == 0, resumed.stderr
    assert "image_gen (could not run when the run began)" in resumed.stderr
    assert [len(s) for s in sampled("run")] == [len(sampled("run")[0])] * 2 and "image_gen" not in sampled("run")[1]
    fresh = inline.run(*inline.args(server, run_name="fresh", distribution="default"), env=can_now)
    assert fresh.returncode == 0, fresh.stderr
    assert all("image_gen" in s for s in sampled("fresh"))


def test_the_api_key_reaches_neither_the_sandbox_nor_the_run_directory(inline, scripted_server):
    server = scripted_server({"default": [call("terminal", command="env; cat /proc/1/environ | tr '\\0' '\\n'"),
                                          think("done")]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "show env"}])
    done = inline.run(*inline.args(server, api_key="sk-SECRET-FLAG"), env={"OPENROUTER_API_KEY": "sk-SECRET-ENV"})
    assert done.returncode == 0, done.stderr
    assert server.requests()[0]["auth"] == "Bearer sk-SECRET-FLAG"
    row = read_jsonl(inline.run_dir() / "trajectories.jsonl")[0]
    assert "PATH=" in row["conversations"][3]["value"]  # the command really printed its environment
    for path in inline.run_dir().iterdir():
        text = path.read_text()
        assert "sk-SECRET" not in text, path.name
    assert "sk-SECRET" not in done.stdout + done.stderr
