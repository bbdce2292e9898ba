"""Malformed replies inside a 200 fail only their prompt, with a class that names what the
endpoint did, and what they cost still counts. Whole runs in process (tests/support/inline.py) against
the loopback scripted server."""
from __future__ import annotations

import json
from collections import Counter

from tests.conftest import call, read_jsonl, think, write_jsonl
from tests.support.inline import stopped_if_it_hangs
from tests.test_guard_rails import prompt_requests
from trajgen import agent


def _call(function: dict | None = None, call_id: str | None = "c1") -> dict:
    return {**({"id": call_id} if call_id else {}), "type": "function", **({"function": function} if function else {})}


def _sent(*calls, cost: float | None = None) -> dict:
    """A reply whose assistant message is sent exactly as given (content null, as with tool calls)."""
    message = {"role": "assistant", "content": None, **({"tool_calls": list(calls)} if calls else {})}
    return {"message": message, **({"usage": {"cost": cost}} if cost is not None else {})}


ECHO = {"name": "terminal", "arguments": '{"command": "echo hi"}'}
NOT_OFFERED = {"tool_calls": [{"name": "no_such_tool", "arguments": {}}], "reasoning": "r"}  # a paid turn, no sandbox
BAD = {  # prompt -> (its first reply, the class it fails with)
    "no function": (_sent(_call()), "MalformedResponse"),
    "no name": (_sent(_call({"arguments": "{}"})), "MalformedResponse"),
    "number name": (_sent(_call({"name": 5, "arguments": "{}"})), "MalformedResponse"),
    "number arguments": (_sent(_call({"name": "terminal", "arguments": 7})), "MalformedResponse"),
    "duplicate ids": (_sent(_call(ECHO), _call(ECHO)), "MalformedResponse"),
    "empty answer": (_sent(), "EmptyAnswer"),
}
HANDLED = {  # the repair is lossless, and the row replays what was sent back to the model
    "object arguments": _sent(_call({"name": "terminal", "arguments": {"command": "echo hi"}})),
    "no id": _sent(_call(ECHO, call_id=None)),
}


def _asked(server) -> Counter:
    """How often each (prompt, turn) reached the server."""
    return Counter((r["prompt"], r["turn"]) for r in server.requests())


def _prompts(path) -> list[str]:
    return sorted(r["conversations"][1]["value"] for r in read_jsonl(path))


