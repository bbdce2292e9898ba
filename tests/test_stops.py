"""Every stop ends the same way: a signal to the runner or to its whole process group, a dead
endpoint, a spend limit. The summary, the resume line, the exit status, nothing recorded as failed
that was only cancelled, and a resume that pays for nothing twice."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from tests.conftest import call, kill_group, read_jsonl, think, write_jsonl
from tests.test_guard_rails import replies_sent
from tests.test_resume import _rows

# the model answers at once and the tool takes a second: at a stop, prompts are in their tools, not in a call
SLOW_TOOL = [call("terminal", command="sleep 1; echo hi"), think()]


def _wait_for(predicate, timeout: float = 60, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.05)


def _paid_twice(server, stopped_at: float) -> list[tuple[str, int]]:
    """(prompt, turn) answered more than once whose first answer came before the stop (one in
    flight at the stop was never received, so it is asked again)."""
    first: dict[tuple[str, int], float] = {}
    answered = Counter()
    for r in server.requests():
        if r["status"] == 200:
            key = (r["prompt"], r["turn"])
            answered[key] += 1
            first.setdefault(key, r["t"])
    return [key for key, n in answered.items() if n > 1 and first[key] < stopped_at - 0.1]


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 130)])
def test_a_signal_to_the_process_group_cancels_and_the_resume_pays_nothing_twice(cli, scripted_server, sig, status):
    server = scripted_server({"default": SLOW_TOOL})
    names = [f"prompt {i}" for i in range(16)]
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": n} for n in names])
    # as a terminal starts it: SIGHUP not ignored, whatever this test's own (nohup) disposition
    process = subprocess.Popen(cli.command(*cli.args(server, batch_size=4, concurrency=4)), cwd=cli.cwd, env=cli.env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    try:
        _wait_for(lambda: _rows(cli.run_dir()) >= 4, what="4 rows")
        stopped_at = time.time()
        os.killpg(process.pid, sig)  # as timeout(1), systemd, Kubernetes and Slurm send it: to every process
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            kill_group(process)
    assert process.returncode == status, stderr
    assert f"stopped by {sig.name}" in stderr and "--resume" in stderr and "ok (rows written)" in stdout
    assert read_jsonl(cli.run_dir() / "failures.jsonl") == []  # cancelled, not failed
    checkpoint = json.loads((cli.run_dir() / "checkpoint.json").read_text())
    assert checkpoint["remaining_this_invocation"] > 0
    done = cli.run(*cli.args(server, batch_size=4, concurrency=4, resume=True))
    assert done.returncode == 0, done.stderr
    rows = read_jsonl(cli.run_dir() / "trajectories.jsonl")
    assert sorted(r["conversations"][1]["value"] for r in rows) == sorted(names)
    assert _paid_twice(server, stopped_at) == []


def _closing_endpoint() -> tuple[SimpleNamespace, list[int], socket.socket]:
    """An endpoint that closes every connection it accepts: each call fails and is retried."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[int] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed by the test
                return
            accepted.append(1)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return SimpleNamespace(url=f"http://127.0.0.1:{listener.getsockname()[1]}/v1"), accepted, listener


def test_sigterm_during_retries_against_a_dead_endpoint_prints_the_summary_and_the_resume_line(cli):
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(6)])
    dead, accepted, listener = _closing_endpoint()
    process = subprocess.Popen(cli.command(*cli.args(dead, max_retries=10)), cwd=cli.cwd, env=cli.env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for(lambda: len(accepted) >= 8, what="calls being retried")  # every prompt's call, and retries
        process.stdout.close()  # the reader of stdout is gone, as a `| tee` stopped with the run
        os.killpg(process.pid, signal.SIGTERM)
        stderr = process.stderr.read()
        process.wait(timeout=60)
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes its accept()
        listener.close()
        if process.poll() is None:
            kill_group(process)
    assert process.returncode == 143, stderr
    assert "BrokenPipe" not in stderr and "Broken pipe" not in stderr
    assert "stopped by SIGTERM" in stderr and stderr.rstrip().endswith(
        "--resume  # without the key: set OPENROUTER_API_KEY (or OPENAI_API_KEY) or give --api_key again")
    assert read_jsonl(cli.run_dir() / "failures.jsonl") == []


def test_the_spend_stop_line_states_what_the_table_and_statistics_say_was_paid(inline, scripted_server):
    # each prompt costs $0.01, a failed one too; the limit cancels the prompts in flight, and whether one of
    # them was paid before the cancel reached it is a race (test_core_scheduler pins that case down)
    server = scripted_server({"default": [{"content": "x", "reasoning": "r", "usage": {"cost": 0.01}, "delay": 0.3}],
                              "match": [{"contains": "bad", "replies": [{"message": {"role": "assistant", "content": 5},
                                                                        "usage": {"cost": 0.01}}]}]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": f"bad {i}" if i % 4 == 0 else f"p{i}"} for i in range(40)])
    done = inline.run(*inline.args(server, num_workers=2, concurrency=6, max_cost=0.01))
    assert done.returncode == 3, done.stderr
    stated = re.search(r"--max_cost=0.01 reached; this invocation paid \$(\d+\.\d{4}), (\d+) tokens", done.stderr)
    assert stated, done.stderr
    table = re.search(r"│ cost\s+│\s+\$(\d+\.\d{4}) │", done.stdout)
    statistics = json.loads((inline.run_dir() / "statistics.json").read_text())
    assert float(stated[1]) >= 0.01
    assert replies_sent(server) <= 1 + 6  # the limit, and at most the calls in flight then: through the workers' pipes
    assert stated[1] == table[1] == f"{statistics['cost']:.4f}"
    assert int(stated[2]) == statistics["tokens"]["prompt"] + statistics["tokens"]["completion"]
