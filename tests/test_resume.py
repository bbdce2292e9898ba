"""Resume never loses or repeats a prompt: kills, interrupts, failures, API errors, changed datasets."""
from __future__ import annotations

import json
import time
from pathlib import Path

from tests.conftest import call, kill_group, read_jsonl, think, write_jsonl
from tests.support.inline import interrupt, when
from trajgen import resume_scan
from trajgen.sandbox.roots import private_base


def _prompts(rows: list[dict]) -> list[str]:
    return [r["conversations"][1]["value"] for r in rows]


def _rows(run_dir) -> int:
    return sum(len(p.read_bytes().splitlines()) for p in run_dir.glob("batch_*.jsonl"))


def _wait_for_rows(run_dir, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _rows(run_dir) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {count} rows after {timeout} s")


def _holder(root) -> str:
    """The pid that took the lock of a sandbox root (`root` is the root or its lock file)."""
    try:
        return Path(str(root).removesuffix(".lock") + ".lock").read_text().strip()
    except FileNotFoundError:  # its runner has finished and removed it
        return ""


def _landed_prompts(run_dir) -> set[str]:
    return {r["conversations"][1]["value"] for p in run_dir.glob("batch_*.jsonl")
            for r in read_jsonl(p) if p.read_text().endswith("\n")}


def test_kill_9_mid_run_then_resume_gives_each_prompt_once(cli, scripted_server):
    server = scripted_server({"default": [{**call("terminal", command="echo hi"), "delay": 0.15}, {**think(), "delay": 0.15}]})
    names = [f"prompt {i}" for i in range(40)]
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": n} for n in names])
    before = set(private_base().glob("trajgen-sandboxes-*"))
    process = cli.start(*cli.args(server, batch_size=5, concurrency=4))
    _wait_for_rows(cli.run_dir(), 10)
    roots = {root for root in set(private_base().glob("trajgen-sandboxes-*")) - before  # the killed runner's root and
             if _holder(root) == str(process.pid)}  # lock (other runs on this machine may make their own meanwhile)
    assert roots
    kill_group(process)  # the parent and its workers, as a machine crash would
    landed = _landed_prompts(cli.run_dir())
    assert 10 <= len(landed) < 40
    before = len(server.requests())
    done = cli.run(*cli.args(server, batch_size=5, concurrency=4, resume=True))
    assert done.returncode == 0, done.stderr
    rows = read_jsonl(cli.run_dir() / "trajectories.jsonl")
    assert sorted(_prompts(rows)) == sorted(names)
    asked_again = {r["prompt"] for r in server.requests()[before:]}
    assert not asked_again & landed
    old_batches = {int(p.stem.split("_")[1]) for p in cli.run_dir().glob("batch_*.jsonl")}
    assert len(old_batches) > 1
    # the killed runner could not clean up its sandboxes; the next run removed them
    assert not [root for root in roots if root.exists()]


def test_duplicates_stay_duplicated_across_resume(inline, scripted_server):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "same"}] * 3 + [{"prompt": "other"}])
    assert inline.run(*inline.args(server)).returncode == 0
    assert sorted(_prompts(read_jsonl(inline.run_dir() / "trajectories.jsonl"))) == ["other", "same", "same", "same"]
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "same"}] * 4 + [{"prompt": "other"}])
    before = len(server.requests())
    assert inline.run(*inline.args(server, resume=True)).returncode == 0
    assert [r["prompt"] for r in server.requests()[before:]] == ["same"]
    assert _prompts(read_jsonl(inline.run_dir() / "trajectories.jsonl")).count("same") == 4


def test_reordered_dataset_with_inserted_prompts_runs_only_the_new_ones(inline, scripted_server):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": p} for p in ("a", "b", "c")])
    assert inline.run(*inline.args(server, batch_size=2)).returncode == 0
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": p} for p in ("new1", "c", "a", "new2", "b")])
    before = len(server.requests())
    done = inline.run(*inline.args(server, batch_size=2, resume=True))
    assert done.returncode == 0, done.stderr
    assert sorted(r["prompt"] for r in server.requests()[before:]) == ["new1", "new2"]
    assert sorted(_prompts(read_jsonl(inline.run_dir() / "trajectories.jsonl"))) == ["a", "b", "c", "new1", "new2"]
    # old batch files are untouched; the new prompts went to batch numbers after them
    new_rows = read_jsonl(inline.run_dir() / "batch_2.jsonl")
    assert {r["conversations"][1]["value"] for r in new_rows} == {"new1", "new2"}
    assert {r["prompt_index"] for r in new_rows} == {0, 3}
    statistics = json.loads((inline.run_dir() / "statistics.json").read_text())
    assert statistics["ok"] == 5 and statistics["total_batches"] == 3


