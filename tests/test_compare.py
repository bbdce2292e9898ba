"""Comparing models: the statistics against hand computations, a --models run of two models the
scripted server answers differently (in process: tests/support/inline.py), --compare over
overlapping datasets (by the real CLI), a --models run of the real CLI killed with -9 and resumed,
--models stopped in any of its models and resumed by the command it printed (in process, and the
real CLI's Ctrl-C), spend limits over the whole invocation, and comparison.html and the comparison
viewer in Chromium."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time

import pytest

from tests.conftest import CLI, call, kill_group, read_jsonl, think, write_jsonl
from tests.support.inline import ROOT, Inline, when
from tests.test_guard_rails import prompt_requests
from trajgen import compare, dataset, modes
from trajgen.errors import UsageError
from trajgen.options import RunOptions
from tests.support.scripted_server import start_server

ANSWER_IS_42 = 'test "$(cat .trajgen/final_answer.txt)" = 42'
HOSTILE = ' <img src=x onerror="window.pwned = 1"> <script>window.pwned = 2</script>'
PROMPTS = [f"task {i}" + (HOSTILE if i == 9 else "") for i in range(12)]
GOOD = set(range(9))  # the prompts model "good" answers right
BAD = {0, 1, 2, 9}  # and model "bad": both 3, only good 6, only bad 1, neither 2


def _answers(right: set[int], prompts: list[str]) -> dict:
    return {"prompts": {p: [call("terminal", command="echo hi"), think("42" if i in right else "7")]
                        for i, p in enumerate(prompts)}, "default": [think("7")]}


SCRIPT = {"models": {"good": _answers(GOOD, PROMPTS), "bad": _answers(BAD, PROMPTS)}, "default": [think("7")]}


def _bounds(interval: compare.Interval) -> tuple[float, float]:
    return interval.low, interval.high


def test_wilson_intervals_against_hand_computations():
    # p = 7/10, z = 1.95996: centre (0.7 + z²/20) / (1 + z²/10) = 0.64449, half-width 0.24771
    assert _bounds(compare.wilson(7, 10)) == pytest.approx((0.39678, 0.89221), abs=1e-5)
    assert _bounds(compare.wilson(9, 12)) == pytest.approx((0.46769, 0.91106), abs=1e-5)
    assert _bounds(compare.wilson(0, 10)) == pytest.approx((0.0, 0.27753), abs=1e-5)
    assert _bounds(compare.wilson(10, 10)) == pytest.approx((0.72247, 1.0), abs=1e-5)
    assert compare.wilson(0, 0) is None


def test_exact_mcnemar_against_hand_computations():
    assert compare.mcnemar_exact(6, 1) == 2 * (1 + 7) / 2 ** 7  # 0.125
    assert compare.mcnemar_exact(1, 9) == 2 * (1 + 10) / 2 ** 10
    assert compare.mcnemar_exact(0, 6) == 2 / 2 ** 6
    assert compare.mcnemar_exact(5, 5) == 1.0  # the two tails overlap: capped
    assert compare.mcnemar_exact(0, 0) == 1.0


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """`--models=good,bad` over PROMPTS, two samples each, in process: (Inline, its output)."""
    inline = Inline(tmp_path_factory.mktemp("compare"))
    server = start_server(SCRIPT)
    try:
        write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": p, "verify": ANSWER_IS_42} for p in PROMPTS])
        done = inline.run(*inline.args(server, run_name="eval", model=None, models="good,bad", samples_per_prompt=2,
                                       distribution="balanced"), env={"COLUMNS": "200"})
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr
    return inline, done


def _rows(run_dir) -> list[dict]:
    return [r for p in sorted(run_dir.glob("batch_*.jsonl")) for r in read_jsonl(p)]


def test_models_run_each_model_in_its_own_directory_with_the_same_toolsets(made):
    inline, _ = made
    parent = inline.run_dir("eval")
    toolsets = {}
    for model in ("good", "bad"):
        assert json.loads((parent / model / "manifest.json").read_text())["model"] == model
        rows = _rows(parent / model)
        assert len(rows) == 24 and {r["metadata"]["model"] for r in rows} == {model}
        toolsets[model] = {r["metadata"]["prompt_key"]: r["metadata"]["toolsets_sampled"] for r in rows}
    assert toolsets["good"] == toolsets["bad"]
    assert len({tuple(t) for t in toolsets["good"].values()}) > 1  # sampled, not the same for every prompt


def test_models_run_writes_the_comparison_with_hand_checked_figures(made):
    inline, done = made
    found = json.loads((inline.run_dir("eval") / "comparison.json").read_text())
    good, bad = found["runs"]
    assert (good["model"], bad["model"], found["shared_prompts"]) == ("good", "bad", 12)
    assert good["pass_rate_prompts"] == {"passed": 9, "of": 12, "rate": 0.75, "ci95": [0.4677, 0.9111]}
    assert good["pass_rate_samples"] == {"passed": 18, "of": 24, "rate": 0.75, "ci95": [0.551, 0.88]}
    assert bad["pass_rate_prompts"] == {"passed": 4, "of": 12, "rate": 0.3333, "ci95": [0.1381, 0.6094]}
    assert good["pass_at_k"] == {"1": {"rate": 0.75, "prompts": 12}, "2": {"rate": 0.75, "prompts": 12}}
    assert good["served_by"] == {"good": 24} and good["samples"] == {"ok": 24, "total": 24}
    assert (good["mean_turns"], good["mean_tool_calls"]) == (2.0, 1.0)
    assert good["tokens"] == {"prompt": 480, "completion": 240, "reasoning": 0}
    assert good["cost"] is None and {k: v["replies"] for k, v in good["latency"].items()} == {
        "first_byte": 48, "first_token": 48, "generation": 48}  # each sample's two replies
    pair = found["pairs"][0]
    assert {k: pair[k] for k in ("outcome", "both", "only_a", "only_b", "neither", "p_value")} == {
        "outcome": "passed", "both": 3, "only_a": 6, "only_b": 1, "neither": 2, "p_value": 0.125}
    assert sorted(d["preview"] for d in pair["discordant"]) == sorted(PROMPTS[i] for i in GOOD ^ BAD)
    for d in pair["discordant"]:  # each run's record: the winner's passed sample, the loser's first
        winner, loser = (d["a"], d["b"]) if d["solved_by"] == "a" else (d["b"], d["a"])
        assert winner["verdict"] == "passed" and loser["verdict"] == "failed" and loser["key"] == d["prompt_key"]
        run_dir = inline.run_dir("eval") / ("good" if d["solved_by"] == "a" else "bad")
        line = (run_dir / winner["file"]).read_text().splitlines()[winner["line"] - 1]
        assert json.loads(line)["metadata"]["prompt_key"] == winner["key"]
    assert found["settings_that_differ"] == {"model": ["good", "bad"]} and found["warnings"] == []
    table = done.stdout[done.stdout.index("Comparison over 12 shared prompts"):]
    assert re.search(r"pass rate, prompts \[95% CI\]\s*│\s*75\.0% \[46\.8, 91\.1\] of 12\s*│\s*33\.3% \[13\.8, 60\.9\] of 12", table)
    assert re.search(r"exact McNemar p-value\s*│\s*0\.125", table)
    assert (inline.run_dir("eval") / "comparison.html").exists()


def test_compare_over_overlapping_datasets_uses_the_shared_prompts_and_warns(made):
    inline, _ = made
    server = start_server({"models": {"good": _answers(GOOD, PROMPTS)}, "default": [think("7")]})
    try:
        extra = [f"new task {i}" for i in range(6)]
        write_jsonl(inline.cwd / "other.jsonl", [{"prompt": p, "verify": ANSWER_IS_42} for p in PROMPTS[6:] + extra])
        done = inline.run(*inline.args(server, run_name="other", dataset_file="other.jsonl", model="good", max_turns=5,
                                 distribution="balanced"))
        assert done.returncode == 0, done.stderr
    finally:
        server.stop()
    done = CLI(inline.cwd).run("--compare=data/eval/bad,data/other", "--compare_out=out", env={"COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    found = json.loads((inline.cwd / "out" / "comparison.json").read_text())
    assert found["shared_prompts"] == 6 and [r["prompts_in_run"] for r in found["runs"]] == [12, 12]
    assert found["runs"][1]["pass_rate_prompts"]["passed"] == 3  # task 6, 7, 8 of the shared ones
    assert found["settings_that_differ"] == {"model": ["bad", "good"], "max_turns": [10, 5]}
    assert any("share 6 prompts" in w for w in found["warnings"])
    assert any(w.startswith("max_turns differs") for w in found["warnings"])
    assert any(w.startswith("samples per prompt differ (bad (data/eval/bad): 2, good (data/other): 1)") for w in found["warnings"])
    assert "max_turns differs" in done.stderr
    pair = found["pairs"][0]  # bad passes task 9 only; good passes task 6, 7, 8
    assert (pair["both"], pair["only_a"], pair["only_b"], pair["neither"]) == (0, 1, 3, 2)
    assert pair["p_value"] == 2 * (1 + 4) / 2 ** 4
    assert (inline.cwd / "out" / "comparison.html").exists()


def test_without_verdicts_the_pair_compares_completion_with_no_p_value(tmp_path):
    """Two hand-made run directories, no verify command anywhere: completion is compared, no test."""
    for name, kept in (("a", ["k1-0", "k2-0"]), ("b", ["k1-0"])):
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / "manifest.json").write_text(json.dumps({"model": name, "max_turns": 10}))
        write_jsonl(run_dir / "batch_0.jsonl", [{"prompt_index": i, "metadata": {"prompt_key": k, "model": name,
                                                                              "hallucinated_tools": ["x", "y"][:i + 1]},
                                                 "conversations": [{"from": "human", "value": k}]}
                                                for i, k in enumerate(kept)])
        if name == "b":
            write_jsonl(run_dir / "failures.jsonl", [{"prompt_key": "k2-0", "error_class": "APIError"}])
            (run_dir / "statistics.json").write_text(json.dumps({"latency": {
                "first_token": {"replies": 2, "median": 0.5, "p95": 1.25},
                "generation": {"replies": 0, "median": None, "p95": None}}, "ok": 1}))
    found, _ = compare.compare([tmp_path / "a", tmp_path / "b"])
    pair = found["pairs"][0]
    assert pair["outcome"] == "completed" and pair["p_value"] is None and "nothing was verified" in pair["note"]
    assert (pair["both"], pair["only_a"], pair["only_b"], pair["neither"]) == (1, 1, 0, 0)
    assert found["runs"][1]["samples"] == {"ok": 1, "failed": 1, "total": 2}
    assert found["runs"][0]["pass_rate_prompts"]["rate"] is None
    assert found["runs"][0]["latency"] is None
    assert (found["runs"][0]["samples_with_hallucinated_tools"], found["runs"][0]["hallucinated_tool_names"]) == (2, 3)
    assert found["runs"][1]["latency"] == {"first_token": {"replies": 2, "median": 0.5, "p95": 1.25}}


def test_two_runs_of_one_long_named_model_are_told_apart_and_never_cut(inline):
    """At 80 columns: the runs numbered, each named whole by its directory and model, pairs by directory;
    first-token latency read from each run's statistics.json."""
    model = "Qwen/Qwen3-8B-with-a-name-longer-than-any-column-of-the-table"
    for name, median in (("first", 0.25), ("second", 0.75)):
        run_dir = inline.cwd / "data" / name / "run"
        run_dir.mkdir(parents=True)
        (run_dir / "manifest.json").write_text(json.dumps({"model": model}))
        (run_dir / "statistics.json").write_text(json.dumps({"latency": {
            "first_token": {"replies": 3, "median": median, "p95": 1.5}}}))
        write_jsonl(run_dir / "batch_0.jsonl", [{"prompt_index": 0, "metadata": {"prompt_key": "k1-0", "model": model},
                                                 "conversations": [{"from": "human", "value": "hi"}]}])
    done = inline.run("--compare=data/first/run,data/second/run", "--compare_out=out", env={"COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    assert "…" not in done.stdout
    lines = done.stdout.splitlines()
    assert f"0: data/first/run (model {model})" in lines and f"1: data/second/run (model {model})" in lines
    assert "A = 0: data/first/run vs B = 1: data/second/run" in lines
    assert "0.25 s / 1.50 s" in done.stdout and "0.75 s / 1.50 s" in done.stdout  # first token, median / p95
    found = json.loads((inline.cwd / "out" / "comparison.json").read_text())
    assert found["runs"][1]["latency"] == {"first_token": {"replies": 3, "median": 0.75, "p95": 1.5}}
    assert "A = 0: data/first/run vs B = 1: data/second/run" in (inline.cwd / "out" / "comparison.html").read_text()


@pytest.mark.parametrize("flags, message", [
    ({"compare": "nowhere,elsewhere"}, "no such run directory"),
    ({"compare": "."}, "two or more run directories"),
    ({"compare": ".", "models": "a,b"}, "give one of them"),
    ({"models": "one"}, "two or more different models"),
    ({"models": "a/b,a_b"}, "share a directory name"),
    ({"models": "a,b", "compare_out": "x"}, "--compare_out goes with --compare"),
    ({"models": "a,b", "model": "c"}, "--model and --models"),
    ({"models": "a,b", "resume": True}, "holds no run of these models to continue"),
])
def test_usage_errors_of_compare_and_models(tmp_path, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "x"}])
    base = {"dataset_file": "prompts.jsonl", "run_name": "eval", "base_url": "http://127.0.0.1:9/v1", "api_key": "k"}
    with pytest.raises(UsageError, match=re.escape(message)):
        modes.main(RunOptions(**base, **flags))
    assert list(tmp_path.iterdir()) == [tmp_path / "prompts.jsonl"]  # nothing written


