"""The simulated user (--user_model): whole runs in process (tests/support/inline.py) against the scripted
server, which answers the agent (test-model) and the simulator (sim-model) from their own scripts."""
from __future__ import annotations

import json
from collections import Counter

from tests.conftest import call, read_jsonl, think, write_jsonl
from trajgen import console, simulated_user
from trajgen.viewer.conversation import view
from trajgen.viewer.index import RunIndex
from trajgen.viewer.summary import read_filtering, summarize

STOP = simulated_user.STOP


def _rows(run_dir) -> dict[str, dict]:
    return {r["conversations"][1]["value"]: r for p in sorted(run_dir.glob("batch_*.jsonl")) for r in read_jsonl(p)}


def _sim_requests(server) -> list[dict]:
    return [r for r in server.requests() if r["body"]["model"] == "sim-model"]


def test_follow_ups_are_marked_human_turns_until_the_user_stops_or_its_turns_run_out(inline, scripted_server):
    write_jsonl(inline.cwd / "prompts.jsonl", [
        {"prompt": "plan a trip", "user": {"persona": "a busy parent", "goal": "a two-day trip to Paris"}},
        {"prompt": "chat forever", "user": "always ask for more"},
        {"prompt": "say nothing", "user": "be silent"},
        {"prompt": "no user"},
    ])
    server = scripted_server({
        "prompts": {"plan a trip": [think("Where to?"), call("terminal", command="echo paris"), think("The plan.")],
                    "chat forever": [think("ok")], "say nothing": [think("Done.")], "no user": [think("hi")]},
        "models": {"sim-model": {"prompts": {
            "Where to?": [{"content": "unused"}, {"content": "Paris, please."}, {"content": f"Thanks! {STOP}"}],
            "ok": [{"content": "more please", "reasoning": "they should do more"}],
            "Done.": [{"content": "   "}]}}}})
    done = inline.run(*inline.args(server, user_model="sim-model", max_user_turns=2, num_workers=1))
    assert done.returncode == 0, done.stderr
    rows = _rows(inline.run_dir())

    trip = rows["plan a trip"]
    humans = [t for t in trip["conversations"] if t["from"] == "human"]
    assert [(t["value"], t.get("simulated")) for t in humans] == [("plan a trip", None), ("Paris, please.", True)]
    assert set(humans[1]) == {"from", "value", "message", "simulated"}  # the seed's keys, and the mark
    assert trip["conversations"][-1]["value"].endswith("The plan.") and STOP not in json.dumps(trip["conversations"])
    assert trip["metadata"]["episode"] == {"ended": "user_stop", "user_turns": 1, "user_model": "sim-model"}
    assert trip["completed"] and trip["metadata"]["side_usage"]["user"]["api_calls"] == 2

    forever = rows["chat forever"]
    assert [t["value"] for t in forever["conversations"] if t.get("simulated")] == ["more please"] * 2  # no thoughts
    assert forever["metadata"]["episode"]["ended"] == "max_user_turns"
    assert forever["metadata"]["side_usage"]["user"]["api_calls"] == 2  # the third turn is never asked for
    assert rows["say nothing"]["metadata"]["episode"]["ended"] == "user_empty"
    assert "episode" not in rows["no user"]["metadata"] and "side_usage" not in rows["no user"]["metadata"]
    assert rows["no user"]["metadata"].keys() == _metadata_keys_without_a_simulator(inline, server)

    # the simulator sees its own turns as `assistant`, the agent's texts as `user`; no tools, no tool results
    sim = [r["body"] for r in _sim_requests(server) if r["prompt"] == "Where to?"]
    assert [m["role"] for m in sim[1]["messages"]] == ["system", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in sim[1]["messages"][1:]] == ["plan a trip", "Where to?", "Paris, please.", "The plan."]
    assert "a busy parent" in sim[0]["messages"][0]["content"] and "tools" not in sim[0]
    assert all(m["role"] != "tool" for m in sim[1]["messages"])

    stats = json.loads((inline.run_dir() / "statistics.json").read_text())
    simulator = stats["user_simulator"]
    assert (simulator["calls"], simulator["episodes"], simulator["user_turns"]) == (5, 3, 3)
    assert simulator["ended_by"] == {"user_stop": 1, "max_user_turns": 1, "user_empty": 1}
    assert simulator["tokens"] == {"prompt": 50, "completion": 25, "reasoning": 0}  # the scripted 10 + 5 per call
    assert stats["api_calls"] == 3 + 3 + 1 + 1  # the agent's calls alone
    assert stats["tokens"] == {"prompt": 80 + 50, "completion": 40 + 25, "reasoning": 0}  # all the run paid
    shown_rows = dict(console.overview_rows(stats))
    assert sorted(shown_rows["episodes ended by"].split(", ")) == ["max_user_turns 1", "user_empty 1", "user_stop 1"]
    assert shown_rows["simulated user: calls, tokens, cost"] == "5, 50 / 25 / 0, n/a"

    # the viewer and the report: the same numbers, simulated turns marked apart from the dataset's prompt
    index = RunIndex(inline.run_dir())
    index.refresh()
    assert summarize(index).stats["user_simulator"] == simulator
    (entry,) = [e for e in index.entries if e.key == trip["metadata"]["prompt_key"]]
    shown = view(entry, index.read(entry), read_filtering(inline.run_dir(), index), inline.run_dir())
    assert [(t["text"], t.get("simulated")) for t in shown["turns"] if t["role"] == "human"] == [
        ("plan a trip", None), ("Paris, please.", True)]
    assert shown["row"]["episode ended"] == "user_stop" and shown["row"]["simulated user"] == "sim-model"

    # in every export a simulated turn is the user's: never trained on as the assistant's output
    assert inline.run("--export=openai", "--run_name=run").returncode == 0
    (exported,) = [r for r in read_jsonl(inline.run_dir() / "export_openai.jsonl")
                   if r["messages"][1]["content"] == "plan a trip"]
    assert [m["content"] for m in exported["messages"] if m["role"] == "user"] == ["plan a trip", "Paris, please."]