def test_malformed_replies_fail_only_their_prompt_and_resume_asks_only_them_again(inline, scripted_server):
    healthy = [f"healthy {i}" for i in range(12)]
    late = "fails after a paid turn"
    script = {"prompts": {**{p: [reply, think()] for p, (reply, _) in BAD.items()},
                          **{p: [reply, think()] for p, reply in HANDLED.items()},
                          late: [NOT_OFFERED, BAD["no name"][0]]},
              "default": [think()]}
    server = scripted_server(script)
    dataset = [*healthy[:6], *BAD, late, *HANDLED, *healthy[6:]]
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": p} for p in dataset])
    done = inline.run(*inline.args(server))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert _prompts(inline.run_dir() / "trajectories.jsonl") == sorted([*healthy, *HANDLED])
    assert all(n == 1 for n in _asked(server).values())  # nothing asked twice
    failures = {dataset[f["prompt_index"]]: f for f in read_jsonl(inline.run_dir() / "failures.jsonl")}
    assert {p: f["error_class"] for p, f in failures.items()} == {**{p: c for p, (_, c) in BAD.items()},
                                                                  late: "MalformedResponse"}
    assert "function name is missing" in failures["no name"]["message"]
    assert "two tool calls with the id 'c1'" in failures["duplicate ids"]["message"]
    assert failures[late]["usage"]["prompt_tokens"] == 20  # both replies were paid for
    stats = json.loads((inline.run_dir() / "statistics.json").read_text())
    assert stats["failed"]["by_class"] == {"MalformedResponse": len(BAD), "EmptyAnswer": 1}
    assert stats["failed"]["attempts"] == len(BAD) + 1 and stats["failed"]["tokens"]["prompt"] == 10 * len(BAD) + 20
    rows = read_jsonl(inline.run_dir() / "trajectories.jsonl")
    assert stats["tokens"]["prompt"] == sum(r["metadata"]["usage"]["prompt_tokens"] for r in rows) \
        + stats["failed"]["tokens"]["prompt"]

    # the repaired calls went back to the model as the row records them
    history = {r["prompt"]: r["body"]["messages"] for r in server.requests() if r["turn"] == 1}
    sent_call = history["object arguments"][-2]["tool_calls"][0]
    assert json.loads(sent_call["function"]["arguments"]) == {"command": "echo hi"}
    generated = history["no id"][-2]["tool_calls"][0]["id"]
    assert generated and history["no id"][-1]["tool_call_id"] == generated
    row = next(r for r in rows if r["conversations"][1]["value"] == "no id")
    assert generated in json.dumps(row)

    # the endpoint behaves now; the journal replays the late prompt's paid first turn, so only its
    # second turn is asked again
    server.set_script({**script, "prompts": {late: [NOT_OFFERED, think()]}})
    resumed = inline.run(*inline.args(server, resume=True))
    assert resumed.returncode == 0, resumed.stderr
    # the late prompt's replayed first turn called a tool it was not offered: its row landed, and the
    # merge filters it as hallucinated
    assert _prompts(inline.run_dir() / "trajectories.jsonl") == sorted(set(dataset) - {late})
    landed = [r for b in inline.run_dir().glob("batch_*.jsonl") for r in read_jsonl(b)]
    assert [r["metadata"]["hallucinated_tools"] for r in landed if r["conversations"][1]["value"] == late] == [
        ["no_such_tool"]]
    again = {p for (p, turn), n in _asked(server).items() if n > 1}
    assert again == {*BAD, late}  # the failed ones were asked again, nothing else
    assert _asked(server)[(late, 0)] == 1
    stats = json.loads((inline.run_dir() / "statistics.json").read_text())
    assert stats["failed"]["total"] == 0
    assert stats["failed"]["attempts"] == len(BAD) + 1  # the first attempts were paid, and count once


