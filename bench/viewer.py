#!/usr/bin/env python
"""Benchmark of the trajectory viewer (--view) on a 100,000-prompt run directory.

    python bench/viewer.py              # N=100,000 (about 350 MB of rows), 5 repeats
    python bench/viewer.py --n=10000 --repeats=2

A synthetic run directory in the real row format (batch_<N>.jsonl of --batch_size 10, so 10,000
batch files, plus discarded.jsonl and failures.jsonl) is written under bench/out/, then the real
CLI serves it (`python batch_runner.py --view --view_port=0`) and every request goes over HTTP on
127.0.0.1, as the browser's would. Times are medians over the repeats; each repeat turns pages at
random places. The viewer brings its index up to date at most once a second, so the scenario
"after 1 s idle" pays for that check (a stat of every file), and "after 1,000 rows landed" for
reading them. The same operations are then timed in this process in CPU seconds, which a busy
shared machine inflates far less than wall time. Results go to the "Viewer" section of bench/RESULTS.md (replaced on every run).
"""
from __future__ import annotations

import argparse
import http.client
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson

from harness import write_section

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
START, END = "<!-- viewer -->", "<!-- /viewer -->"
TARGET_MS = 100.0
BATCH = 10
TOOLS = ("terminal", "read_file", "write_file", "patch", "search_files", "web_search", "web_extract")
OUTPUT = "\n".join(f"line {i}: " + "x" * 60 for i in range(20))


def row(i: int) -> dict:
    tool = TOOLS[i % len(TOOLS)]
    key = f"{i:040x}-0"
    call = {"id": f"call_{i}", "name": tool, "arguments": {"command": f"echo {i}"}}
    stats = {t: {"count": int(t == tool), "success": int(t == tool and i % 9 != 0), "failure": int(t == tool and i % 9 == 0)}
             for t in TOOLS}
    return {
        "prompt_index": i,
        "conversations": [
            {"from": "system", "value": "You are a capable assistant with access to tools. " * 5},
            {"from": "human", "value": f"prompt {i}: write a program that " + "does something useful " * (i % 12 + 2)},
            {"from": "gpt", "value": f"<think>\nplan {i}\n</think>\n<tool_call>\n{orjson.dumps(call).decode()}\n</tool_call>",
             "tool_calls": [call]},
            {"from": "tool", "value": "<tool_response>\n" + orjson.dumps(
                {"tool_call_id": call["id"], "name": tool, "content": {"output": OUTPUT, "exit_code": 0}}).decode()
             + "\n</tool_response>", "tool_call_id": call["id"]},
            {"from": "gpt", "value": "<think>\ndone\n</think>\nHere is the answer. " * 3},
        ],
        "metadata": {"batch_num": i // BATCH, "timestamp": "2026-12-01T00:00:00+00:00", "model": "bench", "id": f"task-{i}",
                     "prompt_key": key, "format_version": 1, "toolsets_sampled": ["terminal", "file"],
                     "toolsets_offered": ["terminal", "file"], "hallucinated_tools": ["made_up"] if i % 100 == 7 else [],
                     "assistant_turns": 2, "turns_with_reasoning": 2,
                     "usage": {"prompt_tokens": 800 + i % 400, "completion_tokens": 200 + i % 50, "reasoning_tokens": 0,
                               "cost": None, "api_calls": 2, "wall_seconds": 1.0}},
        "completed": True, "partial": False, "api_calls": 2, "toolsets_used": ["terminal", "file"],
        "tool_stats": stats, "tool_error_counts": {t: s["failure"] for t, s in stats.items()},
    }


