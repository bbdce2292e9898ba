"""Never crash, never pay twice: a run in use, torn/corrupt/missing files, a full disk, outages,
odd replies from the endpoint, and a resume hint without the key. Whole runs in process
(tests/support/inline.py) against the loopback scripted server, and the real CLI where a runner
must be another process (one that holds the run, one killed with -9); the full disk is a real tmpfs."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import socket
import ssl
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import call, kill_group, read_jsonl, think, write_jsonl
from tests.support.inline import when
from trajgen import chat_calls, errors, store
from trajgen.options import RunOptions
from trajgen.sandbox import cgroups
from trajgen.task import ModelSettings


def _prompts(rows: list[dict]) -> list[str]:
    return [r["conversations"][1]["value"] for r in rows]


def _asked(server) -> Counter:
    """How often each (prompt, turn) reached the server."""
    return Counter((r["prompt"], r["turn"]) for r in server.requests())


def _wait_for(predicate, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"not reached within {timeout} s")


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr and "JSONDecodeError" not in result.stderr, result.stderr
    return result.stderr


# ---------------------------------------------------------------- one runner per run directory


def test_second_runner_on_a_run_directory_is_refused_and_nothing_is_paid_twice(cli, inline, scripted_server):
    """The first runner is the real CLI, in a process of its own; the second ones run in this process."""
    server = scripted_server({"prompts": {"held": [{**think(), "gate": "held"}]}, "default": [think()]})
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": "done"}])
    assert inline.run(*inline.args(server)).returncode == 0  # a finished run, so that --export has one to export
    names = ["done", "held", *(f"prompt {i}" for i in range(30))]
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": n} for n in names])
    first = cli.start(*cli.args(server, concurrency=4, resume=True))
    try:
        _wait_for(lambda: server.stats()["requests"] == len(names))  # all asked; "held" keeps the run going
        refused = [inline.run(*inline.args(server, concurrency=4, **{flag: True})) for flag in ("resume", "overwrite")]
        for second in [*refused, inline.run("--export=openai", "--run_name=run")]:
            assert second.returncode == 2, second.stderr
            assert "data/run is in use" in second.stderr and f"pid {first.pid}" in second.stderr
            assert len(_one_line_error(second).strip().splitlines()) == 1
        server.open_gate("held")
        assert first.wait(timeout=120) == 0
    finally:
        if first.poll() is None:
            kill_group(first)
    assert set(_asked(server).values()) == {1}
    assert sorted(_prompts(read_jsonl(cli.run_dir() / "trajectories.jsonl"))) == sorted(names)


def test_lock_dies_with_its_holder(cli, inline, scripted_server):
    server = scripted_server({"default": [{**think(), "delay": 0.3}]})
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(20)])
    first = cli.start(*cli.args(server, concurrency=2))
    _wait_for(lambda: server.stats()["requests"] > 0)
    kill_group(first)
    done = inline.run(*inline.args(server, resume=True))
    assert done.returncode == 0, done.stderr
    assert len(read_jsonl(cli.run_dir() / "trajectories.jsonl")) == 20


# ---------------------------------------------------------------- torn, corrupt, missing files


def test_append_after_a_torn_side_record_starts_on_a_fresh_line(inline, scripted_server):
    cut = {"tool_calls": [{"name": "terminal", "arguments": '{"command": "ec'}], "finish_reason": "length"}
    server = scripted_server({"prompts": {"bad": [{"status": 400}]}, "default": [cut]})  # a discard: truncated
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "bad"}, {"prompt": "plain"}])
    assert inline.run(*inline.args(server)).returncode == 1
    for name in (store.DISCARDED, store.FAILURES):  # as kill -9 or a full disk mid-append leaves them
        with open(inline.run_dir() / name, "a") as f:
            f.write('{"prompt_key": "torn", "rea')
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "bad"}, {"prompt": "plain"}, {"prompt": "plain 2"}])
    resumed = inline.run(*inline.args(server, resume=True))
    assert resumed.returncode == 1, resumed.stderr
    assert "torn" in resumed.stderr
    stats = json.loads((inline.run_dir() / "statistics.json").read_text())
    assert stats["discarded"]["total"] == 2 and stats["failed"]["by_class"] == {"BadRequestError": 1}
    before = len(server.requests())
    assert inline.run(*inline.args(server, resume=True)).returncode == 1
    assert [r["prompt"] for r in server.requests()[before:]] == ["bad"]  # "plain 2"'s discard was not swallowed


@pytest.mark.parametrize("name, content", [("checkpoint.json", ""), ("statistics.json", "{not json")])
def test_unreadable_checkpoint_or_statistics_is_rebuilt_from_the_rows(inline, scripted_server, name, content):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(4)])
    assert inline.run(*inline.args(server, batch_size=2)).returncode == 0
    (inline.run_dir() / name).write_text(content)
    before = len(server.requests())
    resumed = inline.run(*inline.args(server, batch_size=2, resume=True))
    assert resumed.returncode == 0, resumed.stderr
    assert f"{name} is unreadable" in _one_line_error(resumed)
    assert len(server.requests()) == before
    assert json.loads((inline.run_dir() / name).read_text())["run_name"] == "run"
    assert json.loads((inline.run_dir() / "statistics.json").read_text())["ok"] == 4


def test_unreadable_manifest_says_to_force_and_export_names_it(inline, scripted_server):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "a"}])
    assert inline.run(*inline.args(server)).returncode == 0
    manifest = inline.run_dir() / "manifest.json"
    manifest.write_text("")
    refused = inline.run(*inline.args(server, resume=True))
    assert refused.returncode == 2
    assert "manifest.json is unreadable (empty)" in _one_line_error(refused) and "--force" in refused.stderr
    exported = inline.run("--export=openai", "--run_name=run")
    assert exported.returncode == 2 and "manifest.json is unreadable" in _one_line_error(exported)
    forced = inline.run(*inline.args(server, resume=True, force=True))
    assert forced.returncode == 0, forced.stderr
    assert json.loads(manifest.read_text())["model"] == "test-model"


def test_deleted_batch_file_runs_its_prompts_again_and_says_so(inline, scripted_server):
    server = scripted_server({"default": [think()]})
    names = [f"p{i}" for i in range(6)]
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": n} for n in names])
    assert inline.run(*inline.args(server, batch_size=2)).returncode == 0
    lost = set(_prompts(read_jsonl(inline.run_dir() / "batch_1.jsonl")))
    (inline.run_dir() / "batch_1.jsonl").unlink()
    before = len(server.requests())
    resumed = inline.run(*inline.args(server, batch_size=2, resume=True))
    assert resumed.returncode == 0, resumed.stderr
    assert "batch_1.jsonl" in resumed.stderr and "run again" in resumed.stderr
    assert {r["prompt"] for r in server.requests()[before:]} == lost
    assert sorted(_prompts(read_jsonl(inline.run_dir() / "trajectories.jsonl"))) == names


# ---------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs (needs root); unmounted at the end."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def _filler(path: Path, leave: int) -> None:
    """Take all the free space of `path`'s file system but about `leave` bytes."""
    stat = os.statvfs(path.parent)
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, stat.f_bavail * stat.f_frsize - leave)


