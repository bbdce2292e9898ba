#!/usr/bin/env python
"""What the row format costs on disk: the median row, and how much of it is `tools` and the
exact per-turn parts (`message`, `reasoning`, `metadata.request`/`dataset`) that format 2 added.

    python bench/row_size.py [N]    # N prompts (default 200), --distribution=development

The real CLI against the in-process scripted server on 127.0.0.1: per prompt a terminal call, a
write_file call, a second terminal call and an answer, each with reasoning (docs/output.md, Row format).
"""
from __future__ import annotations

import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.support.scripted_server import start_server  # noqa: E402

PROGRAM = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\nprint([fib(i) for i in range(20)])\n"
SCRIPT = {"default": [
    {"reasoning": "I should look around first, then write the script and run it.", "content": "Let me look around.",
     "tool_calls": [{"name": "terminal", "arguments": {"command": "ls -la / && uname -a && python3 --version"}}]},
    {"reasoning": "Now write the script.", "tool_calls": [{"name": "write_file", "arguments": {"path": "fib.py", "content": PROGRAM}}]},
    {"reasoning": "Run it to check the output.", "tool_calls": [{"name": "terminal", "arguments": {"command": "python3 fib.py"}}]},
    {"reasoning": "It works; summarise.", "content": "I wrote fib.py: it prints the first 20 Fibonacci numbers, from 0 to 4181."},
]}


def size(obj) -> int:
    return len(json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode())


def format_1(row: dict) -> dict:
    """The row without what format 2 added."""
    return {**{k: v for k, v in row.items() if k != "tools"},
            "conversations": [{k: v for k, v in t.items() if k not in ("message", "reasoning")} for t in row["conversations"]],
            "metadata": {k: v for k, v in row["metadata"].items() if k not in ("request", "dataset")}}


def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, start_server(SCRIPT) as server:
        Path(tmp, "prompts.jsonl").write_text("".join(
            json.dumps({"prompt": f"Write a Python script that prints the first 20 Fibonacci numbers (task {i}).", "id": i}) + "\n"
            for i in range(n)))
        env = {k: v for k, v in os.environ.items() if k not in ("OPENROUTER_API_KEY", "OPENAI_API_KEY")}
        subprocess.run([sys.executable, str(ROOT / "batch_runner.py"), "--dataset_file=prompts.jsonl", "--run_name=sizes",
                        f"--base_url={server.url}", "--api_key=dummy", "--model=bench", "--distribution=development",
                        "--keep_hallucinated"], cwd=tmp, env=env, check=True, capture_output=True)
        lines = Path(tmp, "data", "sizes", "trajectories.jsonl").read_bytes().splitlines()
    rows = [json.loads(line) for line in lines]
    total = [len(line) for line in lines]
    tools = [size(r["tools"]) for r in rows]
    old = [size(format_1(r)) for r in rows]
    parts = [t - o - s for t, o, s in zip(total, old, tools)]
    median = statistics.median
    print(f"{len(rows)} rows, {len({json.dumps(r['tools']) for r in rows})} toolset combinations")
    print(f"median row {median(total) / 1000:.1f} KB (format 1: {median(old) / 1000:.1f} KB)")
    print(f"tools median {median(tools) / 1000:.1f} KB (min {min(tools) / 1000:.1f}, max {max(tools) / 1000:.1f})")
    print(f"message/reasoning/request/dataset median {median(parts) / 1000:.1f} KB")
    raw = b"\n".join(lines)
    print(f"trajectories.jsonl {len(raw) / 1e6:.2f} MB, gzip {len(gzip.compress(raw)) / len(raw):.1%} of it")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
