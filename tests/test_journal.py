"""Never pay for a reply twice: kill -9 mid-conversation, resume, and count at the scripted server.

Multi-turn prompts whose tools are deterministic; the kill points are made exact by gated
replies (held by the server until the test opens them). Plus the request hash, and the
opt-in cross-run cache."""
from __future__ import annotations

import json
import os
import subprocess
from collections import Counter

import orjson
import pytest

from tests.conftest import kill_group, read_jsonl, think, write_jsonl
from tests.support.inline import interrupt, stopped_if_it_hangs, when
from tests.test_hardening import _asked, _wait_for
from trajgen import journal, resume_scan, store
from trajgen.chat_calls import request_args
from trajgen.errors import MalformedResponse
from trajgen.messages import Finished, Replied, without_landed_replies
from trajgen.model import Reply
from trajgen.outcome import PromptOutcome, Status
from trajgen.task import ModelSettings

GATED = {"p1": (1, "kill1"), "p3": (2, "kill1"), "p2": (3, "kill2")}  # prompt -> (turn held, gate)
PROMPTS = [f"p{i}" for i in range(6)]


def _turn(command: str, call_id: str, gate: str | None = None) -> dict:
    reply = {"tool_calls": [{"name": "terminal", "arguments": {"command": command}, "id": call_id}],
             "reasoning": "a tool", "usage": {"cost": 0.01}}
    return {**reply, "gate": gate} if gate else reply


def _script() -> dict:
    """Three deterministic tool turns, then an answer; some turns held at a gate."""
    prompts = {}
    for name in PROMPTS:
        replies = [_turn(f"echo {name} {t}", f"{name}-c{t}") for t in range(3)] + [{**think(f"{name} done"), "usage": {"cost": 0.01}}]
        if name in GATED:
            turn, gate = GATED[name]
            replies[turn] = {**replies[turn], "gate": gate}
        prompts[name] = replies
    return {"prompts": prompts}


def _landed(run_dir) -> set[str]:
    torn: list[str] = []
    return {store.row_key(r) for _, p in store.batch_files(run_dir) for r in store.read_records(p, torn)}


def _journaled(run_dir) -> Counter:
    """Journal entries per prompt key, of prompts that have not landed."""
    landed = _landed(run_dir)
    return Counter(e["key"] for e in store.read_records(run_dir / store.JOURNAL, []) if e["key"] not in landed)


def _comparable(run_dir) -> tuple[list[dict], dict]:
    """Rows and statistics without what differs between any two runs: timing, batch numbers, the replay count."""
    rows = sorted(read_jsonl(run_dir / "trajectories.jsonl"), key=lambda r: (r["conversations"][1]["value"], r["prompt_index"]))
    for row in rows:
        meta = row["metadata"]
        for name in ("timestamp", "batch_num", "latency"):
            meta.pop(name)
        meta["usage"].pop("wall_seconds")
        meta["usage"].pop("replayed")
    stats = json.loads((run_dir / "statistics.json").read_text())
    for name in ("run_name", "duration_seconds", "duration_seconds_total", "total_batches", "generated_at", "merged_from",
                 "latency"):
        stats.pop(name, None)
    return rows, stats