# 60 rows of about 13.5 KB: the run needs them and up to store.COMPACT_AT of journal; the merge, the rows twice
@pytest.mark.parametrize("room, full_at", [(300_000, ("batch_", "journal.jsonl")), (1_300_000, ("trajectories.jsonl",))],
                         ids=["during-the-run", "during-the-merge"])  # during the run, a row or a reply's journal entry
def test_full_disk_stops_keeps_every_row_and_resume_finishes(inline, scripted_server, small_disk, room, full_at):
    server = scripted_server({"default": [think("x" * 4_000)]})  # rows of about 12 KB (the answer is in `value` and `message`)
    names = [f"prompt {i}" for i in range(60)]
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": n} for n in names])
    filler = small_disk / "filler"
    _filler(filler, room)
    flags = {"output_dir": str(small_disk / "out"), "concurrency": 4, "batch_size": 5}
    full = inline.run(*inline.args(server, **flags))
    assert full.returncode == 1, full.stderr
    assert "no space left" in _one_line_error(full) and "--resume" in full.stderr and "dummy-key" not in full.stderr
    run_dir = small_disk / "out" / "run"
    assert any(f"writing {run_dir}/{name}" in full.stderr for name in full_at)
    landed = {p for path in run_dir.glob("batch_*.jsonl") for p in _prompts(list(store.read_records(path, [])))}
    assert (len(landed) == 60) == ("trajectories.jsonl" in full_at) and landed
    asked_before = _asked(server)
    filler.unlink()
    resumed = inline.run(*inline.args(server, **flags, resume=True))
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(_prompts(read_jsonl(run_dir / "trajectories.jsonl"))) == sorted(names)
    asked_again = {prompt for prompt, _ in _asked(server) - asked_before}
    assert not asked_again & landed
    assert json.loads((run_dir / "statistics.json").read_text())["kept"] == 60