def test_a_failed_prompt_counts_what_it_paid_toward_max_cost(inline, scripted_server):
    # each prompt pays $0.25 for a turn, then $0.25 for a malformed reply: $0.50 a prompt, all failed
    server = scripted_server({"default": [{**NOT_OFFERED, "usage": {"cost": 0.25}},
                                          _sent(_call(ECHO), _call(ECHO), cost=0.25)]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    done = inline.run(*inline.args(server, num_workers=1, concurrency=1, max_cost=1.0))
    assert done.returncode == 3, done.stderr
    assert "--max_cost=1.0 reached" in done.stderr
    assert len(prompt_requests(server)) == 4  # two prompts, then the limit
    failures = read_jsonl(inline.run_dir() / "failures.jsonl")
    assert [f["usage"]["cost"] for f in failures] == [0.5, 0.5]
    stats = json.loads((inline.run_dir() / "statistics.json").read_text())
    assert (stats["failed"]["cost"], stats["cost"]) == (1.0, 1.0)


def test_a_tool_call_cut_by_the_token_limit_is_recorded_as_truncated_and_never_run(inline, scripted_server, tmp_path):
    """Streamed, its arguments cut and `finish_reason: length`: the call is not run (no tool result
    goes back to the model), the row lands in discarded.jsonl as `truncated` with its finish reasons,
    never in trajectories.jsonl; replayed from the cache, it is truncated again and not paid again."""
    cut = {"tool_calls": [{"name": "terminal", "arguments": '{"command": "echo hi > /tmp/ran; ec'}],
           "reasoning": "r", "finish_reason": "length", "pieces": 4, "usage": {"completion_tokens": 64}}
    server = scripted_server({"prompts": {"cut": [cut]}, "default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "cut"}, {"prompt": "fine"}])
    cache = tmp_path / "cache"
    for run_name in ("first", "from the cache"):
        done = inline.run(*inline.args(server, run_name=run_name, cache_dir=cache))
        assert done.returncode == 0, done.stderr
        run_dir = inline.run_dir(run_name)
        assert _prompts(run_dir / "trajectories.jsonl") == ["fine"]
        discarded, = read_jsonl(run_dir / "discarded.jsonl")
        assert discarded["reason"] == "truncated"
        row = discarded["row"]
        assert row["truncated"] and not row["completed"] and row["metadata"]["finish_reasons"] == ["length"]
        assert row["tool_stats"]["terminal"]["count"] == 0 and row["metadata"]["usage"]["completion_tokens"] == 64
        stats = json.loads((run_dir / "statistics.json").read_text())
        assert stats["discarded"]["by_reason"] == {"truncated": 1}
    assert _asked(server) == Counter({("cut", 0): 1, ("fine", 0): 1})  # asked once, never a second turn


def test_a_reply_with_reasoning_of_the_wrong_type_fails_its_prompt_and_never_hangs_the_run(inline, scripted_server):
    odd = {"reasoning details not a list": {"role": "assistant", "content": "an answer", "reasoning_details": 5},
           "reasoning not text": {"role": "assistant", "content": "an answer", "reasoning": {"text": "r"}}}
    script = {"prompts": {p: [{"message": message}] for p, message in odd.items()}, "default": [think()]}
    server = scripted_server(script)
    dataset = [*odd, "healthy"]
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": p} for p in dataset])
    with stopped_if_it_hangs():
        done = inline.run(*inline.args(server, stream=False))
    assert done.returncode == 1, done.stderr  # 130 would be a hang, stopped
    assert "Traceback" not in done.stderr
    failures = {dataset[f["prompt_index"]]: f for f in read_jsonl(inline.run_dir() / "failures.jsonl")}
    assert {p: f["error_class"] for p, f in failures.items()} == dict.fromkeys(odd, "MalformedResponse")
    assert "reasoning_details that are not a list: 5" in failures["reasoning details not a list"]["message"]
    assert "reasoning that is not text" in failures["reasoning not text"]["message"]
    assert _prompts(inline.run_dir() / "trajectories.jsonl") == ["healthy"]

    server.set_script({"default": [think()]})
    resumed = inline.run(*inline.args(server, stream=False, resume=True))
    assert resumed.returncode == 0, resumed.stderr
    assert _prompts(inline.run_dir() / "trajectories.jsonl") == sorted(dataset)
    assert _asked(server) == Counter({(p, 0): 2 for p in odd} | {("healthy", 0): 1})


def test_an_error_nobody_foresaw_after_the_replies_fails_its_prompt_with_its_traceback(inline, scripted_server,
                                                                                       monkeypatch):
    """A bug in rendering the row (or in verify, or in deciding) ends the prompt as InternalError, with
    what it paid; its replies are journaled, so the resume that renders it pays for none of them again."""
    render_row = agent.render_row

    def broken(task, *args, **kwargs):
        if task.prompt == "unlucky":
            raise RuntimeError("a bug in rendering")
        return render_row(task, *args, **kwargs)

    monkeypatch.setattr(agent, "render_row", broken)
    server = scripted_server({"default": [call("terminal", command="echo hi"), think()]})
    dataset = ["unlucky", "lucky"]
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": p} for p in dataset])
    with stopped_if_it_hangs():
        done = inline.run(*inline.args(server))
    assert done.returncode == 1, done.stderr  # 130 would be a hang, stopped
    [failure] = read_jsonl(inline.run_dir() / "failures.jsonl")
    assert (failure["error_class"], failure["message"]) == ("InternalError", "RuntimeError: a bug in rendering")
    assert "broken" in failure["traceback"] and failure["usage"]["prompt_tokens"] == 20  # both replies, paid
    assert _prompts(inline.run_dir() / "trajectories.jsonl") == ["lucky"]

    monkeypatch.setattr(agent, "render_row", render_row)
    resumed = inline.run(*inline.args(server, resume=True))
    assert resumed.returncode == 0, resumed.stderr
    assert _prompts(inline.run_dir() / "trajectories.jsonl") == sorted(dataset)
    assert all(n == 1 for n in _asked(server).values())  # the journal replayed both of its replies
