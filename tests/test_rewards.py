"""Rewards (docs/rewards.md): graded checks, a judge with a rubric, --reward_from, group advantages,
the judge's statistics and agreement, --judge_mode=group and --rescore, whole runs in process
(tests/support/inline.py) against the scripted server, checks in real local sandboxes."""
from __future__ import annotations

import json
import math
from collections import Counter

import pytest

from tests.conftest import kill_group, read_jsonl, think, write_jsonl
from tests.test_hardening import _wait_for
from tests.test_verify import answer
from trajgen import judge, rewards
from trajgen.model import Reply

JUDGE = "judge-m"
RUBRIC = "Full marks for the answer 42."
PASS_IF_42 = 'test "$(cat .trajgen/final_answer.txt)" = 42'


def verdict(score, reason: str = "because", cost: float = 0.001) -> dict:
    """The judge's reply, with its usage."""
    return {"content": json.dumps({"score": score, "reason": reason}),
            "usage": {"prompt_tokens": 100, "completion_tokens": 10, "cost": cost}}


def _rows(run_dir) -> dict[str, list[dict]]:
    """The rows of the batch files by prompt text, in sample order."""
    found: dict[str, list[dict]] = {}
    for path in sorted(run_dir.glob("batch_*.jsonl")):
        for row in read_jsonl(path):
            found.setdefault(row["conversations"][1]["value"], []).append(row)
    return {p: sorted(rows, key=lambda r: r["metadata"]["sample_index"]) for p, rows in found.items()}


def _judge_requests(server) -> list[dict]:
    return [r for r in server.requests() if (r.get("body") or {}).get("model") == JUDGE]