# ---------------------------------------------------------------- a run directory turned read-only


def _chattr(flag: str, paths: list[Path]) -> None:
    changed = subprocess.run(["chattr", flag, *map(str, paths)], capture_output=True, text=True)
    if changed.returncode:
        pytest.skip(f"cannot chattr {flag} here: {changed.stderr.strip()}")


@pytest.mark.parametrize("what", ["directory", "every file"])
def test_a_run_directory_turned_read_only_stops_with_the_resume_line_and_loses_nothing(inline, scripted_server, what):
    """chattr +i, as root ignores file modes. On the directory, no file can be made in it while the open ones
    still take appends: what chmod does to a runner that is not root. On every file too, nothing can be written:
    a read-only file system, where the replies that arrive after the change cannot be kept (they are paid again)."""
    held, free = [f"p{i}" for i in range(4, 8)], [f"p{i}" for i in range(4)]
    turns = lambda name: [{"tool_calls": [{"name": "terminal", "arguments": {"command": f"echo {name} {t}"}}],  # noqa: E731
                           "reasoning": "a tool"} for t in range(2)] + [think(f"{name} done")]
    server = scripted_server({"prompts": {n: turns(n) for n in free} | {n: [t if i != 1 else {**t, "gate": "g"}
                                                                         for i, t in enumerate(turns(n))] for n in held}})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": n} for n in free + held])
    run_dir = inline.run_dir()

    def settled() -> bool:  # the free prompts landed (in the one batch file); the held ones journaled, at their gate
        if not run_dir.exists():
            return False
        landed = {store.row_key(r) for _, path in store.batch_files(run_dir) for r in store.read_records(path, [])}
        waiting = {e["key"] for e in store.read_records(run_dir / store.JOURNAL, []) if e["key"] not in landed}
        return len(landed) == len(free) and len(waiting) == len(held) and all((n, 1) in _asked(server) for n in held)

    def turn_read_only() -> None:
        _chattr("+i", [run_dir, *(run_dir.iterdir() if what == "every file" else [])])
        server.open_gate("g")

    try:
        with when(settled, turn_read_only):
            stopped = inline.run(*inline.args(server, batch_size=8))
    finally:
        _chattr("-i", [run_dir, *run_dir.iterdir()])
    assert stopped.returncode == 1, stopped.stderr
    assert f"operation not permitted writing {run_dir.relative_to(inline.cwd)}/" in _one_line_error(stopped)
    assert "a bug" not in stopped.stderr
    assert "make the run directory writable again, then resume with:" in stopped.stderr and "--resume" in stopped.stderr
    landed = {p for _, path in store.batch_files(run_dir) for p in _prompts(list(store.read_records(path, [])))}
    assert landed == set(free + held) if what == "directory" else landed == set(free)

    resumed = inline.run(*inline.args(server, batch_size=8, resume=True))
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(_prompts(read_jsonl(run_dir / "trajectories.jsonl"))) == free + held
    paid_twice = {key for key, n in _asked(server).items() if n > 1}  # the server answers every request it gets
    if what == "directory":
        assert not paid_twice
    else:  # only replies that arrived after the change, when nothing could keep them
        assert paid_twice and paid_twice <= {(n, t) for n in held for t in (1, 2)}, paid_twice