def test_kill_9_mid_conversation_then_resume_pays_no_reply_twice(cli, scripted_server):
    server = scripted_server(_script())
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": n} for n in PROMPTS])
    args = cli.args(server, batch_size=2, concurrency=8)
    held_at = {(name, turn) for name, (turn, _) in GATED.items()}

    # kill 1: three prompts held at turns 1, 2 and 3, their earlier replies journaled; the rest landed
    first = cli.start(*args)
    _wait_for(lambda: held_at <= set(_asked(server)) and len(_landed(cli.run_dir())) == 3
              and sorted(_journaled(cli.run_dir()).values()) == [1, 2, 3])
    kill_group(first)
    asked_first = _asked(server)
    assert all(n == 1 for n in asked_first.values())

    # kill 2: p1 and p3 go on from their held turn and land; p2 replays three turns and is held again
    server.open_gate("kill1")
    second = cli.start(*args, "--resume")
    _wait_for(lambda: _asked(server)[("p2", 3)] == 2 and len(_landed(cli.run_dir())) == 5)
    kill_group(second)

    server.open_gate("kill2")
    done = cli.run(*args, "--resume")
    assert done.returncode == 0, done.stderr
    asked = _asked(server)
    # every reply that had arrived was asked for once; only the held requests were sent again
    expected = Counter({(name, turn): 1 for name in PROMPTS for turn in range(4)})
    expected.update({("p1", 1): 1, ("p3", 2): 1, ("p2", 3): 2})
    assert asked == expected
    rows = read_jsonl(cli.run_dir() / "trajectories.jsonl")
    assert sorted(r["conversations"][1]["value"] for r in rows) == PROMPTS
    replayed = {r["conversations"][1]["value"]: r["metadata"]["usage"]["replayed"]["turns"] for r in rows}
    assert replayed == {"p0": 0, "p4": 0, "p5": 0, "p1": 1, "p3": 2, "p2": 3}
    assert not (cli.run_dir() / store.JOURNAL).read_bytes()  # every prompt landed: nothing left in flight

    # the same rows, usage and statistics as a run that was never interrupted
    clean = cli.run(*cli.args(server, run_name="clean", batch_size=2, concurrency=8))
    assert clean.returncode == 0, clean.stderr
    assert _comparable(cli.run_dir()) == _comparable(cli.run_dir("clean"))


def test_a_changed_tool_result_continues_live_from_the_first_differing_request(inline, scripted_server):
    # the first tool call outlives --command_timeout=1 on resume: its result, and every request after it, differ
    server = scripted_server({"prompts": {"p": [
        _turn("sleep 2 && echo slow", "c0"), _turn("echo one", "c1"), _turn("echo two", "c2", gate="held"),
        think("done")]}})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "p"}])
    held = lambda: _asked(server)[("p", 2)] == 1 and sum(_journaled(inline.run_dir()).values()) == 2  # noqa: E731
    with when(held, interrupt):
        first = inline.run(*inline.args(server, command_timeout=60))
    assert first.returncode == 130, first.stderr
    before = server.requests()
    server.open_gate("held")
    done = inline.run(*inline.args(server, command_timeout=1, resume=True))
    assert done.returncode == 0, done.stderr
    resumed = server.requests()[len(before):]
    assert [r["turn"] for r in resumed] == [1, 2, 3]  # turn 0 replayed, the rest sent for real
    tool_result = [m for m in resumed[0]["body"]["messages"] if m["role"] == "tool"][0]["content"]
    assert "slow" not in tool_result and "slow" in [m for m in before[1]["body"]["messages"] if m["role"] == "tool"][0]["content"]
    row = read_jsonl(inline.run_dir() / "trajectories.jsonl")[0]
    assert row["metadata"]["usage"]["replayed"]["turns"] == 1 and row["api_calls"] == 4


def test_the_cache_answers_a_second_run_without_a_call(inline, scripted_server, tmp_path):
    server = scripted_server(_script() | {"prompts": {n: r for n, r in _script()["prompts"].items() if n not in GATED}})
    names = [n for n in PROMPTS if n not in GATED] + ["p0"]  # a prompt repeated for another sample pays for its own
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": n} for n in names])
    cache = tmp_path / "cache"
    assert inline.run(*inline.args(server, cache_dir=cache)).returncode == 0
    paid = len(server.requests())
    assert paid == 4 * len(names)
    again = inline.run(*inline.args(server, run_name="again", cache_dir=cache))
    assert again.returncode == 0, again.stderr
    assert len(server.requests()) == paid
    assert _comparable(inline.run_dir()) == _comparable(inline.run_dir("again"))
    changed = inline.run(*inline.args(server, run_name="hotter", cache_dir=cache, temperature=0.5))
    assert changed.returncode == 0 and len(server.requests()) == 2 * paid  # another setting: nothing reused