def test_a_usage_error_is_one_line_from_the_cli(inline):
    done = inline.run("--compare=nowhere,elsewhere")
    assert done.returncode == 2 and done.stderr.strip() == "error: --compare nowhere: no such run directory"


def _journaled(run_dir, prompts_by_key: dict[str, str]) -> set[tuple[str, int]]:
    """(prompt, turn) of every reply in the journal (whole lines only: the runner may be writing one)."""
    path = run_dir / "journal.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return {(prompts_by_key[e["key"].split("~")[0]], e["turn"]) for e in map(json.loads, lines)}


def test_a_models_run_killed_with_9_resumes_without_paying_twice(cli, inline):
    slow = {"default": [{**call("terminal", command="echo hi"), "delay": 0.1}, {**think("42"), "delay": 0.4}]}
    server = start_server({"models": {"fast": {"default": [think("42")]}, "slow": slow}})
    try:
        names = [f"prompt {i}" for i in range(16)]
        write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": n} for n in names])
        keys = {e.key: e.prompt for e in dataset.entries(str(cli.cwd / "prompts.jsonl"), set())}
        args = cli.args(server, run_name="eval", model=None, models="fast,slow", concurrency=4, batch_size=4)
        process = cli.start(*args)
        slow_dir = cli.run_dir("eval") / "slow"
        deadline = time.monotonic() + 120
        while not (slow_dir.is_dir() and len(_rows(slow_dir)) >= 2 and {p for p, _ in _journaled(slow_dir, keys)}
                   - {r["conversations"][1]["value"] for r in _rows(slow_dir)}):
            assert time.monotonic() < deadline and process.poll() is None, "the slow model never got going"
            time.sleep(0.05)
        kill_group(process)
        landed = {r["conversations"][1]["value"] for r in _rows(slow_dir)}
        journaled = _journaled(slow_dir, keys)
        assert len(landed) < 16 and journaled
        before = len(server.requests())
        done = inline.run(*args, "--resume")
        assert done.returncode == 0, done.stderr
        after = server.requests()[before:]
    finally:
        server.stop()
    assert {r["body"]["model"] for r in after} == {"slow"}  # the finished model is not asked again
    asked = {(r["prompt"], r["turn"]) for r in after}
    assert not asked & journaled and not {p for p, _ in asked} & landed
    for model in ("fast", "slow"):
        rows = read_jsonl(cli.run_dir("eval") / model / "trajectories.jsonl")
        assert sorted(r["conversations"][1]["value"] for r in rows) == sorted(names)
    found = json.loads((cli.run_dir("eval") / "comparison.json").read_text())
    assert found["pairs"][0]["outcome"] == "completed" and found["pairs"][0]["both"] == 16