# ---------------------------------------------------------------- outages and odd replies


def test_a_20_s_429_storm_is_ridden_out_at_a_bounded_request_rate(inline, scripted_server):
    server = scripted_server({"outage": {"status": 429, "seconds": 20}, "default": [think()]})
    names = [f"prompt {i}" for i in range(64)]
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": n} for n in names])
    done = inline.run(*inline.args(server, concurrency=32, max_retries=None))
    assert done.returncode == 0, done.stderr
    assert sorted(_prompts(read_jsonl(inline.run_dir() / "trajectories.jsonl"))) == sorted(names)
    storm = [r for r in server.requests() if r["status"] == 429]
    start = storm[0]["t"]
    assert sum(1 for r in storm if r["t"] < start + 1.0) <= 32  # no retry in the first second
    assert len(storm) / 20 <= 16  # on average every prompt in flight waits at least 2 s between tries


def test_404_at_the_start_stops_the_run_and_a_later_one_fails_its_prompt(inline, scripted_server):
    server = scripted_server({"default": [{"status": 404, "error": "model not found"}]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(40)])
    stopped = inline.run(*inline.args(server, concurrency=4))
    assert stopped.returncode == 1
    assert f"--base_url={server.url} answered HTTP 404 (model or endpoint not found)" in _one_line_error(stopped)
    assert server.stats()["requests"] <= 8

    server.set_script({"prompts": {"late": [call("terminal", command="true"), {"status": 404}]},
                       "default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"q{i}"} for i in range(10)] + [{"prompt": "late"}])
    later = inline.run(*inline.args(server, run_name="later", concurrency=2, num_workers=1))
    assert later.returncode == 1, later.stderr
    failures = read_jsonl(inline.run_dir("later") / "failures.jsonl")
    assert [f["error_class"] for f in failures] == ["NotFoundError"]
    assert len(read_jsonl(inline.run_dir("later") / "trajectories.jsonl")) == 10


def test_error_object_in_a_200_and_bodies_that_are_not_completions(inline, scripted_server, monkeypatch):
    monkeypatch.setattr(chat_calls, "backoff", lambda previous: 0.05)  # which replies are retried, not how long after
    upstream = {"error": {"message": "Upstream provider returned 502", "code": 502}}
    server = scripted_server({"prompts": {
        "flaky": [{"body": upstream, "times": 2, "then": think()}],
        "refused": [{"body": {"error": {"message": "Provider refused the request", "code": 400}}}],
        "garbage": [{"body": "<html>bad gateway</html>"}],
        "empty": [{"body": {"id": "x", "choices": []}}],
        "nochoices": [{"body": {"id": "x"}}],
    }, "default": [think()]})
    prompts = ("flaky", "refused", "garbage", "empty", "nochoices", "fine")
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": p} for p in prompts])
    one_at_a_time = {"num_workers": 1, "concurrency": 1, "max_retries": 3}  # "flaky" is answered first
    done = inline.run(*inline.args(server, **one_at_a_time))
    assert done.returncode == 1, done.stderr
    assert sorted(_prompts(read_jsonl(inline.run_dir() / "trajectories.jsonl"))) == ["fine", "flaky"]
    assert _asked(server)[("flaky", 0)] == 3
    failures = {f["prompt_key"]: f for f in read_jsonl(inline.run_dir() / "failures.jsonl")}
    by_class = Counter(f["error_class"] for f in failures.values())
    assert by_class == {"MalformedResponse": 2, "NotJSON": 1, "ProviderError": 1}
    assert any("Provider refused the request" in f["message"] for f in failures.values())
    assert any(f["message"] == 'the reply is not JSON: an HTML page of 24 bytes' for f in failures.values())
    resumed = inline.run(*inline.args(server, resume=True, **one_at_a_time))
    assert resumed.returncode == 1 and _asked(server)[("flaky", 0)] == 3  # only the failed ones run again


NOT_IMPLEMENTED = ("<!DOCTYPE html><html><head><title>501 Not Implemented</title></head><body>" + "x" * 5000
                   + "</body></html>")


def test_an_endpoint_that_is_not_a_chat_endpoint_stops_the_run_at_once_naming_base_url(inline, scripted_server):
    server = scripted_server({"default": [{"status": 501, "body": NOT_IMPLEMENTED}]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(40)])
    stopped = inline.run(*inline.args(server, max_retries=10))
    assert stopped.returncode == 1
    cause = (f'--base_url={server.url} answered HTTP 501 (not implemented: no chat endpoint there): '
             'an HTML page "501 Not Implemented"')
    [line] = [line for line in stopped.stderr.splitlines() if line.startswith("error:")]
    assert cause in line and "<" not in stopped.stderr + stopped.stdout and "retrying" not in stopped.stderr
    assert max(_asked(server).values()) == 1 and server.stats()["requests"] <= 8  # never asked again
    checked = inline.run(*inline.args(server, run_name="check", dry_run=True))
    assert checked.returncode == 1 and cause in checked.stderr and "<" not in checked.stderr + checked.stdout


# ---------------------------------------------------------------- secrets


def test_resume_hint_has_no_key_and_is_shell_quoted(inline, scripted_server):
    server = scripted_server({"default": [{"status": 401, "error": "bad key"}]})
    write_jsonl(inline.cwd / "my prompts.jsonl", [{"prompt": "a"}])
    stopped = inline.run(*inline.args(server, dataset_file="my prompts.jsonl", api_key="sk-secret-123"))
    assert stopped.returncode == 1
    assert "sk-secret-123" not in stopped.stderr + stopped.stdout
    hint = next(line.strip() for line in stopped.stderr.splitlines() if "batch_runner.py" in line)
    assert "'--dataset_file=my prompts.jsonl'" in hint
    assert hint.endswith("--resume  # without the key: set OPENROUTER_API_KEY (or OPENAI_API_KEY) or give --api_key again")


# ---------------------------------------------------------------- the retry policy, in process


def test_the_default_retries_outlast_a_long_outage_whatever_the_jitter_draws():
    for _ in range(2000):
        waits, previous = [], 0.0
        for _ in range(10):  # the default --max_retries
            previous = chat_calls.backoff(previous)
            waits.append(previous)
        assert sum(waits) >= 100 and min(waits) >= 1.0 and max(waits) <= chat_calls.BACKOFF_CAP


def test_retry_budget_bounds_a_call_by_time_and_the_first_wait_is_at_least_a_second(scripted_server):
    server = scripted_server({"outage": {"status": 503, "seconds": 3600}})
    settings = ModelSettings(model="m", base_url=server.url, api_key="k", max_retries=100, retry_budget=3.0)
    throttled = []

    async def one_call():
        endpoint = chat_calls.Endpoint(settings, 1)
        try:
            await chat_calls.complete(endpoint, settings, [{"role": "user", "content": "hi"}], None, lambda: throttled.append(1))
        finally:
            await endpoint.close()

    with pytest.raises(errors.InternalServerError):
        asyncio.run(one_call())
    times = [r["t"] for r in server.requests()]
    assert 2 <= len(times) <= 4  # 3 s of budget, every wait at least 1 s: not 101 tries
    assert all(b - a >= 1.0 for a, b in zip(times, times[1:]))
    assert len(throttled) == len(times)  # a 503 slows admissions like a 429


@pytest.mark.skipif(cgroups.problem() is not None, reason=f"no cgroups for sandboxes here: {cgroups.problem()}")
def test_resume_removes_the_cgroups_a_killed_runner_left(cli, inline, scripted_server):
    """Sandboxes die with a runner killed with -9, their cgroup directories do not: the next
    invocation of the run removes them (and no other run's)."""
    server = scripted_server({"default": [call("terminal", command="echo up"), {**think("done"), "gate": "held"}]})
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(2)])
    args = cli.args(server)
    run_id = RunOptions(run_name="run", output_dir=str(cli.cwd / "data")).run_id

    def ours() -> set[Path]:  # this run's groups: other runs on the machine may come and go meanwhile
        return {d for base in cgroups._bases()[0] for d in base.glob(f"trajgen-{run_id}.*")}

    first = cli.start(*args)
    _wait_for(lambda: len(server.requests()) == 4)  # both prompts ran their command and are held
    left = ours()
    kill_group(first)
    assert left and all(d.exists() for d in left)
    server.open_gate("held")
    done = inline.run(*args, "--resume")
    assert done.returncode == 0, done.stderr
    assert not any(d.exists() for d in left)
    assert ours() == set()