def test_the_request_hash_covers_everything_that_changes_the_reply():
    settings = ModelSettings("m", "http://127.0.0.1:1/v1", "key", system_prompt="s")
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "terminal", "parameters": {}}}]
    base = journal.request_hash(request_args(settings, messages, tools, False))
    elsewhere = ModelSettings("m", "http://127.0.0.1:2/v1", "other key", system_prompt="s")
    assert base == journal.request_hash(request_args(elsewhere, [dict(m) for m in messages], tools, False))
    variants = [
        (ModelSettings("m2", "", "key"), messages, tools, False),
        (ModelSettings("m", "", "key", temperature=0.5), messages, tools, False),
        (ModelSettings("m", "", "key", extra_body={"provider": {"order": ["a"]}}), messages, tools, False),
        (settings, [{"role": "system", "content": "t"}, messages[1]], tools, False),
        (settings, messages, [{"type": "function", "function": {"name": "terminal", "parameters": {"x": 1}}}], False),
        (settings, messages, tools, True),
    ]
    assert len({base, *(journal.request_hash(request_args(*v)) for v in variants)}) == 1 + len(variants)


def test_compaction_drops_landed_prompts_and_keeps_failed_ones_for_resume(tmp_path):
    writer = store.Writer(tmp_path)
    for key in ("landed", "discarded", "failed", "in flight"):
        writer.journal({"key": key, "turn": 0, "hash": "h", "message": {"content": key}, "usage": {}})
    writer.row(0, "landed", orjson.Fragment(orjson.dumps({"metadata": {"prompt_key": "landed"}})))
    writer.discarded({"prompt_key": "discarded", "reason": "no reasoning"})
    writer.failed({"prompt_key": "failed", "error_class": "InternalServerError"})
    writer.end_batch(0)
    writer.journal({"key": "in flight", "turn": 1, "hash": "h2", "message": {"content": "later"}, "usage": {}})
    with open(tmp_path / store.JOURNAL, "ab") as f:
        f.write(b'{"key": "torn", "tu')  # as kill -9 mid-append leaves it
    writer.close({})
    on_disk = [e["key"] for e in store.read_records(tmp_path / store.JOURNAL, [])]
    assert on_disk == ["failed", "in flight", "in flight"]  # the landed and the discarded prompt's entries are gone
    assert resume_scan.scan(tmp_path).journal == {
        "failed": [{"key": "failed", "turn": 0, "hash": "h", "message": {"content": "failed"}, "usage": {}}],
        "in flight": [{"key": "in flight", "turn": t, "hash": h, "message": {"content": c}, "usage": {}}
                      for t, h, c in ((0, "h", "in flight"), (1, "h2", "later"))]}


def test_a_reply_travelling_with_its_landed_outcome_is_not_journaled_and_a_failed_prompts_reply_is():
    def replied(key: str) -> Replied:
        return Replied(key, 0, "h", Reply({"content": key}))

    def finished(key: str, status: Status) -> Finished:
        return Finished(PromptOutcome(key, 0, 0, status))

    events = [replied("ok"), replied("discarded"), replied("failed"), replied("in flight"),
              finished("ok", Status.OK), finished("discarded", Status.DISCARDED), finished("failed", Status.FAILED)]
    assert without_landed_replies(events) == [replied("failed"), replied("in flight"), *events[4:]]