def make_run(run_dir: Path, n: int) -> int:
    """Rows 0..n-1: every 50th discarded, every 50th (offset 25) failed; returns the bytes written."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    side = {"discarded.jsonl": [], "failures.jsonl": []}
    for batch in range(0, n, BATCH):
        lines = []
        for i in range(batch, min(n, batch + BATCH)):
            record = row(i)
            if i % 50 == 0:
                side["discarded.jsonl"].append({"prompt_key": record["metadata"]["prompt_key"], "prompt_index": i,
                                                "batch_num": i // BATCH, "reason": "no_reasoning", "row": record})
            elif i % 50 == 25:
                side["failures.jsonl"].append({"prompt_key": record["metadata"]["prompt_key"], "prompt_index": i,
                                               "batch_num": i // BATCH, "error_class": "APITimeoutError",
                                               "message": "Request timed out.", "time": "2026-12-01T00:00:00+00:00"})
            else:
                lines.append(orjson.dumps(record))
        (run_dir / f"batch_{batch // BATCH}.jsonl").write_bytes(b"\n".join(lines) + b"\n" if lines else b"")
    for name, records in side.items():
        (run_dir / name).write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    (run_dir / "manifest.json").write_bytes(orjson.dumps({"run_name": run_dir.name, "model": "bench",
                                                          "dataset": {"prompts": n, "invalid_lines_skipped": 0}}))
    return sum(p.stat().st_size for p in run_dir.iterdir())


class Client:
    """The page's requests: its host, and the cookie that carries the viewer's token."""

    def __init__(self, port: int, token: str):
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        self.headers = {"Host": f"127.0.0.1:{port}", "Cookie": f"trajgen-viewer-{port}={token}", "Connection": "close"}

    def get(self, path: str) -> tuple[float, bytes]:
        started = time.perf_counter()
        self.connection.request("GET", path, headers=self.headers)
        response = self.connection.getresponse()
        body = response.read()
        elapsed = time.perf_counter() - started
        self.connection.close()
        assert response.status != 403, body  # refused: the token did not reach the viewer
        return elapsed, body


def hwm_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024


def run(n: int, repeats: int, pages: int) -> list[tuple[str, str, str]]:
    run_dir = BENCH / "out" / "viewer" / "run"
    size = make_run(run_dir, n)
    rows: list[tuple[str, str, str]] = [("run directory", f"{n:,} prompts, {size / 1e6:.0f} MB, "
                                         f"{len(list(run_dir.glob('batch_*.jsonl'))):,} batch files", "")]
    times: dict[str, list[float]] = {}
    starts: list[float] = []
    hwm: list[float] = []
    rng = random.Random(0)
    for _ in range(repeats):
        started = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "batch_runner.py"), "--view", "--run_name=run", f"--output_dir={run_dir.parent}",
             "--view_port=0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        port, token = re.search(r"127\.0\.0\.1:(\d+)/\?token=([\w-]+)", process.stdout.readline()).groups()
        starts.append(time.perf_counter() - started)
        client = Client(int(port), token)
        try:
            def timed(name: str, path: str) -> bytes:
                elapsed, body = client.get(path)
                times.setdefault(name, []).append(elapsed)
                return body

            timed("summary, first", "/api/summary")
            timed("summary, again", "/api/summary")
            timed("first page of 100", "/api/entries?start=0&limit=100")
            for _ in range(pages):
                timed("page of 100 at a random place", f"/api/entries?start={rng.randrange(n - 100)}&limit=100")
            timed("filter tool=read_file, first page", "/api/entries?tool=read_file&limit=100")
            for _ in range(pages):
                timed("filter tool=read_file, next pages", f"/api/entries?tool=read_file&start={rng.randrange(n // 8)}&limit=100")
            timed("filter status=failed, first page", "/api/entries?status=failed&limit=100")
            timed("search prompt text, first page", f"/api/entries?q=prompt+{rng.randrange(n)}%3A&limit=100")
            for _ in range(pages):
                key = f"{rng.randrange(n):040x}-0"
                timed("open one conversation", f"/api/entry?key={key}")
            time.sleep(1.1)
            timed("page after 1 s idle (checks every file)", "/api/entries?start=500&limit=100")
            with open(run_dir / f"batch_{n // BATCH}.jsonl", "ab") as f:
                f.write(b"".join(orjson.dumps(row(n + i)) + b"\n" for i in range(1000)))
            time.sleep(1.1)
            timed("page after 1,000 rows landed", "/api/entries?start=500&limit=100")
            (run_dir / f"batch_{n // BATCH}.jsonl").unlink()
            hwm.append(hwm_mb(process.pid))
        finally:
            process.send_signal(2)
            process.wait(timeout=60)
    rows.append(("start: index built and summary ready, URL printed", f"{statistics.median(starts):.2f} s", ""))
    rows.append(("viewer peak RSS", f"{statistics.median(hwm):.0f} MB", ""))
    for name, values in times.items():
        ms = 1000 * statistics.median(values)
        verdict = "" if "page" not in name else ("pass" if ms < TARGET_MS else "fail")
        rows.append((name, f"{ms:.1f} ms", verdict))
    return rows


def cpu(run_dir: Path, n: int, repeats: int) -> list[tuple[str, str, str]]:
    """The same work in this process, timed in CPU seconds (time.process_time): what a page costs
    on a core of its own, whatever else the shared machine is doing."""
    sys.path.insert(0, str(ROOT))
    from trajgen.viewer.index import RunIndex
    from trajgen.viewer.query import Filters, Pager
    from trajgen.viewer.summary import read_filtering, summarize

    times: dict[str, list[float]] = {}

    def timed(name: str, work) -> None:
        started = time.process_time()
        work()
        times.setdefault(name, []).append(time.process_time() - started)

    for _ in range(repeats):
        index = RunIndex(run_dir)
        pager = Pager(index)
        timed("CPU: index of the whole run", index.refresh)
        timed("CPU: summary", lambda: summarize(index))
        timed("CPU: order the list (once per change)", pager.ordered)
        filtering = read_filtering(run_dir, index)
        timed("CPU: page of 100", lambda: pager.page(Filters(), filtering, n // 2, 100))
        timed("CPU: filter tool=read_file, first page", lambda: pager.page(Filters(tool="read_file"), filtering, 0, 100))
        timed("CPU: filter status=failed, first page", lambda: pager.page(Filters(status="failed"), filtering, 0, 100))
        timed("CPU: search prompt text, first page", lambda: pager.page(Filters(q="prompt 4242:"), filtering, 0, 100))
        timed("CPU: check every file, nothing new", index.refresh)
    return [(name, f"{1000 * statistics.median(values):.1f} ms",
             "" if "page" not in name else ("pass" if 1000 * statistics.median(values) < TARGET_MS else "fail"))
            for name, values in times.items()]


def write(rows: list[tuple[str, str, str]], n: int, repeats: int, pages: int, load: str) -> None:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    date = time.strftime("%Y-%m-%d", time.gmtime())
    lines = [START, "## Viewer", "",
             f"`python bench/viewer.py --n={n} --repeats={repeats}` ({date}, at {head}; {os.cpu_count()} cores, a shared "
             f"machine: load average {load}). Medians over {repeats} viewer starts; within each, {pages} requests per paging scenario. "
             f"Target: under {TARGET_MS:.0f} ms per page, over HTTP on 127.0.0.1.", "",
             "| what | median | page target |", "|---|---|---|"]
    lines += [f"| {name} | {value} | {verdict} |" for name, value, verdict in rows]
    lines.append(END)
    section = "\n".join(lines)
    write_section(START, END, section)
    print(section)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--pages", type=int, default=20, help="requests per paging scenario in each repeat")
    args = p.parse_args()
    before = os.getloadavg()[0]
    rows = run(args.n, args.repeats, args.pages)
    rows += cpu(BENCH / "out" / "viewer" / "run", args.n, args.repeats)
    write(rows, args.n, args.repeats, args.pages, f"{before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