def _call(settings: ModelSettings, endpoint: chat_calls.Endpoint | None = None, on_retry=None):
    async def one_call():
        used = endpoint or chat_calls.Endpoint(settings, 1)
        try:
            return await chat_calls.complete(used, settings, [{"role": "user", "content": "hi"}], None, lambda: None,
                                      on_retry=on_retry)
        finally:
            await used.close()

    return asyncio.run(one_call())


def test_an_endpoint_out_of_reach_that_never_answered_stops_at_once():
    closed = socket.socket()  # bound and not listening: every connection is refused, and no one else gets the port
    closed.bind(("127.0.0.1", 0))
    try:
        refused = ModelSettings(model="m", base_url=f"http://127.0.0.1:{closed.getsockname()[1]}/v1", api_key="k")
        with pytest.raises(errors.EndpointUnreachable, match="^connection refused$"):
            _call(refused)
        endpoint = chat_calls.Endpoint(refused, 1)
        endpoint.answered = True  # it answered before: a refusal now is an outage, retried
        with pytest.raises(errors.APIConnectionError):
            _call(dataclasses.replace(refused, max_retries=1), endpoint)
    finally:
        closed.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI for a self-signed certificate")
@pytest.mark.parametrize("reply, said", [
    ({"status": 501, "body": NOT_IMPLEMENTED}, 'HTTP 501 (not implemented: no chat endpoint there): an HTML page "501'),
    ({"status": 405, "body": ""}, "HTTP 405 (method not allowed: no chat endpoint there)"),
    ({"status": 404, "error": "no such model"}, "HTTP 404 (model or endpoint not found)"),
    ({"body": NOT_IMPLEMENTED}, 'with an HTML page "501 Not Implemented", not JSON: no chat endpoint there'),
])
def test_an_answer_no_retry_changes_stops_a_never_answered_endpoint_and_fails_a_prompt_later(
        scripted_server, monkeypatch, reply, said):
    monkeypatch.setattr(chat_calls, "backoff", lambda previous: 0.01)  # which answers are retried, not how long after
    server = scripted_server({"default": [reply]})
    settings = ModelSettings(model="m", base_url=server.url, api_key="k", max_retries=3, stream=False)
    with pytest.raises(errors.FatalAPIError) as stopped:
        _call(settings)
    assert str(stopped.value).startswith(f"--base_url={server.url} answered {said}") and "<" not in str(stopped.value)
    assert len(server.requests()) == 1
    endpoint = chat_calls.Endpoint(settings, 1)
    endpoint.answered = True  # it answered before: the same answer now fails this prompt (a 5xx after retries)
    with pytest.raises((errors.APIStatusError, errors.NotJSON)) as failed:
        _call(settings, endpoint)
    assert not isinstance(failed.value, errors.FatalAPIError) and "<" not in str(failed.value)
    assert len(server.requests()) == 1 + (4 if reply.get("status", 200) >= 500 else 1)