def _metadata_keys_without_a_simulator(inline, server) -> set[str]:
    """A row's metadata keys in a run without --user_model, whose rows name a user all the same."""
    write_jsonl(inline.cwd / "plain.jsonl", [{"prompt": "no user"}, {"prompt": "say nothing", "user": "be silent"}])
    done = inline.run(*inline.args(server, run_name="plain", dataset_file="plain.jsonl"))
    assert done.returncode == 0, done.stderr
    assert "1 sample(s) name a simulated user" in done.stderr
    rows = _rows(inline.run_dir("plain"))
    assert "episode" not in rows["say nothing"]["metadata"] and len(rows["say nothing"]["conversations"]) == 3
    return rows["no user"]["metadata"].keys()


def test_a_resume_pays_for_no_user_turn_twice(inline, scripted_server):
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "fix it", "user": "insist once"}])
    agent = [think("Fixed."), {"status": 400, "error": "context too long"}]
    server = scripted_server({"prompts": {"fix it": agent},
                              "models": {"sim-model": {"prompts": {"Fixed.": [{}, {"content": "Are you sure?"},
                                                                              {"content": STOP}]}}}})
    args = inline.args(server, user_model="sim-model", num_workers=1, max_retries=0)
    first = inline.run(*args)
    assert first.returncode == 1
    (failure,) = read_jsonl(inline.run_dir() / "failures.jsonl")
    assert failure["error_class"] == "BadRequestError"
    assert failure["usage"]["prompt_tokens"] == 20  # the agent's call and the simulator's: all it paid
    assert len(_sim_requests(server)) == 1  # the follow-up was paid for, then the agent's answer to it failed
    server.set_script({"prompts": {"fix it": [think("Fixed."), think("Yes, sure.")]},
                       "models": {"sim-model": {"prompts": {"Fixed.": [{}, {"content": "Are you sure?"},
                                                                       {"content": STOP}]}}}})
    again = inline.run(*args, "--resume")
    assert again.returncode == 0, again.stderr
    asked = Counter(len(r["body"]["messages"]) for r in _sim_requests(server))
    assert asked == {3: 1, 5: 1}  # the first follow-up came from the journal: only the stop was asked for
    row = _rows(inline.run_dir())["fix it"]
    assert row["metadata"]["episode"]["ended"] == "user_stop"
    assert row["metadata"]["side_usage"]["user"]["replayed"]["turns"] == 1


def test_a_user_field_of_the_wrong_type_is_a_dataset_error_before_any_request(inline, scripted_server):
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "a"}, {"prompt": "b", "user": ["not", "this"]},
                                               {"prompt": "c", "user": {"mood": "grumpy"}}])
    server = scripted_server({})
    done = inline.run(*inline.args(server, user_model="sim-model"))
    assert done.returncode == 2
    assert "prompts.jsonl:2: field 'user' must be a string or an object of persona, goal, instructions" in done.stderr
    assert "prompts.jsonl:3: field 'user' has 'mood', not one of persona, goal, instructions" in done.stderr
    assert server.requests() == []


def test_an_unreachable_simulator_stops_the_run_at_once_naming_its_flag(inline, scripted_server):
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}", "user": "u"} for i in range(6)])
    server = scripted_server({"default": [think("answer")]})
    done = inline.run(*inline.args(server, user_model="sim-model", user_base_url="http://127.0.0.1:9/v1",
                                   num_workers=1, concurrency=1))
    assert done.returncode != 0
    assert "--user_base_url=http://127.0.0.1:9/v1 cannot be reached" in done.stderr
    assert len(server.requests()) < 6  # stopped at once, not a failure per prompt
