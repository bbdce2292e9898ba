"""--compress: a finished run's long rows brought under a token target by one summary each, against the
loopback scripted server (the run and its summary model) and a tokenizer built in the test's directory."""
from __future__ import annotations

import json

import pytest

from tests.conftest import call, read_jsonl, think, write_jsonl
from tests.support import local_tokenizer
from trajgen import compaction, tokenizer

TARGET = 900
SUMMARY = "The agent listed the numbers it was asked for; nothing failed."


def words(n: int, tag: str) -> str:
    return f"printf '{tag}%.0s ' $(seq {n})"


def script(fail_summary_of: str | None = None) -> dict:
    """'long' calls a tool eight times, each printing 120 words; 'short' answers at once. A summary
    request answers SUMMARY, or a 400 when its transcript holds `fail_summary_of`."""
    long, two = ([call("terminal", command=words(120, f"{tag}{i}")) for i in range(8)] + [think("all listed")]
                 for tag in "wv")
    match = [{"contains": "Summarize these", "replies": [{"content": SUMMARY}]}]
    if fail_summary_of:
        match.insert(0, {"contains": fail_summary_of, "replies": [{"status": 400, "error": "too long for me"}]})
    return {"prompts": {"long": long, "long two": two, "short": [think("42")]}, "match": match}


def summary_requests(server) -> list[dict]:
    return [r for r in server.requests() if "Summarize these" in json.dumps(r["body"]["messages"])]


@pytest.fixture
def finished(inline, scripted_server, tmp_path):
    """A finished run of three prompts, and the tokenizer's path."""
    server = scripted_server(script())
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in ("long", "long two", "short")])
    assert inline.run(*inline.args(server, max_turns=10)).returncode == 0
    return server, str(local_tokenizer.build(tmp_path / "tok"))


def compress(inline, *flags: str, run_name: str = "run"):
    return inline.run("--compress", f"--run_name={run_name}", *flags)


def count(tok_path: str, row: dict) -> int:
    tok = tokenizer.load(tok_path)
    return sum(tokenizer.count(tok, t["value"]) for t in row["conversations"])


def test_long_rows_come_under_the_target_with_one_summary_each(inline, finished):
    server, tok = finished
    before = {r["metadata"]["prompt_key"]: r for r in read_jsonl(inline.run_dir() / "trajectories.jsonl")}
    done = compress(inline, f"--compress_tokens={TARGET}", f"--tokenizer={tok}")
    assert done.returncode == 0, done.stderr
    out = inline.run_dir("run_compressed")
    rows = {r["metadata"]["prompt_key"]: r for r in read_jsonl(out / "trajectories.jsonl")}
    assert len(summary_requests(server)) == 2  # one per long row
    for key, row in rows.items():
        old, metrics = before[key], row["metadata"]["compression"]
        assert metrics["tokens_before"] == count(tok, old) and metrics["tokens_after"] == count(tok, row)
        if count(tok, old) <= TARGET:
            assert row["conversations"] == old["conversations"] and metrics["status"] == "under_target"
            continue
        assert count(tok, row) <= TARGET < count(tok, old) and metrics["status"] == "compressed"
        turns, old_turns = row["conversations"], old["conversations"]
        assert [t["from"] for t in turns[:4]] == ["system", "human", "gpt", "tool"] and turns[:4] == old_turns[:4]
        assert turns[-4:] == old_turns[-4:]
        summaries = [t for t in turns if t["value"].startswith("[A summary of")]
        assert len(summaries) == 1 and turns[4] is summaries[0] and SUMMARY in turns[4]["value"]
        n = metrics["turns_summarized"]
        assert f"A summary of {n} earlier turns" in turns[4]["value"] and turns[5:] == old_turns[4 + n:]
        assert 0 < n < len(old_turns) - 8  # the fewest: some middle turns stay verbatim
        turns_seen = [compaction.Turn(t["from"], tuple(c["id"] for c in t.get("tool_calls", ())), t.get("tool_call_id"))
                      for t in turns]
        assert not isinstance(compaction.groups(turns_seen), compaction.Orphan)  # no call parted from its result
        assert metrics["summary_model"] == "test-model" and metrics["summary_usage"]["prompt_tokens"] == 10
    stats = json.loads((out / "statistics.json").read_text())["compression"]
    counts = (stats["compressed"], stats["under_target"], stats["still_over_target"], stats["summary_calls"])
    assert counts == (2, 1, 0, 2)
    assert stats["compression_ratio"] == round(stats["tokens_after"] / stats["tokens_before"], 4) < 1
    assert stats["summary_tokens"] == {"prompt": 20, "completion": 10}
    summary_request = summary_requests(server)[0]["body"]
    assert summary_request["model"] == "test-model" and f"at most {TARGET // 10} tokens" in json.dumps(summary_request)