def test_a_400_stops_a_never_answered_endpoint_once_a_second_prompt_is_refused_alike(scripted_server):
    """The first may be that prompt's own fault (an image too large); a context length always is."""
    server = scripted_server({"match": [{"contains": "long", "replies": [
        {"status": 400, "error": "This model's maximum context length is 8192 tokens"}]}],
        "default": [{"status": 400, "error": "not a valid model ID"}]})
    settings = ModelSettings(model="m", base_url=server.url, api_key="k", max_retries=3)

    async def ask(*prompts: str) -> list:
        endpoint, said = chat_calls.Endpoint(settings, 1), []
        try:
            for prompt in prompts:
                try:
                    await chat_calls.complete(endpoint, settings, [{"role": "user", "content": prompt}], None,
                                              lambda: None)
                except errors.APIError as error:
                    said.append(type(error))
                except errors.FatalAPIError as error:
                    said.append(str(error))
        finally:
            await endpoint.close()
        return said

    stop = f"--base_url={server.url} answered HTTP 400 (the request is refused): {{'error': {{'message': 'not a valid"
    long_ones = asyncio.run(ask("long 1", "long 2", "long 3"))
    assert long_ones == [errors.BadRequestError] * 3 and len(server.requests()) == 3  # none asked twice
    first, second = asyncio.run(ask("a", "b"))
    assert first is errors.BadRequestError and second.startswith(stop)