def test_failed_prompts_are_retried_by_resume_once_the_server_heals(inline, scripted_server):
    server = scripted_server({"prompts": {"flaky": [{"status": 500, "error": "down"}]}, "default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "flaky"}, {"prompt": "fine"}])
    first = inline.run(*inline.args(server, max_retries=0))
    assert first.returncode == 1
    failures = read_jsonl(inline.run_dir() / "failures.jsonl")
    assert [(f["error_class"], f["prompt_index"]) for f in failures] == [("InternalServerError", 0)]
    assert _prompts(read_jsonl(inline.run_dir() / "trajectories.jsonl")) == ["fine"]
    server.set_script({"default": [think()]})
    before = len(server.requests())
    second = inline.run(*inline.args(server, max_retries=0, resume=True))
    assert second.returncode == 0, second.stderr
    assert [r["prompt"] for r in server.requests()[before:]] == ["flaky"]
    assert sorted(_prompts(read_jsonl(inline.run_dir() / "trajectories.jsonl"))) == ["fine", "flaky"]
    assert json.loads((inline.run_dir() / "statistics.json").read_text())["failed"]["total"] == 0


def test_429_with_retry_after_and_500s_are_retried(inline, scripted_server):
    server = scripted_server({"prompts": {
        "limited": [{"status": 429, "retry_after": "1", "times": 2, "then": think()}],
        "broken": [{"status": 500, "times": 2, "then": think()}],
    }})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "limited"}, {"prompt": "broken"}])
    done = inline.run(*inline.args(server, max_retries=3))
    assert done.returncode == 0, done.stderr
    limited = [r["t"] for r in server.requests() if r["prompt"] == "limited"]
    assert len(limited) == 3 and limited[2] - limited[0] >= 2.0  # Retry-After: 1 was honoured twice
    assert len([r for r in server.requests() if r["prompt"] == "broken"]) == 3
    assert len(read_jsonl(inline.run_dir() / "trajectories.jsonl")) == 2


def test_an_endpoint_that_dies_after_answering_fails_its_prompts_within_the_retry_budget(inline, scripted_server):
    """Once the endpoint has answered, a refused connection is an outage: retried, then the prompt fails
    (one that never answered stops the run at once: tests/test_first_contact.py)."""
    server = scripted_server({"prompts": {"b": [{**think(), "gate": "never"}]}, "default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    b_held = lambda: _rows(inline.run_dir()) >= 1 and any(r["prompt"] == "b" for r in server.requests())  # noqa: E731
    with when(b_held, server.stop):  # with b's request held: its connection breaks, and nothing listens any more
        done = inline.run(*inline.args(server, max_retries=2, num_workers=1))
    assert done.returncode == 1, done.stderr
    assert "APIConnectionError 1" in done.stderr and "cannot be reached" not in done.stderr
    assert _landed_prompts(inline.run_dir()) == {"a"}
    failures = read_jsonl(inline.run_dir() / "failures.jsonl")
    assert [(f["prompt"], f["error_class"]) for f in failures] == [("b", "APIConnectionError")]
    assert failures[0]["message"].startswith("cannot connect")


def test_401_stops_the_whole_run(inline, scripted_server):
    server = scripted_server({"default": [{"status": 401, "error": "invalid key"}]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(30)])
    done = inline.run(*inline.args(server, concurrency=2, batch_size=5))
    assert done.returncode == 1
    assert "authentication failed" in done.stderr and "--resume" in done.stderr
    assert len(server.requests()) <= 4  # not one request per prompt
    assert read_jsonl(inline.run_dir() / "trajectories.jsonl") == []


def test_sigint_mid_run_then_resume(inline, scripted_server):
    server = scripted_server({"default": [{**call("terminal", command="sleep 0.2; echo hi"), "delay": 0.1}, think()]})
    names = [f"prompt {i}" for i in range(30)]
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": n} for n in names])
    with when(lambda: _rows(inline.run_dir()) >= 6, interrupt):
        stopped = inline.run(*inline.args(server, batch_size=5, concurrency=4))
    assert stopped.returncode == 130, stopped.stderr
    assert "--resume" in stopped.stderr
    checkpoint = json.loads((inline.run_dir() / "checkpoint.json").read_text())
    assert checkpoint["remaining_this_invocation"] > 0
    landed = _landed_prompts(inline.run_dir())
    before = len(server.requests())
    done = inline.run(*inline.args(server, batch_size=5, concurrency=4, resume=True))
    assert done.returncode == 0, done.stderr
    assert sorted(_prompts(read_jsonl(inline.run_dir() / "trajectories.jsonl"))) == sorted(names)
    assert not {r["prompt"] for r in server.requests()[before:]} & landed


def test_torn_last_line_is_reported_and_ignored(inline, scripted_server):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    assert inline.run(*inline.args(server)).returncode == 0
    batch = inline.run_dir() / "batch_0.jsonl"
    lines = batch.read_text().splitlines(keepends=True)
    torn_prompt = json.loads(lines[-1])["conversations"][1]["value"]
    batch.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # a kill mid-write
    done = inline.run(*inline.args(server, resume=True))
    assert done.returncode == 0, done.stderr
    assert "torn" in done.stderr and "batch_0.jsonl:2" in done.stderr
    assert sorted(_prompts(read_jsonl(inline.run_dir() / "trajectories.jsonl"))) == ["a", "b"]
    assert [r["prompt"] for r in server.requests()[2:]] == [torn_prompt]


def test_resume_with_changed_model_needs_force(inline, scripted_server):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "a"}])
    assert inline.run(*inline.args(server)).returncode == 0
    changed = inline.run(*inline.args(server, model="other-model", resume=True))
    assert changed.returncode == 2 and "model: 'test-model' -> 'other-model'" in changed.stderr
    assert inline.run(*inline.args(server, model="other-model", resume=True, force=True)).returncode == 0


