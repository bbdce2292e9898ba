"""--context_budget: a long rollout's requests kept under the budget by compacting its middle into one
summary as it runs, against the loopback scripted server and a tokenizer built in the test's directory."""
from __future__ import annotations

import json

from tests.conftest import call, read_jsonl, think, write_jsonl
from tests.support import local_tokenizer
from trajgen import tokenizer

SUMMARY = "The agent printed the words it was asked for."
BUDGET = 1200


def long_rollout(usage: list[dict] | None = None) -> dict:
    """Eight tool calls, each printing 150 words, then an answer; a summary request answers SUMMARY."""
    replies = [call("terminal", command=f"printf 'w{i}%.0s ' $(seq 150)") for i in range(8)] + [think("done")]
    for reply, said in zip(replies, usage or []):
        reply["usage"] = said
    return {"prompts": {"long": replies},
            "match": [{"contains": "Summarize these", "replies": [{"content": SUMMARY}]}]}


def agent_requests(server) -> list[dict]:
    return [r["body"] for r in server.requests() if "Summarize these" not in json.dumps(r["body"]["messages"])]


def summary_requests(server) -> list[dict]:
    return [r["body"] for r in server.requests() if "Summarize these" in json.dumps(r["body"]["messages"])]


def test_every_request_stays_under_the_budget_and_the_row_records_each_compaction(inline, scripted_server, tmp_path):
    server = scripted_server(long_rollout())
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "long"}])
    tok_path = str(local_tokenizer.build(tmp_path / "tok"))
    done = inline.run(*inline.args(server, max_turns=9, context_budget=BUDGET, tokenizer=tok_path))
    assert done.returncode == 0, done.stderr
    tok = tokenizer.load(tok_path)
    sizes = [len(tokenizer.render(tok, body["messages"], body.get("tools"))) for body in agent_requests(server)]
    assert max(sizes) <= BUDGET and len(sizes) == 10
    row = read_jsonl(inline.run_dir() / "trajectories.jsonl")[0]
    compactions = row["metadata"]["compactions"]
    assert compactions and len(compactions) == len(summary_requests(server))
    assert row["metadata"]["requests_over_budget"] == 0
    assert all(c["summary"] == SUMMARY and c["turns"] >= 2 for c in compactions)
    assert [c["before_turn"] for c in compactions] == sorted({c["before_turn"] for c in compactions})
    first = compactions[0]["before_turn"]
    sent = agent_requests(server)[first]["messages"]  # the first request sent shorter than the transcript
    assert any(m["content"].startswith(f"[A summary of {compactions[0]['turns']} earlier turns") for m in sent
               if m["role"] == "user")
    assert sent[:4] == agent_requests(server)[first - 1]["messages"][:4]  # system, prompt, first call, first result
    assert sum(t["from"] == "tool" for t in row["conversations"]) == 9  # the row keeps every turn: a result per call
    assert row["metadata"]["side_usage"]["summary"]["api_calls"] == len(compactions)
    # --tokenizer gives the row ids: each compaction starts a new training sample (trajgen/samples.py)
    compacted = [b["turn"] for b in row["metadata"]["token_ids"]["breaks"] if b["cause"] == "compacted"]
    assert compacted == [c["before_turn"] for c in compactions]
    stats = json.loads((inline.run_dir() / "statistics.json").read_text())
    assert stats["compactions"] == len(compactions)
    assert stats["summary"] == {"rows": 1, "calls": len(compactions), "cost": None, "tokens": {
        "prompt": 10 * len(compactions), "completion": 5 * len(compactions), "reasoning": 0}}


def test_without_a_tokenizer_the_last_reported_prompt_tokens_decide(inline, scripted_server, tmp_path):
    """The endpoint says the sixth request held 900 tokens: the seventh, a call and a result of about 130
    estimated tokens more, would pass 1,000 less its margin of 100, and is compacted; the earlier ones,
    reported at 10 tokens, are sent whole. (The server answers by the number of assistant messages it
    is sent, so it replies to a compacted request as to an earlier one, and may bring another.)"""
    usage = [{"prompt_tokens": 10}] * 5 + [{"prompt_tokens": 900}]
    server = scripted_server(long_rollout(usage))
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "long"}])
    done = inline.run(*inline.args(server, max_turns=8, context_budget=1000))
    assert done.returncode == 0, done.stderr
    row = read_jsonl(inline.run_dir() / "trajectories.jsonl")[0]
    compactions = row["metadata"]["compactions"]
    assert compactions[0]["before_turn"] == 6 and len(summary_requests(server)) == len(compactions)
    assert len(agent_requests(server)[6]["messages"]) < len(agent_requests(server)[5]["messages"])


def test_a_run_without_the_flag_sends_and_writes_as_before(inline, scripted_server, tmp_path):
    server = scripted_server(long_rollout())
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "long"}])
    assert inline.run(*inline.args(server, max_turns=9)).returncode == 0
    row = read_jsonl(inline.run_dir() / "trajectories.jsonl")[0]
    assert "compactions" not in row["metadata"] and not summary_requests(server)


def test_a_tokenizer_that_cannot_load_stops_the_run_before_any_request(inline, scripted_server, tmp_path):
    server = scripted_server(long_rollout())
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "long"}])
    done = inline.run(*inline.args(server, context_budget=BUDGET, tokenizer=str(tmp_path / "no-such-tokenizer")))
    assert done.returncode == 2 and "--tokenizer=" in done.stderr and "cannot be loaded" in done.stderr
    assert server.stats()["requests"] == 0
