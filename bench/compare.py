#!/usr/bin/env python
"""Benchmark of --compare on two synthetic runs of N verified prompts each.

    python bench/compare.py              # N=100,000
    python bench/compare.py --n=10000

Two run directories in the real row format (bench/viewer.py's rows, each with a verdict: run A
passes 3 prompts in 5, run B 1 in 2, so about 40% of the prompts are discordant) are written under
bench/out/, then the real CLI compares them (`python batch_runner.py --compare=A,B`): its wall time,
its peak RSS and the size of what it writes. Results go to the "Compare" section of bench/RESULTS.md
(replaced on every run).
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import orjson

from harness import write_section
from viewer import BATCH, row

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
START, END = "<!-- compare -->", "<!-- /compare -->"


def make_run(run_dir: Path, n: int, passes) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    for batch in range(0, n, BATCH):
        lines = []
        for i in range(batch, min(n, batch + BATCH)):
            record = row(i)
            record["verify"] = {"status": "passed" if passes(i) else "failed", "command": "true", "exit_code": 0,
                                "seconds": 0.01, "output": "", "error": None}
            lines.append(orjson.dumps(record))
        (run_dir / f"batch_{batch // BATCH}.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (run_dir / "manifest.json").write_bytes(orjson.dumps({"run_name": run_dir.name, "model": run_dir.name,
                                                          "dataset": {"prompts": n}}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=100_000)
    n = parser.parse_args().n
    out = BENCH / "out" / "compare"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    make_run(out / "a", n, lambda i: i % 5 < 3)
    make_run(out / "b", n, lambda i: i % 2 == 0)
    size = sum(p.stat().st_size for d in ("a", "b") for p in (out / d).iterdir())
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(ROOT / "batch_runner.py"), f"--compare={out / 'a'},{out / 'b'}",
                           f"--compare_out={out}"], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True)
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    load = os.getloadavg()[0]
    rows = [("run directories", f"2 x {n:,} prompts, {size / 2**20:.0f} MB"),
            ("--compare wall time", f"{seconds:.1f} s"), ("--compare peak RSS", f"{rss:.0f} MB"),
            ("comparison.json", f"{(out / 'comparison.json').stat().st_size / 2**20:.1f} MB"),
            ("comparison.html", f"{(out / 'comparison.html').stat().st_size / 2**20:.1f} MB")]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    table = "\n".join(["| what | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])
    section = (f"{START}\n## Compare\n\n`python bench/compare.py --n={n}` ({time.strftime('%Y-%m-%d')}, at {head}; "
               f"2 cores, a shared machine: load average {load:.1f} at the end). One run of the real CLI.\n\n"
               f"{table}\n{END}")
    write_section(START, END, section)
    print(table)


if __name__ == "__main__":
    main()