def test_a_run_stopped_before_any_reply_resumes_with_a_fixed_base_url_without_force(inline, scripted_server):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": p} for p in "abc"])
    wrong = server.url.removesuffix("/v1") + "/wrong"  # the server answers 404 there: a fatal stop, nothing paid
    stopped = inline.run(*inline.args(server, base_url=wrong))
    assert stopped.returncode == 1 and "--resume" in stopped.stderr, stopped.stderr
    assert read_jsonl(inline.run_dir() / "failures.jsonl") and not _rows(inline.run_dir())
    fixed = inline.run(*inline.args(server, resume=True))  # the printed resume command, --base_url fixed
    assert fixed.returncode == 0, fixed.stderr
    assert f"changed (base_url: '{wrong}' -> '{server.url}'); nothing was paid with the old ones" in fixed.stderr
    assert sorted(_prompts(read_jsonl(inline.run_dir() / "trajectories.jsonl"))) == ["a", "b", "c"]
    assert json.loads((inline.run_dir() / "manifest.json").read_text())["base_url"] == server.url
    paid = inline.run(*inline.args(server, model="other-model", resume=True))  # now rows were paid for
    assert paid.returncode == 2 and "pass --force" in paid.stderr


def test_a_failure_that_used_tokens_counts_as_paid(tmp_path):
    (tmp_path / "failures.jsonl").write_text('{"prompt_key": "k", "usage": {"prompt_tokens": 0, "cost": null}}\n')
    assert not resume_scan.anything_paid(tmp_path, resume_scan.scan(tmp_path))
    with open(tmp_path / "failures.jsonl", "a") as f:
        f.write('{"prompt_key": "k2", "usage": {"prompt_tokens": 12, "completion_tokens": 0}}\n')
    assert resume_scan.anything_paid(tmp_path, resume_scan.scan(tmp_path))


def test_resume_of_a_finished_run_rewrites_nothing_unless_a_file_changed(inline, scripted_server):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": p} for p in "abc"])
    assert inline.run(*inline.args(server)).returncode == 0
    run_dir = inline.run_dir()
    merged, first = (run_dir / "trajectories.jsonl").stat(), json.loads((run_dir / "statistics.json").read_text())
    again = inline.run(*inline.args(server, resume=True))
    assert again.returncode == 0, again.stderr
    assert len(server.requests()) == 3
    assert (run_dir / "trajectories.jsonl").stat().st_mtime_ns == merged.st_mtime_ns  # not merged again
    second = json.loads((run_dir / "statistics.json").read_text())
    assert second["duration_seconds_total"] > first["duration_seconds_total"]
    durations = ("duration_seconds", "duration_seconds_total")
    assert {k: v for k, v in second.items() if k not in durations} == {k: v for k, v in first.items() if k not in durations}
    # a row broken in its middle by hand (its start and end intact) is not taken for a row: it runs again
    batch = run_dir / "batch_0.jsonl"
    lines = batch.read_text().splitlines(keepends=True)
    broken = json.loads(lines[1])["conversations"][1]["value"]
    middle = len(lines[1]) // 2
    batch.write_text(lines[0] + lines[1][:middle] + '"' + lines[1][middle:] + "".join(lines[2:]))
    (run_dir / "trajectories.jsonl").unlink()
    server.set_script({"default": [{"status": 500, "error": "down"}]})  # its first retry fails...
    failed = inline.run(*inline.args(server, resume=True, max_retries=0))
    assert failed.returncode == 1 and "batch_0.jsonl:2" in failed.stderr
    server.set_script({"default": [think()]})  # ...and the next resume still knows the line is no row
    fixed = inline.run(*inline.args(server, resume=True))
    assert fixed.returncode == 0, fixed.stderr
    assert "batch_0.jsonl:2" in fixed.stderr
    assert [r["prompt"] for r in server.requests()[3:]] == [broken, broken]
    assert sorted(_prompts(read_jsonl(run_dir / "trajectories.jsonl"))) == ["a", "b", "c"]
    assert json.loads((run_dir / "statistics.json").read_text())["torn_lines_ignored"] == ["batch_0.jsonl:2"]