THREE = ("ma", "mb", "mc")
TWO_TURNS = {"default": [{**call("terminal", command="echo hi"), "delay": 0.1}, {**think("42"), "delay": 0.2}]}


def _asked(server) -> list[tuple[str, str, int]]:
    return [(r["body"]["model"], r["prompt"], r["turn"]) for r in server.requests()]


def _stopped_in(parent, model: str, keys: dict[str, str]) -> tuple[set[str], set[tuple[str, int]]]:
    """A model's prompts that landed, and the replies its journal holds (prompt, turn)."""
    return {r["conversations"][1]["value"] for r in _rows(parent / model)}, _journaled(parent / model, keys)


def _paid_once(before: dict[str, tuple[set, set]], asked_after: list[tuple[str, str, int]]) -> None:
    """Nothing the resume asked had landed or been journaled before it, and each request went out once."""
    for model, prompt, turn in asked_after:
        landed, journaled = before.get(model, (set(), set()))
        assert prompt not in landed and (prompt, turn) not in journaled, (model, prompt, turn)
    assert len(set(asked_after)) == len(asked_after)


def _resume_line(stderr: str) -> str:
    """The command printed under "resume with:"."""
    lines = stderr.splitlines()
    return next(lines[i + 1].strip() for i in reversed(range(len(lines))) if lines[i].lower().endswith("resume with:"))