def test_a_judge_scores_every_sample_with_its_rubric_and_groups_get_exact_advantages(inline, scripted_server):
    write_jsonl(inline.cwd / "prompts.jsonl", [
        {"prompt": "answer 42", "verify": PASS_IF_42},
        {"prompt": "graded", "verify": 'echo "tests: 3 of 4"; echo "reward: 0.75"; exit 1'},
        {"prompt": "malformed", "verify": 'echo "reward: lots"'},
        {"prompt": "open question", "rubric": "Score the haiku."}])
    server = scripted_server({
        "prompts": {"answer 42": [{"body": answer("41"), "times": 1, "then": think("42")}]},
        "default": [think("42")],
        "models": {JUDGE: {"match": [{"contains": "Score the haiku.", "replies": [{"content": "a fine haiku"}]},
                                     {"contains": "## Task\nanswer 42", "replies": [verdict(0.9)]},
                                     {"contains": "## Task\ngraded", "replies": [verdict(0.25)]}],
                           "default": [verdict(1)]}}})
    args = inline.args(server, samples_per_prompt=2, num_workers=1, concurrency=1, judge_model=JUDGE, rubric=RUBRIC)
    done = inline.run(*args)
    assert done.returncode == 0, done.stderr
    run_dir = inline.run_dir()
    rows = _rows(run_dir)

    # graded checks: the number of the last line; a malformed one is an error, never a guess
    graded = rows["graded"][0]["verify"]
    assert (graded["status"], graded["reward"], rows["graded"][0]["reward"]) == ("failed", 0.75, 0.75)
    malformed = rows["malformed"][0]
    assert (malformed["verify"]["status"], malformed["verify"]["error"], malformed["reward"]) == (
        "error", "malformed_reward", None)
    assert "is not `reward: <number>`" in malformed["verify"]["output"]

    # the judge scored every sample, saw the task, the trajectory and the rubric (the row's own first)
    assert len(_judge_requests(server)) == 8
    first = _judge_requests(server)[0]["body"]
    assert first["response_format"]["json_schema"]["schema"]["required"] == ["score", "reason"]
    text = first["messages"][1]["content"]
    assert text.startswith("## Task\nanswer 42") and "## Trajectory\n[agent]\n41" in text and RUBRIC in text
    assert rows["answer 42"][1]["judge"] == {"score": 0.9, "reason": "because", "model": JUDGE,
                                             "rubric_sha256": judge.sha256(RUBRIC)}
    haiku = rows["open question"][0]
    assert haiku["judge"] is None and haiku["reward"] is None  # a reply that is not the JSON: an error, no score
    assert haiku["judge_error"].startswith("the judge's answer is not JSON")
    assert haiku["metadata"]["side_usage"]["judge"]["api_calls"] == 1
    # --reward_from=verify (the default): the check's reward; the judge's where the row has no check
    assert [r["reward"] for r in rows["answer 42"]] == [0.0, 1.0]

    # groups, in trajectories.jsonl: the population std, GRPO's advantage
    kept = {(r["conversations"][1]["value"], r["metadata"]["sample_index"]): r
            for r in read_jsonl(run_dir / "trajectories.jsonl")}
    group = kept[("answer 42", 0)]["group"]
    assert group == {"size": 2, "reward_mean": 0.5, "reward_std": 0.5, "advantage": pytest.approx(-0.5 / (0.5 + 1e-6))}
    assert kept[("answer 42", 1)]["group"]["advantage"] == pytest.approx(0.5 / 0.500001)
    assert kept[("graded", 1)]["group"] == {"size": 2, "reward_mean": 0.75, "reward_std": 0.0, "advantage": 0.0}
    assert kept[("malformed", 0)]["group"]["advantage"] is None

    stats = json.loads((run_dir / "statistics.json").read_text())
    # rewarded: 42 (0, 1), graded (0.75, 0.75); groups of two or more: 2, one of them flat
    assert stats["rewards"] == {"samples_rewarded": 4, "mean_reward": 0.625, "groups": 2, "groups_zero_spread": 1,
                                "zero_spread_share": 0.5}
    j = stats["judge"]
    assert (j["calls"], j["rows_judged"], j["errors"], j["tokens"]["prompt"]) == (8, 6, 2, 6 * 100 + 2 * 10)
    assert j["cost"] == pytest.approx(0.006) and j["cost_per_row"] == pytest.approx(0.001)  # the haiku's: no cost
    # check passed/failed against the judge's score >= 0.5: 42 (failed, 0.9), (passed, 0.9); graded (failed, 0.25) x2
    assert j["agreement"] == {"check_passed_judge_passed": 1, "check_passed_judge_failed": 0,
                              "check_failed_judge_passed": 1, "check_failed_judge_failed": 2, "rows": 4,
                              "observed_agreement": 0.75, "kappa": 0.5}
    # everything paid: the rollouts report no cost (the scripted server), the judge's 0.006 is in it too
    assert stats["cost"] == pytest.approx(0.006) and stats["tokens"]["prompt"] > j["tokens"]["prompt"]
    assert "kappa 0.500" in done.stdout and "groups with zero spread" in done.stdout
    assert inline.run("--report", "--run_name=run").returncode == 0
    assert "kappa 0.500" in (run_dir / "report.html").read_text()

    # the exports carry the rewards and the groups
    assert inline.run(*args, "--export=hf").returncode == 0
    records = {(r["provenance"]["prompt_key"]): r for r in read_jsonl(run_dir / "export_hf.jsonl")}
    record = records[rows["answer 42"][1]["metadata"]["prompt_key"]]
    assert (record["reward"], record["judge"]["score"], record["group"]["reward_mean"]) == (1.0, 0.9, 0.5)
    # the OpenAI API refuses unknown keys: ours, these too, go to the side file, line by line
    assert inline.run(*args, "--export=openai").returncode == 0
    assert all(set(r) == {"messages", "tools"} for r in read_jsonl(run_dir / "export_openai.jsonl"))
    beside = read_jsonl(run_dir / "export_openai.provenance.jsonl")
    assert sum("judge" in b and "group" in b for b in beside) == sum("judge" in r and "group" in r for r in records.values())


@pytest.mark.parametrize("reward_from, expected", [("judge", [0.9, 0.9]), ("min", [0.0, 0.9]),
                                                    ("mean", [0.45, 0.95])])
def test_reward_from_chooses_the_signal_and_the_row_keeps_both(reward_from, expected):
    rows = [{"metadata": {}, "verify": {"status": status}, "judge": {"score": 0.9}} for status in ("failed", "passed")]
    assert [rewards.chosen(r, reward_from) for r in rows] == pytest.approx(expected)
    unchecked = {"metadata": {}, "verify": {"status": "unverified"}, "judge": {"score": 0.3}}
    assert rewards.chosen(unchecked, "verify") == 0.3
    assert rewards.chosen(unchecked, "min") is None and rewards.chosen({**unchecked, "judge": None}, "judge") is None