def test_a_body_that_is_not_json_is_summed_up_never_pasted():
    page = b"<html><head><title>\n  Bad &amp; gone </title></head><body>" + b"<p>x</p>" * 1000 + b"</body></html>"
    assert errors.summary(page) == 'an HTML page "Bad & gone"'
    assert errors.summary(b"<html><body>nothing</body></html>") == "an HTML page of 33 bytes"
    assert errors.summary(b"upstream connect error\n or reset") == '"upstream connect error or reset"'
    assert errors.summary(b"y" * 500) == '"' + "y" * 119 + '…" (500 bytes)'
    assert errors.summary(b"\x00\xff\xfe") == "3 bytes that are not text"
    assert errors.status_error(502, {}, b"").message == "Error code: 502"


def test_a_certificate_the_system_does_not_trust_is_out_of_reach(tmp_path):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")],
                   check=True, capture_output=True)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    requests = []

    async def serve_and_call():
        server = await asyncio.start_server(lambda r, w: requests.append(w.close()), "127.0.0.1", 0, ssl=context)
        settings = ModelSettings(model="m", base_url=f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1",
                                 api_key="k")
        endpoint = chat_calls.Endpoint(settings, 1)
        try:
            await chat_calls.complete(endpoint, settings, [{"role": "user", "content": "hi"}], None, lambda: None)
        finally:
            await endpoint.close()
            server.close()

    with pytest.raises(errors.EndpointUnreachable, match="^TLS failure: the certificate is not accepted"):
        asyncio.run(serve_and_call())
    assert requests == []  # the handshake failed: no request was read


def test_a_name_that_does_not_resolve_is_out_of_reach_and_a_timeout_is_not():
    for cause, expected in [(socket.gaierror(-2, "Name or service not known"), "the host name does not resolve"),
                            (ConnectionRefusedError(111, "Connection refused"), "connection refused"),
                            (TimeoutError(), None), (ConnectionResetError(104, "reset"), None)]:
        try:
            try:
                raise cause
            except OSError as e:
                raise errors.APIConnectionError() from e
        except errors.APIConnectionError as error:
            assert (errors.unreachable_cause(error) or "").startswith(expected or "") and (
                (errors.unreachable_cause(error) is None) == (expected is None)), cause


def test_each_retry_is_heard_with_its_cause_attempt_and_wait(scripted_server):
    server = scripted_server({"default": [{"status": 500, "times": 2, "then": think()}]})
    heard = []
    settings = ModelSettings(model="m", base_url=server.url, api_key="k", max_retries=5)
    _call(settings, on_retry=lambda error, attempt, retries, wait: heard.append((type(error), attempt, retries, wait)))
    assert [(kind, attempt, retries) for kind, attempt, retries, _ in heard] == [
        (errors.InternalServerError, 1, 5), (errors.InternalServerError, 2, 5)]
    assert all(wait >= chat_calls.BACKOFF_BASE for *_, wait in heard)