def _all_done(parent, names: list[str]) -> None:
    for model in THREE:
        rows = read_jsonl(parent / model / "trajectories.jsonl")
        assert sorted(r["conversations"][1]["value"] for r in rows) == sorted(names), model
    found = json.loads((parent / "comparison.json").read_text())
    assert [r["model"] for r in found["runs"]] == list(THREE) and len(found["pairs"]) == 3


@pytest.mark.parametrize("stopped, sig, status", [(0, signal.SIGINT, 130), (1, signal.SIGTERM, 143),
                                                  (2, signal.SIGINT, 130)])
def test_a_models_run_stopped_in_any_model_resumes_with_the_printed_command(inline, stopped, sig, status):
    """Stopped in the first, second or third model: the printed resume line starts the models never
    started, continues the stopped one, asks the finished ones nothing, and writes the comparison."""
    server = start_server({"models": {m: TWO_TURNS for m in THREE}})
    try:
        names = [f"prompt {i}" for i in range(8)]
        write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": n} for n in names])
        keys = {e.key: e.prompt for e in dataset.entries(str(inline.cwd / "prompts.jsonl"), set())}
        parent, model = inline.run_dir("eval"), THREE[stopped]
        args = inline.args(server, run_name="eval", model=None, models=",".join(THREE), concurrency=2, num_workers=1)
        with when(lambda: (parent / model).is_dir() and len(_rows(parent / model)) >= 2,
                  lambda: os.kill(os.getpid(), sig)):
            first = inline.run(*args)
        assert first.returncode == status, first.stderr
        assert not (set(THREE[stopped + 1:]) & {m for m, _, _ in _asked(server)})
        if stopped < 2:
            assert f"not started: {', '.join(THREE[stopped + 1:])}" in first.stderr
        before = {m: _stopped_in(parent, m, keys) for m in THREE[:stopped + 1]}
        assert len(before[model][0]) < len(names)
        words = shlex.split(_resume_line(first.stderr), comments=True)
        assert words[1] == str(ROOT / "batch_runner.py") and words[-1] == "--resume"
        asked = len(server.requests())
        again = inline.run(*words[2:])
        asked_after = _asked(server)[asked:]
    finally:
        server.stop()
    assert again.returncode == 0, again.stderr
    assert {m for m, _, _ in asked_after} == set(THREE[stopped:])  # the finished models are asked nothing
    _paid_once(before, asked_after)
    _all_done(parent, names)