def test_rows_copied_into_the_run_directory_twice_are_merged_once(inline, scripted_server):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": p} for p in "abcd"])
    assert inline.run(*inline.args(server, batch_size=2)).returncode == 0
    run_dir = inline.run_dir()
    (run_dir / "batch_7.jsonl").write_bytes((run_dir / "batch_1.jsonl").read_bytes())  # a backup put back, say
    again = inline.run(*inline.args(server, batch_size=2, resume=True))
    assert again.returncode == 0, again.stderr
    assert len(server.requests()) == 4
    assert sorted(_prompts(read_jsonl(run_dir / "trajectories.jsonl"))) == ["a", "b", "c", "d"]
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert (stats["kept"], stats["duplicate_rows_ignored"]) == (4, 2)


def test_resuming_a_finished_run_starts_no_worker_and_no_cluster(inline, scripted_server):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": p} for p in "ab"])
    assert inline.run(*inline.args(server)).returncode == 0
    # a Ray cluster that is not there: nothing is left to run, so nothing asks for it
    done = inline.run(*inline.args(server, resume=True, force=True), "--executor=ray", "--ray_address=127.0.0.1:9")
    assert done.returncode == 0, done.stderr
    assert len(server.requests()) == 2
    assert sorted(_prompts(read_jsonl(inline.run_dir() / "trajectories.jsonl"))) == ["a", "b"]


def test_a_resume_with_another_dataset_file_says_what_changed_and_refuses_a_disjoint_one(inline, scripted_server):
    server = scripted_server({"default": [think()]})
    names = [f"prompt {i}" for i in range(20)]
    write_jsonl(inline.cwd / "first.jsonl", [{"prompt": n} for n in names])
    assert inline.run(*inline.args(server, dataset_file="first.jsonl")).returncode == 0
    exported = inline.run("--export=sharegpt", "--run_name=run")
    assert exported.returncode == 0, exported.stderr
    write_jsonl(inline.cwd / "second.jsonl", [{"prompt": "prompt 3"}, {"prompt": "new"}])
    before = len(server.requests())
    done = inline.run(*inline.args(server, dataset_file="second.jsonl", resume=True))
    assert done.returncode == 0, done.stderr
    assert ("the dataset changed since the last invocation: first.jsonl (20 prompts) -> second.jsonl (2 prompts), "
            "1 of its samples already done; 19 rows (and discards) of prompts no longer in it stay") in done.stderr
    assert [r["prompt"] for r in server.requests()[before:]] == ["new"]
    statistics = json.loads((inline.run_dir() / "statistics.json").read_text())
    assert (statistics["total_prompts"], statistics["ok"], statistics["records_not_in_dataset"]) == (2, 21, 19)
    assert statistics["remaining_not_run"] == 0
    assert "data/run/export_sharegpt.jsonl was exported before this merge and is stale" in done.stderr

    write_jsonl(inline.cwd / "other.jsonl", [{"prompt": "unrelated 1"}, {"prompt": "unrelated 2"}])
    refused = inline.run(*inline.args(server, dataset_file="other.jsonl", resume=True))
    assert refused.returncode == 2 and "other.jsonl shares no prompt with run run" in refused.stderr
    assert len(server.requests()) == before + 1
    forced = inline.run(*inline.args(server, dataset_file="other.jsonl", resume=True, force=True))
    assert forced.returncode == 0, forced.stderr
    assert json.loads((inline.run_dir() / "statistics.json").read_text())["records_not_in_dataset"] == 21
