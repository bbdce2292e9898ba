"""What a newcomer meets when something goes wrong: a word at once, and the next step. The CLI (in
process, `inline`, or the real one where a pasted command is the point) against the loopback scripted
server."""
from __future__ import annotations

import re
import shlex
import socket
import subprocess

from tests.conftest import read_jsonl, think, write_jsonl
from trajgen import chat_calls, dataset, merge, store
from trajgen.scheduler import PROMPT_EXCERPT, _which
from trajgen.task import Task


def test_a_closed_port_stops_the_run_at_once_with_one_line(inline, scripted_server):
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(3)])
    closed = socket.socket()  # bound and not listening: connections are refused
    closed.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{closed.getsockname()[1]}/v1"
    try:  # ten retries would take more than 100 s: the deadline is what says "at once"
        stopped = inline.run(*inline.args(_Url(url), max_retries=10))
        checked = inline.run(*inline.args(_Url(url)), "--dry_run")
    finally:
        closed.close()
    assert checked.returncode == 1
    assert f"error: --base_url={url} cannot be reached: connection refused; check --base_url" in checked.stderr
    assert stopped.returncode == 1
    errors = [line for line in stopped.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --base_url={url} cannot be reached: connection refused; nothing was sent or recorded. "
                      "Fix --base_url (--dry_run checks it) and run the same command again"], stopped.stderr
    assert store.entries(inline.run_dir()) == []  # nothing recorded failed, nothing to --resume
    server = scripted_server({"default": [think()]})
    fixed = inline.run(*inline.args(server))  # the same command with --base_url fixed
    assert fixed.returncode == 0, fixed.stderr
    assert len(read_jsonl(inline.run_dir() / "trajectories.jsonl")) == 3


def test_a_failed_run_ends_with_the_next_step_and_its_resume_command_works_pasted(cli, scripted_server):
    server = scripted_server({"prompts": {"flaky": [{"status": 500}]}, "default": [think()]})
    work = cli.cwd / "my work"  # the user's directory: not the script's
    work.mkdir()
    write_jsonl(work / "prompts.jsonl", [{"prompt": "fine"}, {"prompt": "flaky", "id": "f-1"}])
    failed = subprocess.run(cli.command(*cli.args(server, max_retries=0)), cwd=work, env=cli.env, capture_output=True,
                            text=True, timeout=180)
    assert failed.returncode == 1, failed.stderr
    lines = failed.stderr.splitlines()
    said = lines.index("1 prompt(s) failed (InternalServerError 1); each is listed with its error in "
                       "data/run/failures.jsonl; --resume runs them again:")
    command = lines[said + 1].strip()
    assert command.endswith("--resume  # without the key: set OPENROUTER_API_KEY (or OPENAI_API_KEY) "
                            "or give --api_key again") and "dummy-key" not in failed.stderr
    assert shlex.split(command, comments=True)[1] == cli.command()[1]  # the script as invoked
    [failure] = read_jsonl(work / "data" / "run" / "failures.jsonl")
    assert (failure["id"], failure["prompt"], failure["error_class"]) == ("f-1", "flaky", "InternalServerError")
    server.set_script({"default": [think()]})
    pasted = subprocess.run(["bash", "-c", command], cwd=work, env=cli.env, capture_output=True, text=True,
                            timeout=180)
    assert pasted.returncode == 0, pasted.stderr
    rows = read_jsonl(work / "data" / "run" / "trajectories.jsonl")
    assert sorted(r["conversations"][1]["value"] for r in rows) == ["fine", "flaky"]


def test_the_retry_line_shows_under_the_bar_while_the_server_answers_500s(inline, scripted_server, monkeypatch):
    monkeypatch.setattr(chat_calls, "backoff", lambda previous: chat_calls.BACKOFF_BASE)  # which attempts, not how long
    server = scripted_server({"default": [{"status": 500, "times": 3, "then": think()}]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "p"}])
    terminal = {"TTY_COMPATIBLE": "1", "COLUMNS": "100"}  # rich draws its live bar as on a terminal 100 columns wide
    done = inline.run(*inline.args(server, max_retries=10), env=terminal)
    assert done.returncode == 0, done.stderr[-2000:]
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", done.stderr)
    seen = re.findall(r"1 retrying: HTTP 500, attempt (\d+)/10, next in (\d+) s; 1 in flight", text)
    assert {attempt for attempt, _ in seen} >= {"1", "2", "3"}, text[-2000:]


def test_resume_of_a_run_that_does_not_exist_says_so(inline, scripted_server):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "p"}])
    done = inline.run(*inline.args(server, run_name="typo", resume=True))
    assert done.returncode == 2
    assert "--resume: there is no run data/typo to continue" in done.stderr and server.stats()["requests"] == 0


def test_a_near_miss_of_the_prompt_key_gets_a_suggestion():
    assert dataset.parse_line(b'{"promt": "hi", "id": 1}', 4, "p.jsonl") == (
        "p.jsonl:5: no 'prompt' field (is 'promt' meant to be 'prompt'?)")
    assert dataset.parse_line(b'{"text": "hi"}', 0, "p.jsonl") == "p.jsonl:1: no 'prompt' field"


def test_a_failure_record_names_its_prompt_by_id_and_excerpt():
    long = Task(key="k", prompt_index=0, batch_num=0, prompt="x" * 1000, image=None, cwd=None, extra={"id": "row-7"},
                toolsets_sampled=[], toolsets_offered=[])
    assert _which(long) == {"id": "row-7", "prompt": "x" * (PROMPT_EXCERPT - 1) + "…"}
    assert _which(Task(key="k", prompt_index=0, batch_num=0, prompt="short", image=None, cwd=None, extra={},
                       toolsets_sampled=[], toolsets_offered=[])) == {"id": None, "prompt": "short"}


def test_statistics_give_no_rate_to_a_tool_never_called_and_round_costs():
    tally = merge.Tally()
    for cost in (0.1, 0.2, 0.006, 0.004):
        tally.add({"tool_stats": {"terminal": {"count": 1, "success": 1, "failure": 0},
                                  "web_search": {"count": 0, "success": 0, "failure": 0}},
                   "metadata": {"usage": {"cost": cost}}})
    stats = merge.statistics(merge.Merged(kept=tally), {})
    assert stats["tool_statistics"]["web_search"]["success_rate"] is None
    assert stats["tool_statistics"]["terminal"]["success_rate"] == 1.0
    assert tally.cost != 0.31 and stats["cost"] == 0.31


class _Url:
    """A server that is not there: only its address."""

    def __init__(self, url: str):
        self.url = url