def test_a_models_run_interrupted_in_its_second_model_resumes_by_its_printed_line(cli):
    """The real CLI and a real Ctrl-C in the second of three models, then the resume line it
    printed, run by a shell as printed."""
    server = start_server({"models": {m: TWO_TURNS for m in THREE}})
    try:
        names = [f"prompt {i}" for i in range(8)]
        write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": n} for n in names])
        keys = {e.key: e.prompt for e in dataset.entries(str(cli.cwd / "prompts.jsonl"), set())}
        parent = cli.run_dir("eval")
        process = cli.start(*cli.args(server, run_name="eval", model=None, models=",".join(THREE), concurrency=2))
        deadline = time.monotonic() + 120
        while not ((parent / "mb").is_dir() and len(_rows(parent / "mb")) >= 2):
            assert time.monotonic() < deadline and process.poll() is None, "the second model never got going"
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 130, stderr
        assert "not started: mc" in stderr and not (parent / "mc").exists()
        before = {m: _stopped_in(parent, m, keys) for m in ("ma", "mb")}
        assert len(before["mb"][0]) < len(names)
        printed = _resume_line(stderr)
        asked = len(server.requests())
        again = subprocess.run(["sh", "-c", printed], cwd=cli.cwd, env=cli.env, capture_output=True, text=True,
                               timeout=300)
        asked_after = _asked(server)[asked:]
    finally:
        server.stop()
    assert again.returncode == 0, printed + "\n" + again.stderr
    assert {m for m, _, _ in asked_after} == {"mb", "mc"}
    _paid_once(before, asked_after)
    _all_done(parent, names)