def test_the_judges_answer_is_parsed_strictly():
    def reply(content: str) -> Reply:
        return Reply({"role": "assistant", "content": content})

    assert judge.parse(reply(' {"score": 1, "reason": "r"}\n')) == judge.Score(1.0, "r")
    for bad in ('{"score": 1.5, "reason": "r"}', '{"score": true, "reason": "r"}', '{"score": 0.5}',
                '{"score": 0.5, "reason": "r", "extra": 1}', 'score: 0.5', '```json\n{"score": 0.5, "reason": "r"}```',
                '{"score": NaN, "reason": "r"}'):
        with pytest.raises(judge.JudgeError):
            judge.parse(reply(bad))
    group = reply(json.dumps({"scores": [{"sample": 1, "score": 0, "reason": "b"}, {"sample": 0, "score": 1,
                                                                                   "reason": "a"}]}))
    assert judge.parse_group(group, 2) == [judge.Score(1.0, "a"), judge.Score(0.0, "b")]
    with pytest.raises(judge.JudgeError, match="scored 2 of the 3"):
        judge.parse_group(group, 3)


def test_a_group_is_cut_in_proportion_to_fit_the_judges_context():
    long = "x" * 100_000
    row = {"metadata": {}, "conversations": [
        {"from": "human", "value": "the task"},
        {"from": "gpt", "value": "", "message": {"role": "assistant", "content": "I look",
                                                 "tool_calls": [{"function": {"name": "terminal", "arguments": long}}]}},
        {"from": "tool", "value": long, "message": {"role": "tool", "content": long}},
        {"from": "gpt", "value": long, "message": {"role": "assistant", "content": long}}]}
    one = judge.rendered(row)
    assert f"[... {100_000 - judge.TOOL_CHARS} characters cut ...]" in one and long in one  # the agent's text whole
    sixteen = judge.group_messages([row] * 16, RUBRIC)[1]["content"]
    assert len(sixteen) < judge.GROUP_CHARS + 4000 and sixteen.count("### Sample") == 16


def test_bad_judge_input_exits_2_before_any_request(inline, scripted_server, tmp_path):
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "p"}])
    server = scripted_server({"default": [think()]})
    cases = [({"judge_model": JUDGE, "rubric": "@missing.txt"}, "--rubric @missing.txt: cannot read the rubric file"),
             ({"judge_model": JUDGE}, "--judge_model needs a rubric"),
             ({"rubric": RUBRIC}, "--rubric goes with --judge_model"),
             ({"reward_from": "judge"}, "need a judge"),
             ({"reward_from": "best"}, "--reward_from must be one of verify, judge, min, mean"),
             ({"judge_model": JUDGE, "rubric": RUBRIC, "judge_base_url": "ftp://x"}, "--judge_base_url must be")]
    for flags, said in cases:
        done = inline.run(*inline.args(server, **flags))
        assert (done.returncode, said in done.stderr) == (2, True), (flags, done.stderr)
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "p", "rubric": 5}])
    bad_row = inline.run(*inline.args(server, judge_model=JUDGE))
    assert bad_row.returncode == 2 and "field 'rubric' must be a non-empty string" in bad_row.stderr
    missing = inline.run("--rescore", "--run_name=nothing", f"--judge_model={JUDGE}", f"--rubric={RUBRIC}")
    assert missing.returncode == 2 and "--rescore: there is no run" in missing.stderr
    assert server.requests() == []


def test_an_unreachable_judge_stops_the_run_at_once_naming_its_flag(inline, scripted_server):
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(6)])
    server = scripted_server({"default": [think()]})
    done = inline.run(*inline.args(server, num_workers=1, concurrency=1, judge_model=JUDGE, rubric=RUBRIC,
                                   judge_base_url="http://127.0.0.1:9/v1"))
    assert done.returncode == 1 and "--judge_base_url=http://127.0.0.1:9/v1 cannot be reached" in done.stderr
    assert len(server.requests()) < 6  # stopped at the first judge call, not after every prompt


