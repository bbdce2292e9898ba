"""Verified trajectories: whole runs in process (tests/support/inline.py) against the scripted
server, verify commands run in real sandboxes (local and Docker), several samples per prompt,
the real CLI killed with -9 and resumed, --require_verified, the statistics against a hand count,
and the exports' rewards."""
from __future__ import annotations

import json
from collections import Counter

import pyarrow.parquet as pq

from tests.conftest import call, kill_group, read_jsonl, think, write_jsonl
from tests.test_hardening import _asked, _wait_for
from tests.test_journal import _journaled, _landed
from trajgen.viewer.index import RunIndex
from trajgen.viewer.query import reason, status
from trajgen.viewer.summary import read_filtering, summarize

pytest_plugins = ["tests.dockerd"]

ANSWER_IS_42 = 'test "$(cat .trajgen/final_answer.txt)" = 42'


def answer(text: str) -> dict:
    """A whole completion with reasoning, for the scripted server's `body` (served `times` times)."""
    message = {"role": "assistant", "content": text, "reasoning": "let me think"}
    return {"id": "chatcmpl-body", "object": "chat.completion", "created": 0, "model": "test-model",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


# a check's deadline: "slow check" outlives it, the others end long before it even on a loaded machine
VERIFY_TIMEOUT = 5
CHECKS = {  # prompt -> (verify command, the model's replies)
    "answer 42": (ANSWER_IS_42, [think("42")]),
    "make a file": ("grep -q made out.txt", [call("terminal", command="echo made > out.txt"), think("done")]),
    "wrong answer": ("grep -q 42 .trajgen/final_answer.txt", [think("7")]),
    "slow check": ("sleep 60", [think("42")]),
    "missing checker": ("run-the-tests --all", [think("42")]),
}


def _dataset(runs, prompts: dict[str, tuple[str, list]], extra: list[dict] = ()) -> dict:
    write_jsonl(runs.cwd / "prompts.jsonl", [{"prompt": p, "verify": v} for p, (v, _) in prompts.items()] + list(extra))
    return {"prompts": {p: replies for p, (_, replies) in prompts.items()}, "default": [think()]}


def _by_prompt(rows: list[dict]) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for row in rows:
        found.setdefault(row["conversations"][1]["value"], []).append(row)
    return found


def test_verdicts_samples_require_verified_statistics_and_exports_on_the_local_backend(inline, scripted_server):
    prompts = {**CHECKS,
               "sometimes 42": (ANSWER_IS_42, [{"body": answer("41"), "times": 2, "then": think("42")}]),
               "no reasoning": ("true", [{"content": "42"}])}
    server = scripted_server(_dataset(inline, prompts, [{"prompt": "unchecked"}]))
    args = inline.args(server, samples_per_prompt=3, verify_timeout=VERIFY_TIMEOUT, num_workers=1, concurrency=1,
                    cache_dir=str(inline.cwd / "cache"))
    done = inline.run(*args, "--require_verified")
    assert done.returncode == 0, done.stderr
    run_dir = inline.run_dir()
    rows = _by_prompt([r for p in run_dir.glob("batch_*.jsonl") for r in read_jsonl(p)])
    # every sample has its own identity and its own requests: the cache never gives a twin's reply
    for name, samples in rows.items():
        meta = [r["metadata"] for r in samples]
        assert sorted(m["sample_index"] for m in meta) == [0, 1, 2]
        assert len({m["group_id"] for m in meta}) == 1 and len({m["prompt_key"] for m in meta}) == 3
        assert meta[0]["group_id"] in {m["prompt_key"] for m in meta}
    assert Counter(r["prompt"] for r in server.requests())["answer 42"] == 3
    verdicts = {name: sorted(r["verify"]["status"] for r in samples) for name, samples in rows.items()}
    assert verdicts == {"answer 42": ["passed"] * 3, "make a file": ["passed"] * 3, "wrong answer": ["failed"] * 3,
                        "slow check": ["timeout"] * 3, "missing checker": ["error"] * 3,
                        "sometimes 42": ["failed", "failed", "passed"], "unchecked": ["unverified"] * 3,
                        "no reasoning": ["passed"] * 3}  # checked, then filtered at the merge (no reasoning)
    failed = rows["wrong answer"][0]["verify"]
    assert (failed["exit_code"], failed["command"], failed["error"]) == (1, CHECKS["wrong answer"][0], None)
    slow = rows["slow check"][0]["verify"]
    assert slow["exit_code"] is None and slow["seconds"] >= 1
    missing = rows["missing checker"][0]["verify"]
    assert (missing["exit_code"], missing["error"]) == (127, "command_not_found") and "not found" in missing["output"]

    # --require_verified: only the 7 passed rows with reasoning are kept; the statistics count by hand
    kept = read_jsonl(run_dir / "trajectories.jsonl")
    assert len(kept) == 7 and {r["verify"]["status"] for r in kept} == {"passed"}
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert (stats["ok"], stats["kept"], stats["filtered_not_passed"], stats["filtered_no_reasoning"]) == (24, 7, 14, 3)
    assert stats["samples_per_prompt"] == 3
    # judged samples per prompt (n, passed): 42 (3,3), file (3,3), wrong (3,0), slow (3,0), sometimes (3,1), no reasoning (3,3)
    assert stats["verification"] == {
        "samples": {"passed": 10, "failed": 5, "error": 3, "timeout": 3, "unverified": 3},
        "errors_by_kind": {"command_not_found": 3}, "timeouts": 3,
        "samples_judged": 18, "pass_rate_samples": round(10 / 18, 4),
        "prompts_judged": 6, "prompts_passed": 4, "pass_rate_prompts": round(4 / 6, 4),
        "pass_at_k": {"1": round((3 + 1 / 3) / 6, 4), "2": round((3 + 2 / 3) / 6, 4), "3": round(4 / 6, 4)},
        "pass_at_k_prompts": {"1": 6, "2": 6, "3": 6},
    }
    assert "pass@2" in done.stdout and "61.1%" in done.stdout
    # the viewer sorts the rows as the merge did, and says why a row was filtered
    index = RunIndex(run_dir)
    index.refresh()
    seen = summarize(index).stats
    assert (seen["ok"], seen["kept"], seen["filtered_not_passed"], seen["filtered_no_reasoning"]) == (24, 7, 14, 3)
    assert seen["verification"] == stats["verification"]
    filters = read_filtering(run_dir, index)
    assert Counter((status(e, filters), reason(e, filters)) for e in index.entries if e.kind == "row") == {
        ("ok", None): 7, ("filtered", "its verify command failed (--require_verified)"): 5,
        ("filtered", "its verify command timed out (--require_verified)"): 3,
        ("filtered", "its verify check could not run (--require_verified)"): 3,  # not said as failed
        ("filtered", "it has no verify command (--require_verified)"): 3,
        ("filtered", "no assistant turn has reasoning (--require_reasoning)"): 3}
    report = inline.run("--report", "--run_name=run")
    assert report.returncode == 0, report.stderr
    table = (run_dir / "report.html").read_text()
    assert table.count("<td>its verify check could not run (--require_verified)</td>") == 3
    assert table.count("<td>its verify command failed (--require_verified)</td>") == 5

    # the filter is changed on resume without paying again: every row comes back
    before = len(server.requests())
    again = inline.run(*args, "--resume")
    assert again.returncode == 0, again.stderr
    assert len(server.requests()) == before and len(read_jsonl(run_dir / "trajectories.jsonl")) == 21

    # exports select by verdict and carry a reward
    assert inline.run(*args, "--export=parquet", "--export_outcome=passed,failed").returncode == 0
    table = pq.read_table(run_dir / "export.parquet").to_pylist()
    assert Counter((r["verify"]["status"], r["reward"]) for r in table) == {("passed", 1.0): 7, ("failed", 0.0): 5}
    origins = [r["provenance"] for r in table]
    assert {o["group_id"] for o in origins if o["sample_index"] == 0} == {o["group_id"] for o in origins}
    assert inline.run(*args, "--export=openai").returncode == 0
    records = read_jsonl(run_dir / "export_openai.provenance.jsonl")  # the API's lines hold only its keys
    assert Counter((r["verify"]["status"], r["reward"]) for r in records) == {
        ("passed", 1.0): 7, ("failed", 0.0): 5, ("timeout", 0.0): 3, ("error", None): 3, ("unverified", None): 3}
    report = inline.run("--report", "--run_name=run")
    assert report.returncode == 0, report.stderr
    assert "pass@2" in (run_dir / "report.html").read_text() and "61.1%" in (run_dir / "report.html").read_text()
    bad = inline.run(*args, "--export=openai", "--export_outcome=won")
    assert bad.returncode == 2 and "--export_outcome must be a comma list" in bad.stderr


def test_verdicts_on_the_docker_backend(inline, scripted_server, docker_engine, busybox_image):
    server = scripted_server(_dataset(inline, CHECKS))
    done = inline.run(*inline.args(server, terminal_backend="docker", docker_image=busybox_image,
                                   verify_timeout=VERIFY_TIMEOUT),
                   env={"DOCKER_HOST": docker_engine})
    assert done.returncode == 0, done.stderr
    rows = _by_prompt(read_jsonl(inline.run_dir() / "trajectories.jsonl"))
    verdicts = {name: r[0]["verify"]["status"] for name, r in rows.items()}
    assert verdicts == {"answer 42": "passed", "make a file": "passed", "wrong answer": "failed",
                        "slow check": "timeout", "missing checker": "error"}
    assert rows["missing checker"][0]["verify"]["exit_code"] == 127
    assert json.loads((inline.run_dir() / "statistics.json").read_text())["verification"]["pass_at_k"] == {"1": 0.5}


def test_samples_land_exactly_once_across_a_kill_9_and_resume(cli, inline, scripted_server):
    def gated(text: str, gate: str | None) -> list[dict]:
        return [call("terminal", command=f"echo {text}"), {**think(text), **({"gate": gate} if gate else {})}]

    prompts = {"a": ("grep -qx a .trajgen/final_answer.txt", gated("a", None)),
               "b": ("grep -qx b .trajgen/final_answer.txt", gated("b", "kill")),
               "c": ("grep -qx c .trajgen/final_answer.txt", gated("c", None))}
    server = scripted_server(_dataset(cli, prompts))
    args = cli.args(server, samples_per_prompt=4, batch_size=3, concurrency=12)
    first = cli.start(*args)
    # a's and c's samples landed; b's four are held at their second reply, the first journaled
    _wait_for(lambda: _asked(server)[("b", 1)] == 4 and len(_landed(cli.run_dir())) == 8
              and sorted(_journaled(cli.run_dir()).values()) == [1, 1, 1, 1])
    kill_group(first)
    server.open_gate("kill")
    before = len(server.requests())
    done = inline.run(*args, "--resume")
    assert done.returncode == 0, done.stderr
    # only the held replies were asked for again; the journal replayed the rest, the checks ran again
    assert Counter((r["prompt"], r["turn"]) for r in server.requests()[before:]) == {("b", 1): 4}
    rows = read_jsonl(cli.run_dir() / "trajectories.jsonl")
    samples = Counter((r["conversations"][1]["value"], r["metadata"]["sample_index"]) for r in rows)
    assert samples == {(p, i): 1 for p in "abc" for i in range(4)}
    assert {r["verify"]["status"] for r in rows} == {"passed"}

    # more samples on resume: only the new ones run
    before = len(server.requests())
    more = inline.run(*inline.args(server, samples_per_prompt=5, batch_size=3, concurrency=12), "--resume")
    assert more.returncode == 0, more.stderr
    assert Counter((r["prompt"], r["turn"]) for r in server.requests()[before:]) == {
        (p, turn): 1 for p in "abc" for turn in (0, 1)}
    rows = read_jsonl(cli.run_dir() / "trajectories.jsonl")
    assert Counter((r["conversations"][1]["value"], r["metadata"]["sample_index"]) for r in rows) == {
        (p, i): 1 for p in "abc" for i in range(5)}
    stats = json.loads((cli.run_dir() / "statistics.json").read_text())["verification"]
    assert stats["pass_at_k"] == {str(k): 1.0 for k in range(1, 6)} and stats["samples"]["passed"] == 15