def test_spend_limits_bound_the_whole_models_invocation(inline):
    server = start_server({"default": [think("42")]})  # 15 tokens a prompt
    try:
        write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
        done = inline.run(*inline.args(server, run_name="eval", model=None, models="a,b,c", concurrency=1,
                                       num_workers=1, max_total_tokens=200))
        asked = [r["body"]["model"] for r in server.requests() if r["body"].get("max_tokens") != 1]  # less the probes
    finally:
        server.stop()
    assert done.returncode == 3, done.stderr
    assert asked.count("a") == 10 and 1 <= asked.count("b") < 10 and "c" not in asked  # b had 50 tokens left
    assert 15 * len(asked) < 200 + 15  # at most the one prompt in flight when the limit was reached
    assert "--max_total_tokens=50 reached" in done.stderr and "not started: c" in done.stderr  # b's share
    assert (f"--max_total_tokens=200 reached; this invocation paid $0.0000, {15 * len(asked)} tokens over 2 model(s) "
            f"(a $0.0000, 150 tokens; b $0.0000, {15 * asked.count('b')} tokens)") in done.stderr
    assert json.loads((inline.run_dir("eval") / "comparison.json").read_text())["runs"][1]["samples"]["ok"] < 10


def test_a_cost_limit_is_shared_out_exactly_and_a_resume_gets_it_again(inline):
    """$0.001 a prompt, 4 prompts a model, --max_cost=0.009: a pays 0.004 and leaves b 0.005 (in floats,
    0.009 - 0.004 is 0.004999999999999999), b pays 0.004, c gets 0.001 and stops at its first prompt.
    The resume asks a and b nothing and finishes c within a whole new limit."""
    server = start_server({"default": [{**think("42"), "usage": {"cost": 0.001}}]})
    try:
        write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(4)])
        args = inline.args(server, run_name="eval", model=None, models="a,b,c", concurrency=1, num_workers=1,
                           max_cost=0.009)
        done = inline.run(*args)
        asked = [r["body"]["model"] for r in prompt_requests(server)]
        compared = json.loads((inline.run_dir("eval") / "comparison.json").read_text())
        again = inline.run(*args, "--resume")
        asked_again = [r["body"]["model"] for r in prompt_requests(server)][len(asked):]
    finally:
        server.stop()
    assert done.returncode == 3, done.stderr
    assert asked == ["a"] * 4 + ["b"] * 4 + ["c"]
    assert "model 2 of 3: b ($0.005 of --max_cost=0.009 left)" in done.stdout
    assert "model 3 of 3: c ($0.001 of --max_cost=0.009 left)" in done.stdout
    assert "stopped: --max_cost=0.001 reached" in done.stderr  # c's share
    assert ("stopped: --max_cost=0.009 reached; this invocation paid $0.0090, 135 tokens over 3 model(s) "
            "(a $0.0040, 60 tokens; b $0.0040, 60 tokens; c $0.0010, 15 tokens). Resume with:") in done.stderr
    assert "99999" not in done.stdout + done.stderr and "00000001" not in done.stdout + done.stderr
    assert compared["shared_prompts"] == 1 and [r["prompts_in_run"] for r in compared["runs"]] == [4, 4, 1]
    assert again.returncode == 0, again.stderr
    assert asked_again == ["c"] * 3 and "model 3 of 3: c ($0.009 of --max_cost=0.009 left)" in again.stdout
    compared = json.loads((inline.run_dir("eval") / "comparison.json").read_text())
    assert compared["shared_prompts"] == 4 and [r["samples"]["ok"] for r in compared["runs"]] == [4, 4, 4]