def test_prompts_that_land_without_journal_entries_leave_no_state_behind(tmp_path):
    """Most prompts land with their last reply and have no entry: the writer must not keep their
    keys until a compaction that a journal which does not grow never triggers (10 MB at 100,000 prompts)."""
    writer = store.Writer(tmp_path)
    writer.journal({"key": "k0", "turn": 0, "hash": "h", "message": {"content": "k0"}, "usage": {}})
    for i in range(1000):
        writer.row(i // 10, f"k{i}", orjson.Fragment(orjson.dumps({"metadata": {"prompt_key": f"k{i}"}})))
    assert writer.replies.landed == {"k0"}  # the one with an entry, whose entry the next compaction drops
    writer.close({})
    assert list(store.read_records(tmp_path / store.JOURNAL, [])) == []


def test_a_settled_batch_file_is_read_by_the_prefix_store_writes_whatever_the_rows_key_order(tmp_path):
    """The resume scan reads a settled file's keys from the start of each line: store puts them there."""
    writer = store.Writer(tmp_path)
    for i, key in enumerate(("a", "b")):
        row = {"conversations": [], "metadata": {"model": "m", "prompt_key": key}, "prompt_index": i}
        assert store.ROW_START.match(store.encode_row(row)).group(1) == key.encode()
        writer.row(0, key, orjson.Fragment(store.encode_row(row)))
    writer.end_batch(0)
    writer.close({})
    assert store.settled(tmp_path) == {0}
    assert list(store.row_keys(tmp_path, [])) == ["a", "b"]
    assert [r["metadata"] for r in store.read_records(tmp_path / "batch_0.jsonl", [])] == [
        {"prompt_key": "a", "model": "m"}, {"prompt_key": "b", "model": "m"}]


def test_one_reply_larger_than_the_cache_is_not_stored_and_the_others_stay(inline, scripted_server, tmp_path):
    big = "x" * (3 * 2**19)  # 1.5 MB: larger than the whole cache of --cache_max_mb=1
    server = scripted_server({"default": [think()], "prompts": {"big": [think(big)]}})
    names = ["big", *(f"small {i}" for i in range(8))]
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": n} for n in names])
    cache = tmp_path / "cache"
    first = inline.run(*inline.args(server, cache_dir=cache, cache_max_mb=1))
    assert first.returncode == 0, first.stderr
    assert first.stderr.count("larger than the whole cache (--cache_max_mb=1)") == 1  # two workers, said once
    assert len(list(cache.glob("??/*.json"))) == 8
    again = inline.run(*inline.args(server, run_name="again", cache_dir=cache, cache_max_mb=1))
    assert again.returncode == 0, again.stderr
    assert [r["prompt"] for r in server.requests()[len(names):]] == ["big"]  # the small replies came from the cache


def test_the_trim_deletes_the_least_recently_used_entries_down_to_the_limit(tmp_path):
    cache = journal.Cache(str(tmp_path), max_mb=2.5)
    reply = Reply({"role": "assistant", "content": "x" * 2**20}, {"prompt_tokens": 1, "completion_tokens": 1}, {})
    for age, key in enumerate(["newest", "used", "old", "oldest"]):
        cache.put(key, "h", reply)
        os.utime(cache.path(key, "h"), (1e9 - age, 1e9 - age))
    too_large = cache.path("stored under a larger limit", "h")
    too_large.parent.mkdir(exist_ok=True)
    too_large.write_bytes(b"x" * 3 * 2**20)
    assert cache.get("old", "h") is not None  # a use makes it the most recent
    cache.trim()
    assert sorted(p.name for p in tmp_path.glob("??/*.json")) == sorted(cache.path(k, "h").name for k in ("newest", "old"))


def test_a_read_only_cache_is_used_and_said_once_not_refused(inline, scripted_server, tmp_path):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(6)])
    cache = tmp_path / "cache"
    cache.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(cache)], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.strip()}")
    try:
        done = inline.run(*inline.args(server, cache_dir=cache))
    finally:
        subprocess.run(["umount", "-l", str(cache)], check=True)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count(f"--cache_dir {cache} cannot be written (Read-only file system)") == 1
    assert len(read_jsonl(inline.run_dir() / "trajectories.jsonl")) == 6


