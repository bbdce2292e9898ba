"""Reasoning capture, the quality filters, and statistics that agree with the files."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

import batch_runner
from trajgen.options import RunOptions
from tests.conftest import call, read_jsonl, write_jsonl

FORMS = {
    "field reasoning": {"content": "answer", "reasoning": "R1"},
    "field reasoning_content": {"content": "answer", "reasoning_content": "R2"},
    "field reasoning_details": {"content": "answer", "reasoning_details": [{"type": "reasoning.text", "text": "R3"}]},
    "tag think": {"content": "<think>R4</think>answer"},
    "tag thinking": {"content": "<thinking>R5</thinking>\nanswer"},
    "tag reasoning": {"content": "<reasoning>R6</reasoning>answer"},
    "tag scratchpad": {"content": "<REASONING_SCRATCHPAD>R7</REASONING_SCRATCHPAD>answer"},
}


def _stats(runs) -> dict:
    return json.loads((runs.run_dir() / "statistics.json").read_text())


def test_reasoning_in_every_form_is_captured_as_one_leading_think(inline, scripted_server):
    server = scripted_server({"prompts": {name: [reply] for name, reply in FORMS.items()}})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": name} for name in FORMS])
    done = inline.run(*inline.args(server))
    assert done.returncode == 0, done.stderr
    rows = {r["conversations"][1]["value"]: r for r in read_jsonl(inline.run_dir() / "trajectories.jsonl")}
    assert len(rows) == len(FORMS)
    for i, name in enumerate(FORMS, 1):
        assert rows[name]["conversations"][-1]["value"] == f"<think>\nR{i}\n</think>\nanswer"
    assert _stats(inline)["reasoning_statistics"]["coverage_percent"] == 100.0


def _batch_rows(run_dir) -> list[dict]:
    return [r for path in sorted(run_dir.glob("batch_*.jsonl")) for r in read_jsonl(path)]


def test_rows_without_reasoning_stay_in_the_batch_files_and_resume_merges_them_with_no_request(inline,
                                                                                                  scripted_server):
    server = scripted_server({"default": [{"content": "no thoughts"}]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"plain {i}"} for i in range(12)])
    done = inline.run(*inline.args(server, batch_size=5))
    assert done.returncode == 0, done.stderr
    assert (inline.run_dir() / "trajectories.jsonl").read_text() == ""
    assert len(_batch_rows(inline.run_dir())) == 12 and not (inline.run_dir() / "discarded.jsonl").read_text()
    stats = _stats(inline)
    assert (stats["ok"], stats["kept"], stats["filtered_no_reasoning"], stats["discarded"]["total"]) == (12, 0, 12, 0)
    # every turn is in the denominator of the coverage, filtered or not
    assert stats["reasoning_statistics"]["total_assistant_turns"] == 12
    assert stats["reasoning_statistics"]["coverage_percent"] == 0.0
    assert ("kept 0 of 12: 12 had no reasoning (--require_reasoning=False keeps them; rerun with --resume to "
            "merge again, no request)") in " ".join(done.stderr.split())
    asked = len(server.requests())
    kept = inline.run(*inline.args(server, batch_size=5, resume=True, require_reasoning=False))
    assert kept.returncode == 0, kept.stderr
    assert "--force" not in kept.stderr and "kept 0" not in kept.stderr
    assert len(server.requests()) == asked  # merged again, nothing asked
    assert len(read_jsonl(inline.run_dir() / "trajectories.jsonl")) == 12
    assert (_stats(inline)["kept"], _stats(inline)["filtered_no_reasoning"]) == (12, 0)
    again = inline.run(*inline.args(server, batch_size=5, resume=True))  # the filter back on: filtered again
    assert again.returncode == 0, again.stderr
    assert (_stats(inline)["kept"], len(server.requests())) == (0, asked)


def test_rows_an_earlier_version_discarded_for_no_reasoning_come_back_on_resume(inline, scripted_server):
    server = scripted_server({"prompts": {"plain": [{"content": "no thoughts"}]},
                              "default": [{"content": "ok", "reasoning": "thought"}]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "plain"}, {"prompt": "thinks"}])
    assert inline.run(*inline.args(server)).returncode == 0
    run_dir = inline.run_dir()
    # as an earlier version left it: the row without reasoning discarded, in no batch file
    (plain,) = [r for r in read_jsonl(run_dir / "batch_0.jsonl") if r["conversations"][1]["value"] == "plain"]
    write_jsonl(run_dir / "batch_0.jsonl", [r for r in read_jsonl(run_dir / "batch_0.jsonl") if r != plain])
    record = {"prompt_key": plain["metadata"]["prompt_key"], "prompt_index": plain["prompt_index"], "batch_num": 0,
              "reason": "no_reasoning", "row": plain}
    write_jsonl(run_dir / "discarded.jsonl", [record])
    asked = len(server.requests())
    back = inline.run(*inline.args(server, resume=True, require_reasoning=False))
    assert back.returncode == 0, back.stderr
    assert "1 sample(s) that an earlier version discarded for having no reasoning are back" in back.stderr
    assert len(server.requests()) == asked
    assert sorted(r["conversations"][1]["value"] for r in read_jsonl(run_dir / "trajectories.jsonl")) == [
        "plain", "thinks"]
    stats = _stats(inline)
    assert (stats["ok"], stats["kept"], stats["discarded"]["total"]) == (2, 2, 0)
    assert read_jsonl(run_dir / "discarded.jsonl") == [record]  # nothing a run wrote is deleted
    again = inline.run(*inline.args(server, resume=True))
    assert again.returncode == 0 and "are back" not in again.stderr
    assert len(_batch_rows(run_dir)) == 2 and len(server.requests()) == asked
    assert (_stats(inline)["kept"], _stats(inline)["filtered_no_reasoning"]) == (1, 1)


def test_hallucinated_tool_rows_are_filtered_at_merge_and_counted_apart(inline, scripted_server):
    server = scripted_server({"prompts": {
        "invent": [call("teleport", where="mars"), {"content": "done", "reasoning": "r"}],
        "honest": [call("terminal", command="echo ok"), {"content": "done", "reasoning": "r"}],
    }})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "invent"}, {"prompt": "honest"}])
    done = inline.run(*inline.args(server))
    assert done.returncode == 0, done.stderr
    kept = read_jsonl(inline.run_dir() / "trajectories.jsonl")
    assert [r["conversations"][1]["value"] for r in kept] == ["honest"]
    in_batch = {r["conversations"][1]["value"]: r for r in read_jsonl(inline.run_dir() / "batch_0.jsonl")}
    assert in_batch["invent"]["metadata"]["hallucinated_tools"] == ["teleport"]
    assert in_batch["invent"]["tool_stats"]["teleport"] == {"count": 1, "success": 0, "failure": 1}
    # the model was told, as a tool error, and went on
    assert "unknown tool 'teleport'" in in_batch["invent"]["conversations"][3]["value"]
    stats = _stats(inline)
    assert stats["filtered_hallucinated"] == 1 and stats["kept"] == 1
    assert "teleport" not in stats["tool_statistics"]
    assert stats["filtered_tool_statistics"]["hallucinated"]["teleport"]["failure"] == 1
    assert stats["tool_statistics"]["terminal"]["success"] == 1
    keep = inline.run(*inline.args(server, run_name="keep", keep_hallucinated=True))
    assert keep.returncode == 0
    assert len(read_jsonl(inline.run_dir("keep") / "trajectories.jsonl")) == 2


def test_statistics_of_a_resumed_run_cover_both_parts(inline, scripted_server):
    server = scripted_server({"default": [call("terminal", command="true"), {"content": "x", "reasoning": "r",
                                                                              "usage": {"cost": 0.25}}]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    assert inline.run(*inline.args(server)).returncode == 0
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": p} for p in ("a", "b", "c")])
    assert inline.run(*inline.args(server, resume=True)).returncode == 0
    stats = _stats(inline)
    rows = read_jsonl(inline.run_dir() / "trajectories.jsonl")
    assert stats["ok"] == len(rows) == 3 and stats["total_prompts"] == 3
    assert stats["tool_statistics"]["terminal"]["count"] == sum(r["tool_stats"]["terminal"]["count"] for r in rows) == 3
    assert stats["api_calls"] == sum(r["api_calls"] for r in rows) == 6
    assert stats["cost"] == pytest.approx(0.75)
    assert stats["tokens"]["prompt"] == sum(r["metadata"]["usage"]["prompt_tokens"] for r in rows)
    assert stats["duration_seconds_total"] > stats["duration_seconds"]


def test_reasoning_effort_ephemeral_prompt_and_prefill_reach_the_request_only(inline, scripted_server):
    server = scripted_server({"default": [{"content": "x", "reasoning": "r"}]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "a"}])
    (inline.cwd / "prefill.json").write_text(json.dumps([{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "hello"}]))
    done = inline.run(*inline.args(server, reasoning_effort="high", ephemeral_system_prompt="SECRET-STEER",
                             prefill_messages_file="prefill.json"))
    assert done.returncode == 0, done.stderr
    body = server.requests()[0]["body"]
    assert body["reasoning_effort"] == "high"
    assert "SECRET-STEER" in body["messages"][0]["content"]
    assert [m["content"] for m in body["messages"][1:]] == ["hi", "hello", "a"]
    text = (inline.run_dir() / "trajectories.jsonl").read_text()
    assert "SECRET-STEER" not in text and "hello" not in text
    row = json.loads(text)
    assert row["conversations"][0]["value"] == batch_runner.DEFAULT_SYSTEM_PROMPT


def test_bad_prefill_file_is_a_usage_error(inline, scripted_server):
    server = scripted_server({})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "a"}])
    (inline.cwd / "prefill.json").write_text('{"role": "user"}')
    done = inline.run(*inline.args(server, prefill_messages_file="prefill.json"))
    assert done.returncode == 2 and "must be a JSON list" in done.stderr and server.requests() == []


def test_openrouter_gets_its_own_reasoning_and_provider_objects():
    opts = RunOptions(providers_allowed=("a", "b"), providers_ignored="c", provider_sort="latency",
                      reasoning_effort="low", base_url="https://openrouter.ai/api/v1")
    body, effort, said = opts.request_extras()
    assert body == {"provider": {"only": ["a", "b"], "ignore": ["c"], "sort": "latency"}, "reasoning": {"effort": "low"}}
    assert effort is None and len(said) == 2
    body, effort, _ = replace(opts, base_url="http://127.0.0.1:8000/v1", reasoning_disabled=True).request_extras()
    assert "reasoning" not in body and effort == "none"