# Chromium: comparison.html on its own, and the comparison viewer.
sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests need playwright (.[browser])")
from tests.test_viewer import CHROMIUM, CHROMIUM_ARGS  # noqa: E402


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("needs Debian's chromium")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


def _sides(where) -> list[str]:
    return where.locator(".pair .side").all_inner_texts()


def test_comparison_html_opens_without_any_request_but_its_own_file(made, browser):
    inline, _ = made
    report = inline.run_dir("eval") / "comparison.html"
    context = browser.new_context()
    page = context.new_page()
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    page.goto(report.as_uri())
    page.locator("table.figures").wait_for()
    assert page.locator("ul.prompts > li").count() == len(GOOD ^ BAD)
    opened = page.locator("ul.prompts > li > details", has_text="task 9")
    opened.locator("> summary").click()
    sides = _sides(opened)
    assert len(sides) == 2 and sides[0].startswith("A: good") and sides[1].startswith("B: bad")
    assert "not passed" in sides[0] and "7" in sides[0] and ": passed" in sides[1] and "42" in sides[1]
    assert HOSTILE.strip() in sides[0] and HOSTILE.strip() in sides[1]  # shown as text
    assert requests == [report.as_uri()] and page.evaluate("window.pwned") is None
    context.close()


def test_the_viewer_opens_two_conversations_of_a_prompt_side_by_side(made, browser):
    inline, _ = made
    # the runs of a --models invocation
    process = CLI(inline.cwd).start("--view", "--compare=data/eval", "--view_port=0")
    try:
        line = process.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/\?token=[\w-]+", line)
        assert url, line + process.stderr.read()
        context = browser.new_context()
        page = context.new_page()
        page.goto(url.group(0))
        assert page.locator("ul.prompts > li").count() == 12  # every shared prompt
        page.locator("ul.prompts a", has_text="task 4").click()
        page.locator(".pair").wait_for()
        sides = _sides(page)
        assert ": passed" in sides[0] and "not passed" in sides[1] and "task 4" in sides[0] and "task 4" in sides[1]
        assert page.locator(".pair .side").nth(0).locator(".turn.gpt").count() == 4  # two samples, two turns each
        context.close()
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