def test_an_unreadable_journal_line_is_said_once_and_its_reply_asked_again(inline, scripted_server):
    refused = {"status": 400, "error": "refused", "times": 1, "then": think()}
    server = scripted_server({"default": [_turn("echo a", "a-c0"), refused]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    failed = inline.run(*inline.args(server))
    assert failed.returncode == 1, failed.stderr  # each prompt failed after one paid reply, which is journaled
    entries = (inline.run_dir() / store.JOURNAL).read_bytes().splitlines(keepends=True)
    assert len(entries) == 2
    (inline.run_dir() / store.JOURNAL).write_bytes(b"not json\n" + entries[1] + entries[0][:40])  # damaged, kept, torn
    before = len(server.requests())
    resumed = inline.run(*inline.args(server, resume=True))
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.count("journal.jsonl has 2 unreadable line(s)") == 1
    assert "will be asked for, and paid for, again" in resumed.stderr
    asked = sorted((r["prompt"], r["turn"]) for r in server.requests()[before:])
    kept = {f["prompt_key"]: "ab"[f["prompt_index"]] for f in read_jsonl(inline.run_dir() / "failures.jsonl")}[
        json.loads(entries[1])["key"]]
    damaged = ({"a", "b"} - {kept}).pop()
    assert asked == sorted([(damaged, 0), (damaged, 1), (kept, 1)])


DAMAGE = {  # a prompt -> how its cached reply is damaged
    "content a number": lambda entry: entry["message"].update(content=42),
    "usage null": lambda entry: entry.update(usage=None),
    "tool calls a string": lambda entry: entry["message"].update(tool_calls="zzz"),
    "reasoning details a number": lambda entry: entry["message"].update(reasoning_details=5),
}


def test_a_damaged_cache_entry_is_deleted_said_once_and_asked_of_the_endpoint(inline, scripted_server, tmp_path):
    names = [*DAMAGE, "sound", "torn"]
    server = scripted_server({"prompts": {n: [think(n)] for n in names}})  # each cached reply names its prompt
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": n} for n in names])
    cache = tmp_path / "cache"
    assert inline.run(*inline.args(server, cache_dir=cache)).returncode == 0
    entries = {orjson.loads(path.read_bytes())["message"]["content"]: path for path in cache.glob("??/*.json")}
    for name, damage in DAMAGE.items():
        entry = orjson.loads(entries[name].read_bytes())
        damage(entry)
        entries[name].write_bytes(orjson.dumps(entry))
    entries["torn"].write_bytes(entries["torn"].read_bytes()[:30])

    with stopped_if_it_hangs():
        again = inline.run(*inline.args(server, run_name="again", cache_dir=cache))
    assert again.returncode == 0, again.stderr  # 130 would be a hang, stopped
    assert again.stderr.count("a damaged entry was deleted and its reply asked of the endpoint") == 1  # two workers
    assert sorted(r["prompt"] for r in server.requests()[len(names):]) == sorted([*DAMAGE, "torn"])
    for path in cache.glob("??/*.json"):  # each damaged entry replaced by the reply asked again
        journal.replayed(orjson.loads(path.read_bytes()))
    third = inline.run(*inline.args(server, run_name="third", cache_dir=cache))
    assert third.returncode == 0, third.stderr
    assert len(server.requests()) == len(names) + len(DAMAGE) + 1  # every reply from the cache
    assert _comparable(inline.run_dir()) == _comparable(inline.run_dir("third"))


def test_a_damaged_journal_entry_is_asked_again_once(inline, scripted_server):
    refused = {"status": 400, "error": "refused", "times": 1, "then": think()}
    server = scripted_server({"default": [_turn("echo a", "a-c0"), refused]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "a"}])
    failed = inline.run(*inline.args(server))
    assert failed.returncode == 1, failed.stderr  # failed after one paid reply, which is journaled
    [entry] = read_jsonl(inline.run_dir() / store.JOURNAL)
    entry["message"]["content"] = 42  # a line that parses, with a reply that is not one
    write_jsonl(inline.run_dir() / store.JOURNAL, [entry])
    with stopped_if_it_hangs():
        resumed = inline.run(*inline.args(server, resume=True))
    assert resumed.returncode == 0, resumed.stderr  # 130 would be a hang, stopped
    assert resumed.stderr.count("journal.jsonl holds a damaged reply of prompt") == 1
    assert _asked(server) == Counter({("a", 0): 2, ("a", 1): 2})
    assert read_jsonl(inline.run_dir() / "trajectories.jsonl")[0]["metadata"]["usage"]["replayed"]["turns"] == 0


@pytest.mark.parametrize("damage", [*DAMAGE.values(), lambda entry: entry["message"].update(reasoning=[1]),
                                    lambda entry: entry.update(timing={"first_byte": "soon"}),
                                    lambda entry: entry.update(message=["a list"]), lambda entry: entry.clear()],
                         ids=[*DAMAGE, "reasoning a list", "timing not seconds", "message a list", "empty"])
def test_a_stored_reply_is_checked_as_a_live_one_is(damage):
    reply = Reply({"role": "assistant", "content": None, "reasoning": "r",
                   "tool_calls": [{"id": "c", "type": "function", "function": {"name": "terminal", "arguments": "{}"}}]},
                  {"prompt_tokens": 3, "completion_tokens": 2, "reasoning_tokens": 1, "cost": 0.5},
                  {"model": "m"}, {"first_byte": 0.1})
    record = orjson.loads(orjson.dumps(journal.entry(Replied("k", 0, "h", reply))))
    assert journal.replayed(record) == reply
    assert journal.replayed({**record, "usage": {}}).usage == {}  # a reply that reported no usage
    damage(record)
    with pytest.raises(MalformedResponse):
        journal.replayed(record)