def test_a_second_invocation_pays_no_summary_again(inline, finished):
    server, tok = finished
    assert compress(inline, f"--compress_tokens={TARGET}", f"--tokenizer={tok}").returncode == 0
    first = (inline.run_dir("run_compressed") / "trajectories.jsonl").read_bytes()
    again = compress(inline, f"--compress_tokens={TARGET}", f"--tokenizer={tok}")
    assert again.returncode == 0, again.stderr
    assert len(summary_requests(server)) == 2
    assert (inline.run_dir("run_compressed") / "trajectories.jsonl").read_bytes() == first
    stats = json.loads((inline.run_dir("run_compressed") / "statistics.json").read_text())["compression"]
    assert (stats["summary_calls_this_invocation"], stats["summary_calls_replayed"], stats["compressed"]) == (0, 2, 2)


def test_a_spend_limit_stops_the_summaries_and_the_same_command_goes_on(inline, finished):
    server, tok = finished
    limited = compress(inline, f"--compress_tokens={TARGET}", f"--tokenizer={tok}", "--max_total_tokens=1",
                       "--concurrency=1")
    assert limited.returncode == 3 and "a spend limit was reached: 1 summary call(s) not made" in limited.stderr
    assert len(summary_requests(server)) == 1 and "summary call failed" not in limited.stderr
    stats = json.loads((inline.run_dir("run_compressed") / "statistics.json").read_text())["compression"]
    assert (stats["compressed"], stats["not_summarized"], stats["summary_failed"]) == (1, 1, 0)
    again = compress(inline, f"--compress_tokens={TARGET}", f"--tokenizer={tok}")
    assert again.returncode == 0, again.stderr
    assert len(summary_requests(server)) == 2  # the first summary replayed from the journal, not paid again
    stats = json.loads((inline.run_dir("run_compressed") / "statistics.json").read_text())["compression"]
    assert (stats["summary_calls_this_invocation"], stats["summary_calls_replayed"], stats["compressed"]) == (1, 1, 2)


def test_a_failed_summary_leaves_its_row_as_it_was_counted_and_named(inline, finished):
    server, tok = finished
    server.set_script(script(fail_summary_of="v1 v1 v1"))
    done = compress(inline, f"--compress_tokens={TARGET}", f"--tokenizer={tok}", "--max_retries=0")
    assert done.returncode == 0, done.stderr
    rows = {r["metadata"]["prompt_key"]: r for r in read_jsonl(inline.run_dir("run_compressed") / "trajectories.jsonl")}
    source = {r["metadata"]["prompt_key"]: r for r in read_jsonl(inline.run_dir() / "trajectories.jsonl")}
    failed = [k for k, r in rows.items() if r["metadata"]["compression"]["status"] == "summary_failed"]
    assert len(failed) == 1 and rows[failed[0]]["conversations"] == source[failed[0]]["conversations"]
    stats = json.loads((inline.run_dir("run_compressed") / "statistics.json").read_text())["compression"]
    assert stats["summary_failed"] == 1 and list(stats["summary_failed_rows"]) == failed
    assert "too long for me" in stats["summary_failed_rows"][failed[0]]
    assert "1 row(s) kept uncompressed because their summary call failed" in " ".join(done.stderr.split())


def test_a_tool_call_without_its_result_keeps_its_row_as_it_is(inline, finished):
    _, tok = finished
    path = inline.run_dir() / "trajectories.jsonl"
    rows = read_jsonl(path)
    long = max(rows, key=lambda r: len(r["conversations"]))
    orphan = {**long, "conversations": long["conversations"][:-2] + long["conversations"][-1:]}  # the last result gone
    orphan["metadata"] = {**long["metadata"], "prompt_key": "orphan"}
    write_jsonl(path, [*rows, orphan])
    assert compress(inline, f"--compress_tokens={TARGET}", f"--tokenizer={tok}").returncode == 0
    out = {r["metadata"]["prompt_key"]: r for r in read_jsonl(inline.run_dir("run_compressed") / "trajectories.jsonl")}
    assert out["orphan"]["conversations"] == orphan["conversations"]
    assert out["orphan"]["metadata"]["compression"]["status"] == "orphan_tool_call"
    stats = json.loads((inline.run_dir("run_compressed") / "statistics.json").read_text())["compression"]
    assert stats["orphan_tool_calls"] == 1


