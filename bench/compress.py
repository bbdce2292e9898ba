#!/usr/bin/env python
"""Benchmark of --compress on rows that need no summary: the runner's own work, without a model call.

    python bench/compress.py              # N=10,000 rows, 3 repeats
    python bench/compress.py --n=1000 --repeats=1

A synthetic finished run (trajectories.jsonl of bench/viewer.py's rows, manifest.json) is written
under bench/out/, then the real CLI compresses it (`python batch_runner.py --compress`), every row
under --compress_tokens, once with the estimate (4 characters a token) and once with --tokenizer (a
word-level tokenizer built locally, tests/support/local_tokenizer.py). The summary endpoint is a
closed port on 127.0.0.1: a request would fail the job, so none is made. Wall time of the whole
command (interpreter start included), median over the repeats; target: under 60 s. Results go to the
"Compress" section of bench/RESULTS.md (replaced on every run).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson

from harness import write_section
from viewer import row

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
OUT = BENCH / "out" / "compress"
START, END = "<!-- compress -->", "<!-- /compress -->"
TARGET_S = 60.0


def make_run(run_dir: Path, n: int) -> int:
    """A finished run of n rows; returns the bytes of trajectories.jsonl."""
    run_dir.mkdir(parents=True, exist_ok=True)
    data = b"".join(orjson.dumps(row(i)) + b"\n" for i in range(n))
    (run_dir / "trajectories.jsonl").write_bytes(data)
    (run_dir / "manifest.json").write_bytes(orjson.dumps({"run_name": run_dir.name, "model": "bench",
                                                          "base_url": "http://127.0.0.1:9/v1", "batch_size": 10}))
    return len(data)


def compress(flags: list[str]) -> float:
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(ROOT / "batch_runner.py"), "--compress", "--run_name=bench",
                           f"--output_dir={OUT}", "--compress_tokens=15250", *flags],
                          cwd=ROOT, capture_output=True, text=True)
    seconds = time.monotonic() - started
    if done.returncode != 0 or "0 compressed" not in done.stdout:
        raise SystemExit(f"--compress failed ({done.returncode}): {done.stdout}{done.stderr}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    size = make_run(OUT / "bench", args.n)
    sys.path.insert(0, str(ROOT))
    from tests.support.local_tokenizer import build
    tokenizer = build(OUT / "tokenizer")
    results, load = {}, [os.getloadavg()[0]]
    countings = (("estimate (no --tokenizer)", []), ("--tokenizer (word-level, local)", [f"--tokenizer={tokenizer}"]))
    for name, flags in countings:
        times = [compress(flags) for _ in range(args.repeats)]
        results[name] = statistics.median(times)
        print(f"{name}: {results[name]:.2f} s (runs {', '.join(f'{t:.2f}' for t in times)})")
    load.append(os.getloadavg()[0])
    lines = [START, "## Compress (bench/compress.py)", "",
             f"`python bench/compress.py --n={args.n} --repeats={args.repeats}` "
             f"({time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC; 2 cores, a shared machine: load average "
             f"{load[0]:.1f} at the start, {load[1]:.1f} at the end). A finished run of "
             f"{args.n:,} rows ({size / 2**20:.0f} MB), every row under the target: the runner's own work "
             "(read, count, plan, write the new run directory, merge, statistics), no summary call. Wall time "
             f"of the whole command, median of {args.repeats}; target under {TARGET_S:.0f} s.", "",
             "| counting | wall time | target |", "|---|---|---|",
             *(f"| {name} | {seconds:.2f} s | {'pass' if seconds < TARGET_S else 'fail'} |"
               for name, seconds in results.items()), END]
    write_section(START, END, "\n".join(lines))


if __name__ == "__main__":
    main()
