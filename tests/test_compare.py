"""Comparing models: the statistics against hand computations, a --models run of two models the
scripted server answers differently (in process: tests/support/inline.py), --compare over
overlapping datasets (by the real CLI), a --models run of the real CLI killed with -9 and resumed,
and comparison.html and the comparison viewer in Chromium."""
from __future__ import annotations

import json
import re
import signal
import time

import pytest

from tests.conftest import CLI, call, kill_group, read_jsonl, think, write_jsonl
from tests.support.inline import Inline
from trajgen import compare, dataset, run
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
    assert good["cost"] is None and good["latency"] is None
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
    assert any(w.startswith("samples per prompt differ (bad (bad): 2, good (other): 1)") for w in found["warnings"])
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
            (run_dir / "statistics.json").write_text(json.dumps({"latency": {"ttft_median": 0.5, "n": "x"},
                                                                 "time_to_first_token_p90": 1.25, "ok": 1}))
    found, _ = compare.compare([tmp_path / "a", tmp_path / "b"])
    pair = found["pairs"][0]
    assert pair["outcome"] == "completed" and pair["p_value"] is None and "nothing was verified" in pair["note"]
    assert (pair["both"], pair["only_a"], pair["only_b"], pair["neither"]) == (1, 1, 0, 0)
    assert found["runs"][1]["samples"] == {"ok": 1, "failed": 1, "total": 2}
    assert found["runs"][0]["pass_rate_prompts"]["rate"] is None
    assert found["runs"][0]["latency"] is None
    assert (found["runs"][0]["samples_with_hallucinated_tools"], found["runs"][0]["hallucinated_tool_names"]) == (2, 3)
    assert found["runs"][1]["latency"] == {"latency.ttft_median": 0.5, "time_to_first_token_p90": 1.25}


@pytest.mark.parametrize("flags, message", [
    ({"compare": "nowhere,elsewhere"}, "no such run directory"),
    ({"compare": "."}, "two or more run directories"),
    ({"compare": ".", "models": "a,b"}, "give one of them"),
    ({"models": "one"}, "two or more different models"),
    ({"models": "a/b,a_b"}, "share a directory name"),
    ({"models": "a,b", "compare_out": "x"}, "--compare_out goes with --compare"),
    ({"models": "a,b", "model": "c"}, "--model and --models"),
])
def test_usage_errors_of_compare_and_models(tmp_path, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "x"}])
    base = {"dataset_file": "prompts.jsonl", "run_name": "eval", "base_url": "http://127.0.0.1:9/v1", "api_key": "k"}
    with pytest.raises(UsageError, match=re.escape(message)):
        run.main(RunOptions(**base, **flags))
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


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_a_models_run_and_starts_no_other_model(cli, sig, status):
    server = start_server({"models": {"first": {"default": [{**think("42"), "delay": 0.3}]}}, "default": [think("42")]})
    try:
        write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(20)])
        process = cli.start(*cli.args(server, run_name="eval", model=None, models="first,second", concurrency=2))
        deadline = time.monotonic() + 120
        while not (cli.run_dir("eval") / "first").is_dir() or len(_rows(cli.run_dir("eval") / "first")) < 2:
            assert time.monotonic() < deadline and process.poll() is None, "the first model never got going"
            time.sleep(0.05)
        process.send_signal(sig)
        _, stderr = process.communicate(timeout=60)
        asked = {r["body"]["model"] for r in server.requests()}
    finally:
        server.stop()
    assert process.returncode == status, stderr
    assert "not started: second" in stderr and "--models=first,second" in stderr and "--resume" in stderr
    assert asked == {"first"} and not (cli.run_dir("eval") / "second").exists()


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
    assert "--max_total_tokens=50 reached" in done.stderr and "not started: c" in done.stderr
    assert json.loads((inline.run_dir("eval") / "comparison.json").read_text())["runs"][1]["samples"]["ok"] < 10


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
        url = re.search(r"http://127\.0\.0\.1:\d+/", line)
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