def test_judge_mode_group_scores_each_prompts_samples_together(inline, scripted_server):
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "answer 42", "verify": PASS_IF_42}])
    scores = {"scores": [{"sample": 0, "score": 0.2, "reason": "41"}, {"sample": 1, "score": 0.8, "reason": "42"},
                         {"sample": 2, "score": 0.8, "reason": "42"}]}
    server = scripted_server({"prompts": {"answer 42": [{"body": answer("41"), "times": 1, "then": think("42")}]},
                              "models": {JUDGE: {"default": [{"content": json.dumps(scores)}]}}})
    args = inline.args(server, samples_per_prompt=3, num_workers=1, concurrency=1, judge_model=JUDGE, rubric=RUBRIC,
                       judge_mode="group", reward_from="judge")
    done = inline.run(*args)
    assert done.returncode == 0, done.stderr
    (request,) = _judge_requests(server)
    assert request["body"]["messages"][1]["content"].count("### Sample") == 3
    rows = _rows(inline.run_dir())["answer 42"]
    assert [(r["judge"]["score"], r["reward"]) for r in rows] == [(0.2, 0.2), (0.8, 0.8), (0.8, 0.8)]
    kept = read_jsonl(inline.run_dir() / "trajectories.jsonl")
    mean = 1.8 / 3
    std = math.sqrt(((0.2 - mean) ** 2 + 2 * (0.8 - mean) ** 2) / 3)
    assert sorted(r["group"]["advantage"] for r in kept) == pytest.approx(
        sorted([(0.2 - mean) / (std + 1e-6)] + [(0.8 - mean) / (std + 1e-6)] * 2))
    # a resume with nothing new judges nothing again
    again = inline.run(*args, "--resume")
    assert again.returncode == 0 and len(_judge_requests(server)) == 1


def test_rescore_pays_only_for_the_judge_replaces_scores_and_resumes(inline, scripted_server, tmp_path):
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "answer 42", "verify": PASS_IF_42}, {"prompt": "essay"}])
    server = scripted_server({"default": [think("42")],
                              "models": {JUDGE: {"match": [{"contains": "strict", "replies": [verdict(0.1)]}],
                                                 "default": [{"status": 500, "error": "down", "times": 1,
                                                              "then": verdict(0.7)}]}}})
    args = inline.args(server, samples_per_prompt=2, num_workers=1, concurrency=1)
    assert inline.run(*args).returncode == 0
    assert inline.run(*args, "--export=openai").returncode == 0
    run_dir = inline.run_dir()
    rollouts = len(server.requests())
    assert all(r["reward"] is None for r in _rows(run_dir)["essay"])  # no check, no judge: no reward

    rescore = ["--rescore", "--run_name=run", f"--judge_model={JUDGE}", f"--base_url={server.url}",
               "--api_key=dummy-key", "--max_retries=0", "--concurrency=1"]
    first = inline.run(*rescore, f"--rubric={RUBRIC}")  # each prompt's first judge call fails (HTTP 500)
    assert first.returncode == 0, first.stderr
    assert len(server.requests()) == rollouts + 4 and len(_judge_requests(server)) == 4
    rows = _rows(run_dir)
    for samples in rows.values():  # the failed call: that row's judge_error, no score; the other row scored
        assert sorted(bool(r["judge_error"]) for r in samples) == [False, True]
        assert "500" in next(r["judge_error"] for r in samples if r["judge_error"])
    assert sorted(map(str, (r["reward"] for r in rows["essay"]))) == ["0.7", "None"]
    assert "export_openai.jsonl was exported before this rescore and is stale" in first.stderr

    again = inline.run(*rescore, f"--rubric={RUBRIC}")  # the journal answers what was paid: only the failed are asked
    assert again.returncode == 0, again.stderr
    assert len(_judge_requests(server)) == 6
    rows = _rows(run_dir)
    assert {r["judge"]["score"] for rs in rows.values() for r in rs} == {0.7}
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert stats["judge"]["rows_judged"] == 4 and stats["rewards"]["samples_rewarded"] == 4

    changed = inline.run(*rescore, "--rubric=be strict")  # a new rubric: new requests, new scores
    assert changed.returncode == 0, changed.stderr
    assert len(_judge_requests(server)) == 10
    kept = read_jsonl(run_dir / "trajectories.jsonl")
    assert {(r["judge"]["score"], r["judge"]["rubric_sha256"]) for r in kept} == {(0.1, judge.sha256("be strict"))}
    assert Counter(r["reward"] for r in kept) == {1.0: 2, 0.1: 2}  # checked rows keep the check's reward
    assert len(server.requests()) == rollouts + 10  # not one rollout request

    gone = inline.run(*rescore, "--rubric=other", "--judge_base_url=http://127.0.0.1:9/v1")
    assert gone.returncode == 1 and "--judge_base_url=http://127.0.0.1:9/v1 cannot be reached" in gone.stderr
    assert {r["judge"]["score"] for r in read_jsonl(run_dir / "trajectories.jsonl")} == {0.1}  # nothing replaced


