"""Replies paid twice when a Ray actor is killed with SIGKILL mid-run (the OOM killer's way).

    python bench/ray_kill.py --label=NAME [--trials=10]

Each trial runs the CLI with `--executor=ray` (2 actors, 4 conversations each) on prompts of four
calls (three terminal turns, then the answer; the endpoint takes DELAY s a call), kills one actor
once RUN_ROWS rows have landed, lets the run finish (Ray restarts the actor, its prompts run
again), and counts at the scripted server the (prompt, turn) answered more than once: replies paid
twice. A call the killed actor had in flight at the kill is lost whatever the runner does; the
table gives the calls in flight at the kill (both actors) beside the count. Like
bench/ray_scale.py, it runs itself again inside a loopback-only network namespace. The row named
`--label` of the section between `<!-- ray-kill -->` and `<!-- /ray-kill -->` in bench/RESULTS.md
is replaced.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ray_scale import in_loopback_namespace  # noqa: E402
from tests.support.ray_actors import actor_pids  # noqa: E402
from tests.support.scripted_server import start_server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS_MD = ROOT / "bench" / "RESULTS.md"
START, END = "<!-- ray-kill -->", "<!-- /ray-kill -->"
DELAY = 0.3
PROMPTS = 24
RUN_ROWS = 4
TURN = {"tool_calls": [{"name": "terminal", "arguments": {"command": "echo hi"}}], "reasoning": "r", "delay": DELAY}
SCRIPT = {"default": [TURN, TURN, TURN, {"content": "done", "reasoning": "r", "delay": DELAY}]}


def rows(run_dir: Path) -> int:
    return sum(1 for p in run_dir.glob("batch_*.jsonl") for _ in p.open()) if run_dir.exists() else 0


class NotStarted(Exception):
    """The run ended before the kill: Ray did not start on a loaded machine (the trial is run again)."""


def trial(work: Path) -> tuple[int, int]:
    """(replies paid twice, calls in flight at the kill) of one run."""
    work.mkdir()
    (work / "prompts.jsonl").write_text("".join(f'{{"prompt": "prompt {i}"}}\n' for i in range(PROMPTS)))
    env = {**os.environ, "TMPDIR": str(work), "HOME": str(work)}
    with start_server(SCRIPT) as server:
        argv = [sys.executable, str(ROOT / "batch_runner.py"), "--dataset_file=prompts.jsonl", "--run_name=r",
                f"--base_url={server.url}", "--api_key=k", "--model=m", "--distribution=terminal_only",
                "--executor=ray", "--num_workers=2", "--concurrency=8", "--batch_size=4", "--max_retries=1"]
        process = subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        run_dir = work / "data" / "r"
        while rows(run_dir) < RUN_ROWS:
            if process.poll() is not None:
                raise NotStarted(process.stderr.read()[-300:].strip())
            time.sleep(0.02)
        killed_at = time.time()
        os.kill(actor_pids()[0], signal.SIGKILL)
        _, stderr = process.communicate(timeout=600)
        if process.returncode != 0:
            raise SystemExit(f"run failed ({process.returncode}): {stderr[-2000:]}")
        answered = Counter((r["prompt"], r["turn"]) for r in server.requests() if r["status"] == 200)
        in_flight = sum(1 for r in server.requests() if killed_at - DELAY <= r["t"] <= killed_at)
    return sum(n - 1 for n in answered.values()), in_flight


def report_row(label: str, results: list[tuple[int, int]]) -> str:
    twice = [t for t, _ in results]
    flight = [f for _, f in results]
    return (f"| {label} | {len(results)} | {' '.join(map(str, twice))} | {statistics.median(twice):g} | "
            f"{max(twice)} | {' '.join(map(str, flight))} |")


def write(label: str, row: str) -> None:
    header = ("## Replies paid twice after `kill -9` of a Ray actor (bench/ray_kill.py)\n\n"
              f"{PROMPTS} prompts of 4 calls ({DELAY} s each), `--executor=ray --num_workers=2 --concurrency=8`; one "
              f"actor killed with SIGKILL once {RUN_ROWS} rows have landed; the run then finishes. Paid twice: the "
              "(prompt, turn) the scripted server answered more than once. In flight: calls the server held at the "
              "kill (both actors; those of the killed actor are lost whatever the runner does).\n\n"
              "| code | trials | paid twice, per trial | median | max | in flight at the kill, per trial |\n"
              "|---|---|---|---|---|---|")
    text = RESULTS_MD.read_text()
    pattern = re.compile(re.escape(START) + "\n(.*?)" + re.escape(END), re.S)
    found = pattern.search(text)
    rows_kept = [line for line in (found[1].splitlines() if found else [])
                 if line.startswith("| ") and not line.startswith(("| code", f"| {label} |"))]
    block = "\n".join([START, header, *rows_kept, row, END])
    text = pattern.sub(lambda _: block, text) if found else text.rstrip("\n") + "\n\n" + block + "\n"
    RESULTS_MD.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    if not in_loopback_namespace():
        if os.environ.get("RAY_KILL_INNER"):
            raise SystemExit("refusing to start Ray outside a loopback-only network namespace")
        inner = 'ip link set lo up && "$0" "$@"'  # sh stays PID 1 and reaps the orphans it adopts
        done = subprocess.run(["unshare", "--net", "--pid", "--fork", "--mount-proc", "sh", "-c", inner,
                               sys.executable, *sys.argv], env={**os.environ, "RAY_KILL_INNER": "1"})
        raise SystemExit(done.returncode)
    base = Path(tempfile.mkdtemp(prefix="k", dir="/tmp"))  # short: Ray's socket paths live under it
    try:
        results = []
        for n in range(args.trials):
            for attempt in range(3):
                try:
                    results.append(trial(base / f"{n}-{attempt}"))
                    break
                except NotStarted as e:
                    print(f"trial {n}: the run ended before the kill, again: {e}", flush=True)
            else:
                raise SystemExit(f"trial {n} never reached the kill")
            print(f"trial {n}: paid twice {results[-1][0]}, in flight at the kill {results[-1][1]}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    row = report_row(args.label, results)
    write(args.label, row)
    print(row)


if __name__ == "__main__":
    main()