def test_a_row_whose_kept_turns_are_too_long_is_flagged_and_counted(inline, finished):
    server, tok = finished
    assert compress(inline, "--compress_tokens=512", f"--tokenizer={tok}").returncode == 0
    rows = read_jsonl(inline.run_dir("run_compressed") / "trajectories.jsonl")
    over = [r for r in rows if r["metadata"]["compression"]["status"] == "over_target"]
    assert len(over) == 2 and all(r["metadata"]["compression"]["tokens_after"] > 512 for r in over)
    assert json.loads((inline.run_dir("run_compressed") / "statistics.json").read_text())["compression"][
        "still_over_target"] == 2
    assert not summary_requests(server)


def test_the_compressed_run_exports_and_reports(inline, finished):
    _, tok = finished
    assert compress(inline, f"--compress_tokens={TARGET}", f"--tokenizer={tok}").returncode == 0
    exported = inline.run("--export=hf", "--run_name=run_compressed")
    assert exported.returncode == 0, exported.stderr
    records = read_jsonl(inline.run_dir("run_compressed") / "export_hf.jsonl")
    assert len(records) == 3 and sum("A summary of" in json.dumps(r["messages"]) for r in records) == 2
    report = inline.run("--report", "--run_name=run_compressed")
    assert report.returncode == 0, report.stderr
    assert (inline.run_dir("run_compressed") / "report.html").exists()


@pytest.mark.parametrize("flags, said", [
    (("--compress_tokens=511",), "--compress_tokens must be at least 512"),
    (("--tokenizer=/nowhere/tok",), "--tokenizer=/nowhere/tok cannot be loaded"),
    (("--compress_tokens=1000",), "no finished run to compress"),
])
def test_bad_input_exits_2_before_any_request(inline, finished, flags, said):
    server, _ = finished
    sent = server.stats()["requests"]
    done = compress(inline, *flags, run_name="run" if "--compress_tokens=1000" not in flags else "nothing")
    assert done.returncode == 2 and said in " ".join(done.stderr.split())
    assert server.stats()["requests"] == sent and not inline.run_dir("run_compressed").exists()


def test_compress_with_the_estimate_and_no_tokenizer(inline, scripted_server, tmp_path):
    """A run, then --compress (no tokenizer: the estimate), as a user would."""
    server = scripted_server(script())
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "long"}])
    assert inline.run(*inline.args(server, max_turns=10)).returncode == 0
    done = compress(inline, "--compress_tokens=1000")
    assert done.returncode == 0, done.stderr
    assert "1 compressed" in done.stdout and len(summary_requests(server)) == 1
    row = read_jsonl(inline.run_dir("run_compressed") / "trajectories.jsonl")[0]
    assert row["metadata"]["compression"]["tokens_after"] <= 1000 < row["metadata"]["compression"]["tokens_before"]


def test_a_summary_endpoint_that_cannot_be_reached_stops_the_job_naming_its_flag(inline, finished):
    server, tok = finished
    done = compress(inline, f"--compress_tokens={TARGET}", "--summary_base_url=http://127.0.0.1:9/v1", "--max_retries=0")
    assert done.returncode == 1 and "--summary_base_url" in done.stderr and "Traceback" not in done.stderr
    assert not summary_requests(server) and not (inline.run_dir("run_compressed") / "trajectories.jsonl").exists()


def test_the_plan_keeps_a_call_with_all_its_results_on_either_side_of_the_cut():
    """Turns: system, human, a gpt turn with two calls and their results (the head ends after both),
    three middle groups, then a gpt turn with two calls, their results and the answer: the last four
    turns begin at a result, so the tail takes its call too."""
    T = compaction.Turn
    turns = [T("system"), T("human"), T("gpt", ("a", "b")), T("tool", answers="a"), T("tool", answers="b"),
             T("gpt", ("c",)), T("tool", answers="c"), T("gpt", ("d",)), T("tool", answers="d"),
             T("gpt", ("e",)), T("tool", answers="e"),
             T("gpt", ("f", "g")), T("tool", answers="f"), T("tool", answers="g"), T("gpt")]
    tokens = [100] * len(turns)
    target = 1000  # 1500 tokens: 500 + the summary's 100 to remove, all three middle groups (200 each)
    assert compaction.plan(turns, tokens, sum(tokens), target) == compaction.Cut(5, 11, 100)
    assert compaction.plan(turns, tokens, sum(tokens), 1300) == compaction.Cut(5, 9, 130)
    assert compaction.plan(turns, tokens, sum(tokens), 1500) == compaction.Fits()
    assert compaction.plan(turns, tokens, sum(tokens), 700) == compaction.Unreachable(970)  # 1500 - 600 + 70
    assert compaction.plan(turns[:-2] + turns[-1:], tokens[:-1], 1400, 1000) == compaction.Orphan(11)