def test_a_killed_rescore_goes_on_without_paying_twice_and_the_lock_refuses_a_second(inline, cli, scripted_server):
    """The real CLI: a rescore killed with -9 while the judge holds its second call; another one meanwhile
    is refused by the run lock; done again, it pays only for the calls it had not received."""
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(3)])
    server = scripted_server({"default": [think("42")], "models": {JUDGE: {"match": [
        {"contains": "## Task\np0", "replies": [verdict(0.5)]},
        {"contains": "## Task\np1", "replies": [{**verdict(0.6), "gate": "hold"}]}], "default": [verdict(0.7)]}}})
    assert inline.run(*inline.args(server, num_workers=1, concurrency=1)).returncode == 0
    run_dir = inline.run_dir()
    rescore = ["--rescore", "--run_name=run", f"--judge_model={JUDGE}", f"--rubric={RUBRIC}", f"--base_url={server.url}",
               "--api_key=dummy-key", "--concurrency=1"]
    started = cli.start(*rescore)
    try:
        _wait_for(lambda: (run_dir / "judge_journal.jsonl").exists()
                  and len(read_jsonl(run_dir / "judge_journal.jsonl")) == 1 and len(_judge_requests(server)) == 2)
        refused = inline.run(*rescore)
        assert refused.returncode == 2 and "is in use by another runner" in refused.stderr
    finally:
        kill_group(started)
    assert not any("judge" in r for rows in _rows(run_dir).values() for r in rows)  # nothing replaced half-way
    server.open_gate("hold")
    done = cli.run(*rescore)
    assert done.returncode == 0, done.stderr
    asked = Counter(r["body"]["messages"][1]["content"].split("\n")[1] for r in _judge_requests(server))
    assert asked == {"p0": 1, "p1": 2, "p2": 1}  # p0 was journaled before the kill: replayed, not paid again
    assert "1 replayed" in done.stdout
    assert {r["conversations"][1]["value"]: r["judge"]["score"]
            for r in read_jsonl(run_dir / "trajectories.jsonl")} == {"p0": 0.5, "p1": 0.6, "p2": 0.7}


def test_a_rescore_stops_at_its_spend_limit_and_goes_on_from_there(inline, scripted_server):
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(4)])
    server = scripted_server({"default": [think("42")], "models": {JUDGE: {"default": [verdict(0.5, cost=0.001)]}}})
    assert inline.run(*inline.args(server, num_workers=1, concurrency=1)).returncode == 0
    rescore = ["--rescore", "--run_name=run", f"--judge_model={JUDGE}", f"--rubric={RUBRIC}", f"--base_url={server.url}",
               "--api_key=dummy-key", "--concurrency=1"]
    stopped = inline.run(*rescore, "--max_cost=0.0015")  # the second call's cost reaches it
    assert stopped.returncode == 3 and "2 row(s) not scored" in stopped.stderr
    assert len(_judge_requests(server)) == 2
    assert sum(bool(r.get("judge")) for rows in _rows(inline.run_dir()).values() for r in rows) == 2
    done = inline.run(*rescore)
    assert done.returncode == 0 and len(_judge_requests(server)) == 4  # the two paid are replayed
    assert all(r["judge"]["score"] == 0.5 for rows in _rows(inline.run_dir()).values() for r in rows)
