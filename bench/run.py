#!/usr/bin/env python
"""Benchmark of `python batch_runner.py`: throughput against the latency limit, overhead, scale.

Everything is driven from the outside, as a user would: the real CLI as a subprocess against the
loopback scripted server (`python -m trajgen.scripted_server`) as a separate process, on 127.0.0.1.

    python bench/run.py                                  # throughput, overhead, scale; full sizes (~35 min)
    python bench/run.py --quick                          # small N, one repeat: a smoke run
    python bench/run.py --sections=throughput,overhead   # some sections only
    python bench/run.py --sections=profile               # py-spy profile of the C=256 throughput run
    python bench/run.py --render                         # re-print the table from bench/out/results.json

Sections
  throughput  latency 0.25 s, 2 calls + 1 terminal call per prompt, real local sandbox;
              efficiency = ceil(N/C) * 2 * 0.25 s / wall time (statistics.json duration_seconds).
  overhead    latency 0: CPU seconds per prompt of the CLI and all its children
              (getrusage(RUSAGE_CHILDREN) deltas), without and with one terminal call per prompt.
  scale       latency 0, no tools, N = 10k and 100k: peak RSS (VmHWM) of the parent and of the
              workers, then the time of --resume on the finished run and of the merge.
  profile     py-spy record --subprocesses of one throughput configuration: where the time goes.

Results of each section are kept in bench/out/results.json (a later run of one section replaces
only that section); the table is printed and bench/RESULTS.md rewritten from all of them. Text
between the `<!-- notes -->` markers of RESULTS.md is kept across rewrites. --quick keeps its own
files (bench/out/results-quick.json, bench/out/RESULTS-quick.md) and never touches the full ones.

More sections, not run by default: diag (same workload with more workers, or without the tool
call), pool (the HTTP client alone: httpx vs httpx2 vs aiohttp under openai.AsyncOpenAI), sandbox
(the local bubblewrap sandbox alone), profile (py-spy). --cli-root=DIR --tag=NAME runs the CLI of
another tree (e.g. `git archive 62d04ad | tar -x -C bench/out/trees/62d04ad`) and keeps its
results apart, for before/after comparisons.

Every CLI run waits first (up to --quiet-wait s) for the machine to be quiet, and records how busy
the whole machine was (/proc/stat) and how much CPU went to processes other than the CLI and the
server: other people's jobs, and kernel work of the sandboxes that getrusage does not see.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
CLI_ROOT = ROOT  # where batch_runner.py runs from; --cli-root points at another tree (an older commit)
OUT = BENCH / "out"
RESULTS_JSON = OUT / "results.json"
RESULTS_MD = BENCH / "RESULTS.md"
MACHINE = "2-core, 24 GB"
NOTES_START, NOTES_END = "<!-- notes -->", "<!-- /notes -->"
SECRET_ENV = ("OPENROUTER_API_KEY", "OPENAI_API_KEY", "TERMINAL_ENV")
CLK_TCK = os.sysconf("SC_CLK_TCK")

SCRIPT_TOOL = {"default": [
    {"tool_calls": [{"name": "terminal", "arguments": {"command": "echo hi"}}]},
    {"content": "done"},
]}
SCRIPT_PLAIN = {"default": [{"content": "done"}]}

console = Console(highlight=False)
if not console.is_terminal:  # logs and pipes: wide enough for the table
    console = Console(highlight=False, width=220)


# ----------------------------------------------------------------------------- process hygiene


class Children:
    """Every process this benchmark starts, so that all of them are stopped on any exit path.

    Each child gets its own session (its process group id is its pid): Ctrl-C in the terminal
    reaches only this script, which then stops its children by their ids.
    """

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], **kw) -> subprocess.Popen:
        proc = subprocess.Popen(argv, start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen, grace: float = 20.0) -> None:
        """SIGTERM (the CLI stops cleanly: cancels, removes sandboxes), then SIGKILL its group."""
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in list(reversed(self.procs)):
            self.stop(proc, grace=15.0)


CHILDREN = Children()


def _on_sigterm(signum, frame):  # turn SIGTERM into the same clean exit as Ctrl-C
    raise KeyboardInterrupt


# ----------------------------------------------------------------------------- scripted server


class Server:
    """`python -m trajgen.scripted_server` as a separate process; its CPU time is read from /proc."""

    def __init__(self, script: dict, latency: float, name: str):
        OUT.mkdir(parents=True, exist_ok=True)
        self.script_path = OUT / f"script-{name}.json"
        self.script_path.write_text(json.dumps(script))
        self.latency = latency
        self.log = open(OUT / f"server-{name}.log", "ab")
        self.restarts = 0
        self.start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def restart(self) -> None:
        """Someone else's cleanup may kill it (it happened): start a fresh one, on a new port."""
        CHILDREN.stop(self.proc, grace=5)
        self.restarts += 1
        self.start()

    def start(self) -> None:
        latency = self.latency
        self.proc = CHILDREN.start(
            [sys.executable, "-m", "trajgen.scripted_server", "--script", str(self.script_path), "--latency", str(latency)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log, env=_env(),
        )
        line = _readline_with_timeout(self.proc, 30)
        if not line.startswith("READY "):
            CHILDREN.stop(self.proc)
            raise RuntimeError(f"scripted server did not start: {line!r} (see {self.log.name})")
        self.url = line.split(" ", 1)[1].strip()
        if not self.url.startswith("http://127.0.0.1:"):
            raise RuntimeError(f"scripted server is not on loopback: {self.url}")

    def cpu_seconds(self) -> float:
        return _proc_cpu(self.proc.pid)

    def close(self) -> None:
        CHILDREN.stop(self.proc, grace=10)
        self.log.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _readline_with_timeout(proc: subprocess.Popen, timeout: float) -> str:
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline().decode()), daemon=True)
    t.start()
    t.join(timeout)
    return box[0] if box else ""


def _proc_cpu(pid: int) -> float:
    """utime + stime of one live process, in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return float("nan")


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from the first line of /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # guest time is already in user
    return total - idle, total


QUIET = {"threshold": 0.25, "max_wait": 60.0}


def wait_for_quiet() -> float:
    """Wait (up to --quiet-wait s) until the machine is quiet: busy < --quiet-threshold of all cores
    over 1 s. Other people's jobs share these 2 cores; returns the last busy share seen."""
    deadline = time.monotonic() + QUIET["max_wait"]
    while True:
        a = _cpu_jiffies()
        time.sleep(1.0)
        b = _cpu_jiffies()
        busy = (b[0] - a[0]) / max(1, b[1] - a[1])
        if busy < QUIET["threshold"] or time.monotonic() > deadline:
            if busy >= QUIET["threshold"]:
                say(f"[yellow]machine still busy ({100 * busy:.0f}% of all cores) before this run[/]")
            return busy


def _kthreads_cpu() -> float:
    """utime+stime of every kernel thread (children of kthreadd, pid 2), seconds: where the kernel
    does deferred work such as tearing down a sandbox's namespaces, charged to no process of ours."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == "2":  # ppid
            total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


SOURCES = ("batch_runner.py", "model_tools.py", "toolset_distributions.py", "trajgen")


def code_fingerprint() -> str:
    """Short hash of the runner's Python sources: other engineers edit them while this runs."""
    h = hashlib.blake2b(digest_size=6)
    for name in SOURCES:
        path = CLI_ROOT / name
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            try:
                h.update(str(f.relative_to(CLI_ROOT)).encode() + b"\0" + f.read_bytes())
            except OSError:
                pass
    return h.hexdigest()


def git_head() -> str:
    """The commit the runner's tree is at (read-only); for a --cli-root tree, the --tag given."""
    try:
        out = subprocess.run(["git", "-C", str(CLI_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ----------------------------------------------------------------------------- memory sampler


def _descendants(root: int) -> list[int]:
    """root and every live descendant, via /proc/<pid>/task/<tid>/children."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                todo.extend(int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
            except OSError:
                pass
    return found


def _status_kb(pid: int, keys=("VmHWM", "VmRSS")) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in keys:
                out[name] = int(value.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return out


def _role(root: int, pid: int, cmdline: str) -> str:
    if pid == root:
        return "parent"
    if "spawn_main" in cmdline:
        return "worker"
    if "resource_tracker" in cmdline:
        return "resource_tracker"
    return "other"  # sandboxes: prlimit, bwrap, setpriv, bash


class RssSampler(threading.Thread):
    """Polls VmHWM/VmRSS of a process tree every `interval` s and keeps the max per pid."""

    def __init__(self, root: int, interval: float = 0.2):
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.peak_kb: dict[int, int] = {}
        self.role: dict[int, str] = {}
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.sample()
            self.stop_event.wait(self.interval)

    def sample(self) -> None:
        for pid in _descendants(self.root):
            if pid not in self.role:
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                self.role[pid] = _role(self.root, pid, cmd)
            if self.role[pid] == "other":
                continue  # short-lived sandbox processes: not what this measures
            kb = _status_kb(pid)
            peak = max(kb.get("VmHWM", 0), kb.get("VmRSS", 0))
            if peak:
                self.peak_kb[pid] = max(self.peak_kb.get(pid, 0), peak)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(5)

    def peaks_mb(self) -> dict[str, float | None]:
        by_role = collections.defaultdict(list)
        for pid, kb in self.peak_kb.items():
            by_role[self.role[pid]].append(kb / 1024)
        return {
            "parent_mb": max(by_role["parent"], default=None),
            "worker_mb": max(by_role["worker"], default=None),
            "workers_seen": len(by_role["worker"]),
        }


# ----------------------------------------------------------------------------- one CLI run


@dataclass
class RunResult:
    name: str
    n: int
    returncode: int
    wall_s: float  # subprocess wall time
    duration_s: float | None  # statistics.json duration_seconds (the CLI's own timing)
    cpu_s: float  # user+sys of the CLI and all its (reaped) descendants
    server_cpu_s: float
    ok: int | None
    failed: int | None
    parent_rss_mb: float | None = None
    worker_rss_mb: float | None = None
    workers_seen: int = 0
    maxrss_children_mb: float | None = None  # ru_maxrss of RUSAGE_CHILDREN: the largest reaped descendant
    prompt_wall_p50: float | None = None  # per-prompt metadata.usage.wall_seconds
    prompt_wall_p95: float | None = None
    machine_busy: float | None = None  # share of all cores busy (/proc/stat), kernel threads included
    foreign_cpu_s: float | None = None  # machine busy CPU-s minus the CLI's and the server's: others' load
    kthreads_cpu_s: float | None = None  # CPU of kernel threads during the run (part of foreign_cpu_s)
    background_busy: float | None = None  # share of all cores busy just before the run (nothing of ours running)
    code: str = ""  # fingerprint of the runner's sources when the run started (others edit them meanwhile)
    extra: dict = field(default_factory=dict)


def dataset(n: int) -> Path:
    path = OUT / "data" / f"prompts-{n}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for i in range(n):
                f.write(json.dumps({"prompt": f"bench prompt {i}: say done"}) + "\n")
        tmp.replace(path)
    return path


def cli_argv(data: Path, run_name: str, url: str, workers: int, concurrency: int, extra: tuple = ()) -> list[str]:
    return [
        sys.executable, "batch_runner.py", f"--dataset_file={data}", f"--run_name={run_name}",
        f"--output_dir={OUT / 'runs'}", f"--base_url={url}", "--api_key=dummy", "--model=bench",
        "--require_reasoning=False", "--distribution=terminal_only", f"--num_workers={workers}",
        f"--concurrency={concurrency}", *extra,
    ]


class ServerDied(RuntimeError):
    pass


def run_cli(argv: list[str], run_name: str, n: int, server: Server, timeout: float, sample_rss: bool = True,
            prompt_walls: bool = False, wrap: list[str] | None = None, attempts: int = 3) -> RunResult:
    """One CLI run; if the scripted server dies meanwhile, the run is thrown away and done again
    against a fresh server."""
    for attempt in range(attempts):
        try:
            return _run_cli_once(argv, run_name, n, server, timeout, sample_rss, prompt_walls, wrap)
        except ServerDied:
            if attempt == attempts - 1:
                raise RuntimeError(f"{run_name}: the scripted server died {attempts} times")
            old = server.url
            say(f"[yellow]the scripted server died during {run_name} (not by us): restarting it and the run[/]")
            server.restart()
            argv = [a.replace(old, server.url) for a in argv]
            if "--resume" not in argv:
                _fresh(run_name)
    raise AssertionError("unreachable")


def _run_cli_once(argv: list[str], run_name: str, n: int, server: Server, timeout: float, sample_rss: bool,
                  prompt_walls: bool, wrap: list[str] | None) -> RunResult:
    run_dir = OUT / "runs" / run_name
    log_path = OUT / "logs" / f"{run_name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    code = code_fingerprint()
    background = wait_for_quiet()
    server_cpu0 = server.cpu_seconds()
    stat0, kt0 = _cpu_jiffies(), _kthreads_cpu()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log_path, "ab") as log:
        log.write(("$ " + " ".join(argv) + "\n").encode())
        log.flush()
        proc = CHILDREN.start([*(wrap or []), *argv], cwd=CLI_ROOT, stdout=log, stderr=subprocess.STDOUT, env=_env())
        sampler = RssSampler(proc.pid) if sample_rss else None
        if sampler:
            sampler.start()
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    rc = proc.wait(1.0)
                    break
                except subprocess.TimeoutExpired:
                    if not server.alive():
                        CHILDREN.stop(proc)
                        raise ServerDied(run_name)
                    if time.monotonic() > deadline:
                        CHILDREN.stop(proc)
                        raise RuntimeError(f"{run_name}: the CLI did not finish within {timeout:.0f} s (see {log_path})")
        except BaseException:  # Ctrl-C: stop the CLI before the server goes away
            CHILDREN.stop(proc)
            raise
        finally:
            if sampler:
                sampler.stop()
        CHILDREN.procs.remove(proc) if proc in CHILDREN.procs else None
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    stat1, kt1 = _cpu_jiffies(), _kthreads_cpu()
    server_cpu = server.cpu_seconds() - server_cpu0
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    stats = {}
    if (run_dir / "statistics.json").exists():
        stats = json.loads((run_dir / "statistics.json").read_text())
    result = RunResult(
        name=run_name, n=n, returncode=rc, wall_s=wall, duration_s=stats.get("duration_seconds"), cpu_s=cpu,
        server_cpu_s=server_cpu, ok=stats.get("ok"), failed=(stats.get("failed") or {}).get("total"),
        maxrss_children_mb=after.ru_maxrss / 1024, code=code,
        machine_busy=(stat1[0] - stat0[0]) / max(1, stat1[1] - stat0[1]),
        foreign_cpu_s=(stat1[0] - stat0[0]) / CLK_TCK - cpu - server_cpu, background_busy=background,
        kthreads_cpu_s=kt1 - kt0,
    )
    if sampler:
        peaks = sampler.peaks_mb()
        result.parent_rss_mb, result.worker_rss_mb, result.workers_seen = (
            peaks["parent_mb"], peaks["worker_mb"], peaks["workers_seen"])
    if prompt_walls and (run_dir / "trajectories.jsonl").exists():
        walls = []
        with open(run_dir / "trajectories.jsonl", "rb") as f:
            for line in f:
                walls.append(json.loads(line)["metadata"]["usage"]["wall_seconds"])
        if walls:
            walls.sort()
            result.prompt_wall_p50 = walls[len(walls) // 2]
            result.prompt_wall_p95 = walls[min(len(walls) - 1, int(len(walls) * 0.95))]
    if rc != 0 or result.ok != n:
        console.print(f"[yellow]warning:[/] {run_name}: exit {rc}, ok={result.ok}/{n}, failed={result.failed} "
                      f"(see {log_path})")
    return result


def _fresh(run_name: str) -> None:
    shutil.rmtree(OUT / "runs" / run_name, ignore_errors=True)


def _drop(run_name: str, keep: bool) -> None:
    if not keep:
        _fresh(run_name)


def median(values):
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(values) if values else None


def spread(values) -> str:
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return ""
    return f"{min(values):.3g}–{max(values):.3g}"


def say(message: str) -> None:
    console.print(f"[dim]{datetime.now().strftime('%H:%M:%S')}[/] {message}")


# ----------------------------------------------------------------------------- sections


LATENCY = 0.25
KEEP_RUNS = False
TAG = ""


def _throughput_runs(configs: list[tuple[int, int, bool]], n: int, repeats: int, tag: str) -> dict:
    """Latency 0.25 s; with tools: reply 0 calls `terminal` (echo hi), reply 1 ends; else one reply."""
    data = dataset(n)
    runs: dict[str, list[dict]] = collections.defaultdict(list)
    servers = {}
    try:
        for tools in sorted({c[2] for c in configs}, reverse=True):
            servers[tools] = Server(SCRIPT_TOOL if tools else SCRIPT_PLAIN, LATENCY, f"{tag}-{'tool' if tools else 'plain'}")
        for rep in range(repeats):
            for workers, conc, tools in configs:  # interleaved, so that noise spreads over every configuration
                calls = 2 if tools else 1
                ideal = math.ceil(n / conc) * calls * LATENCY
                key = f"{workers}x{conc}" + ("" if tools else "-notools")
                name = f"{tag}-w{workers}-c{conc}{'' if tools else '-notools'}-n{n}-r{rep}"
                _fresh(name)
                say(f"{tag} {name}: ideal {ideal:.1f} s")
                r = run_cli(cli_argv(data, name, servers[tools].url, workers, conc), name, n, servers[tools],
                            timeout=max(300.0, 10 * ideal), sample_rss=False, prompt_walls=True)
                _drop(name, KEEP_RUNS)
                eff = ideal / r.duration_s if r.duration_s else None
                say(f"  duration {r.duration_s} s, wall {r.wall_s:.2f} s, efficiency {eff and round(eff, 3)}, "
                    f"cpu {r.cpu_s:.1f} s, server cpu {r.server_cpu_s:.1f} s, prompt wall p50 {r.prompt_wall_p50}")
                runs[key].append({**r.__dict__, "ideal_s": ideal, "efficiency": eff, "workers": workers,
                                  "concurrency": conc, "tools": tools, "calls": calls})
    finally:
        for server in servers.values():
            server.close()
    return dict(runs)


def section_throughput(args) -> dict:
    configs = [(2, 64, True), (2, 256, True), (4, 4, True)]
    if args.throughput_configs:
        configs = [(*(int(x) for x in c.split("x")), True) for c in args.throughput_configs.split(",")]
    return {"n": args.n_throughput, "latency": LATENCY,
            "configs": _throughput_runs(configs, args.n_throughput, args.repeats, "tp")}


def section_diag(args) -> dict:
    """Where the throughput limit comes from: more workers for the same concurrency (fewer
    connections per httpx pool), and the same run without the sandbox (no tool call)."""
    configs = []
    for c in args.diag_configs.split(","):
        tools = not c.endswith("-notools")
        w, conc = (int(x) for x in c.removesuffix("-notools").split("x"))
        configs.append((w, conc, tools))
    return {"n": args.n_throughput, "latency": LATENCY,
            "configs": _throughput_runs(configs, args.n_throughput, args.repeats, "diag")}


POOL_MICRO = r"""
import asyncio, json, resource, sys, time
import openai
kind, url, conns, total = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if kind == "aiohttp":  # openai.DefaultAioHttpClient, as trajgen/llm.py builds it since d607319
    from openai._constants import DEFAULT_CONNECTION_LIMITS
    limits = type(DEFAULT_CONNECTION_LIMITS)(max_connections=conns, max_keepalive_connections=conns)
    http = openai.DefaultAioHttpClient(limits=limits, timeout=600.0)
else:
    http_mod = __import__(kind)
    http = http_mod.AsyncClient(limits=http_mod.Limits(max_connections=conns, max_keepalive_connections=conns),
                                timeout=http_mod.Timeout(600.0, connect=30.0))
client = openai.AsyncOpenAI(base_url=url, api_key="dummy", max_retries=0, http_client=http)
schemas = [{"type": "function", "function": {"name": "terminal", "description": "Run a shell command in your sandbox "
            "and return its combined stdout and stderr and exit code.", "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "description": "The shell command to run."}, "timeout": {"type": "integer",
            "minimum": 1, "description": "Seconds before the command is killed."}}, "required": ["command"],
            "additionalProperties": False}}}]
system = {"role": "system", "content": "You are a capable assistant with access to tools."}

async def one(i):
    await client.chat.completions.create(model="bench", tools=schemas,
                                         messages=[system, {"role": "user", "content": f"bench prompt {i}"}])

async def main():
    sem = asyncio.Semaphore(conns)
    async def guarded(i):
        async with sem:
            await one(i)
    await asyncio.gather(*(one(-1 - i) for i in range(conns)))  # open every connection first
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    await asyncio.gather(*(guarded(i) for i in range(total)))
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), "wall_s": t1 - t0}))
    await client.close()

asyncio.run(main())
"""


def section_pool(args) -> dict:
    """One process, one openai.AsyncOpenAI client, `conns` requests in flight (one worker's share of
    --concurrency): CPU per request of the legacy httpx client (what trajgen/llm.py passed until
    d607319), of httpx2 (the openai SDK's own default) and of aiohttp (openai.DefaultAioHttpClient,
    what trajgen/llm.py passes since d607319), at latency 0.25 s."""
    out: dict = {"latency": LATENCY, "runs": collections.defaultdict(list)}
    with Server(SCRIPT_PLAIN, LATENCY, "pool") as server:
        for rep in range(args.repeats):
            for kind in ("httpx", "httpx2", "aiohttp"):
                for conns in (32, 128):
                    total = 40 * conns  # 40 waves: ideal 10 s
                    background = wait_for_quiet()
                    say(f"pool {kind} connections={conns} requests={total}")
                    proc = CHILDREN.start([sys.executable, "-c", POOL_MICRO, kind, server.url, str(conns), str(total)],
                                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
                    try:
                        o, e = proc.communicate(timeout=600)
                    finally:
                        CHILDREN.stop(proc)
                    if proc.returncode != 0:
                        raise RuntimeError(f"pool micro-benchmark failed: {e.decode()[-2000:]}")
                    r = json.loads(o)
                    r.update(total=total, ideal_s=40 * LATENCY, cpu_ms_per_request=1000 * r["cpu_s"] / total,
                             background_busy=background)
                    say(f"  cpu {r['cpu_ms_per_request']:.2f} ms/request, wall {r['wall_s']:.1f} s (ideal 10 s)")
                    out["runs"][f"{kind}@{conns}"].append(r)
    out["runs"] = dict(out["runs"])
    return out


SANDBOX_MICRO = r"""
import asyncio, json, os, resource, shutil, sys, tempfile, time
from trajgen.sandbox.config import SandboxConfig
from trajgen.sandbox.local import bwrap_argv, limit_argv, run_process, sandbox_env

variant, conc, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
root = tempfile.mkdtemp(prefix="bench-sandbox-")
config = SandboxConfig(root_dir=root)

def jiffies():
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return sum(v[:8]) - v[3] - v[4], sum(v[:8])

def kthreads():
    total = 0
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                f = open(f"/proc/{e}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if f[1] == "2":
                total += int(f[11]) + int(f[12])
    return total / os.sysconf("SC_CLK_TCK")

def argv(i):
    d = os.path.join(root, str(i))
    os.mkdir(d)
    if os.geteuid() == 0:
        os.chown(d, 65534, 65534)
    if variant == "bwrap":
        a = bwrap_argv(d, "/workspace", False, "echo hi")
    elif variant == "bwrap-with-network":  # the same without --unshare-net: no network namespace
        a = bwrap_argv(d, "/workspace", True, "echo hi")
    else:  # no bubblewrap: prlimit + bash, as --unsafe_local
        a = ["bash", "-c", "echo hi"]
    return [*limit_argv(config), *a], d

async def main():
    sem, lat = asyncio.Semaphore(conc), []
    async def one(i):
        async with sem:
            a, d = argv(i)
            t = time.perf_counter()
            r = await run_process(a, 60, sandbox_env("/workspace"), cwd=d)
            lat.append(time.perf_counter() - t)
            if r.exit_code != 0 or "hi" not in r.output:
                raise SystemExit(f"sandbox command failed: {r}")
            shutil.rmtree(d)
    j0, k0, t0 = jiffies(), kthreads(), time.perf_counter()
    r0 = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    await asyncio.gather(*(one(i) for i in range(total)))
    r1 = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    j1, k1, t1 = jiffies(), kthreads(), time.perf_counter()
    cpu = sum((b.ru_utime - a.ru_utime) + (b.ru_stime - a.ru_stime) for a, b in zip(r0, r1))
    lat.sort()
    print(json.dumps({"wall_s": t1 - t0, "cpu_s": cpu, "machine_cpu_s": (j1[0] - j0[0]) / os.sysconf("SC_CLK_TCK"),
                      "kthreads_cpu_s": k1 - k0,
                      "p50_s": lat[len(lat) // 2], "p95_s": lat[int(len(lat) * 0.95)]}))
    shutil.rmtree(root, ignore_errors=True)

asyncio.run(main())
"""


def section_sandbox(args) -> dict:
    """The local sandbox alone (trajgen.sandbox.local.run_process with the runner's own argv), one
    `echo hi` per command: latency, commands per second, CPU per command, and how much CPU the
    machine spent beyond our processes (kernel namespace set-up and teardown)."""
    out: dict = {"runs": collections.defaultdict(list)}
    for rep in range(args.repeats):
        for variant in ("plain", "bwrap", "bwrap-with-network"):
            for conc, total in ((1, 100), (32, 800)):
                background = wait_for_quiet()
                say(f"sandbox {variant} concurrency={conc} commands={total}")
                proc = CHILDREN.start([sys.executable, "-c", SANDBOX_MICRO, variant, str(conc), str(total)],
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
                try:
                    o, e = proc.communicate(timeout=900)
                finally:
                    CHILDREN.stop(proc)
                if proc.returncode != 0:
                    raise RuntimeError(f"sandbox micro-benchmark failed: {(o + e).decode()[-2000:]}")
                r = json.loads(o)
                r.update(total=total, background_busy=background, per_s=total / r["wall_s"],
                         cpu_ms=1000 * r["cpu_s"] / total, machine_cpu_ms=1000 * r["machine_cpu_s"] / total,
                         kthreads_ms=1000 * r.get("kthreads_cpu_s", float("nan")) / total)
                say(f"  {r['per_s']:.0f} commands/s, p50 {1000 * r['p50_s']:.0f} ms, CPU {r['cpu_ms']:.1f} ms/command "
                    f"(machine {r['machine_cpu_ms']:.1f} ms, kernel threads {r['kthreads_ms']:.1f} ms)")
                out["runs"][f"{variant}@{conc}"].append(r)
    out["runs"] = dict(out["runs"])
    return out


def section_overhead(args) -> dict:
    n = args.n_overhead
    data = dataset(n)
    workers, conc = args.overhead_workers, args.overhead_concurrency
    out: dict = {"n": n, "workers": workers, "concurrency": conc}
    for label, script in (("no_tools", SCRIPT_PLAIN), ("terminal", SCRIPT_TOOL)):
        with Server(script, 0.0, f"overhead-{label}") as server:
            # the fixed cost of one invocation (imports, dataset check, worker spawn, merge): N = 1
            one = dataset(1)
            fixed = []
            for rep in range(args.repeats):
                name = f"ov-{label}-n1-r{rep}"
                _fresh(name)
                r = run_cli(cli_argv(one, name, server.url, workers, conc), name, 1, server, timeout=120,
                            sample_rss=False)
                _drop(name, KEEP_RUNS)
                fixed.append(r.__dict__)
            runs = []
            for rep in range(args.repeats):
                name = f"ov-{label}-n{n}-r{rep}"
                _fresh(name)
                say(f"overhead {name}")
                r = run_cli(cli_argv(data, name, server.url, workers, conc), name, n, server, timeout=1800,
                            sample_rss=False, prompt_walls=True)
                _drop(name, KEEP_RUNS)
                say(f"  cpu {r.cpu_s:.2f} s = {1000 * r.cpu_s / n:.2f} ms/prompt, duration {r.duration_s} s, "
                    f"server cpu {r.server_cpu_s:.2f} s")
                runs.append(r.__dict__)
            out[label] = {"runs": runs, "fixed_n1": fixed}
    return out


def section_scale(args) -> dict:
    out: dict = {"workers": args.scale_workers, "concurrency": args.scale_concurrency, "sizes": {}}
    with Server(SCRIPT_PLAIN, 0.0, "scale") as server:
        for n in args.scale_sizes:
            data = dataset(n)
            name = f"scale-n{n}"
            _fresh(name)
            argv = cli_argv(data, name, server.url, args.scale_workers, args.scale_concurrency)
            say(f"scale {name}")
            r = run_cli(argv, name, n, server, timeout=args.scale_timeout)
            say(f"  duration {r.duration_s} s, parent peak {r.parent_rss_mb} MB, worker peak {r.worker_rss_mb} MB, "
                f"cpu {r.cpu_s:.1f} s")
            entry = {"run": r.__dict__}
            run_dir = OUT / "runs" / name
            entry["disk_mb"] = round(sum(p.stat().st_size for p in run_dir.iterdir()) / 2**20, 1)
            # --resume on the finished run: scans every batch file, plans nothing, spawns the pool, merges
            resumes = []
            for rep in range(args.repeats):
                rname = f"{name}"
                say(f"  resume #{rep + 1} of {name}")
                rr = run_cli([*argv, "--resume"], rname, n, server, timeout=1800)
                say(f"    wall {rr.wall_s:.2f} s, duration {rr.duration_s} s, parent peak {rr.parent_rss_mb} MB")
                resumes.append(rr.__dict__)
            entry["resume"] = resumes
            # the merge and the resume scan alone: trajgen.merge.merge / trajgen.store.scan called directly
            entry["direct"] = [_time_merge(run_dir) for _ in range(args.repeats)]
            say(f"  direct: {entry['direct'][-1]}")
            out["sizes"][str(n)] = entry
            _drop(name, KEEP_RUNS)
    return out


MERGE_TIMER = r"""
import json, sys, time, resource
from pathlib import Path
from trajgen import merge, store
run_dir = Path(sys.argv[1])
t0 = time.perf_counter(); s = store.scan(run_dir); t1 = time.perf_counter()
m = merge.merge(run_dir, False); t2 = time.perf_counter()
print(json.dumps({"scan_s": t1 - t0, "merge_s": t2 - t1, "rows": m.kept.rows, "done": len(s.done),
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _time_merge(run_dir: Path) -> dict:
    proc = CHILDREN.start([sys.executable, "-c", MERGE_TIMER, str(run_dir)], cwd=CLI_ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, env=_env())
    out, err = proc.communicate(timeout=1800)
    CHILDREN.procs.remove(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"merge timer failed: {err.decode()[-2000:]}")
    return json.loads(out)


def section_profile(args) -> dict:
    """py-spy record of the CLI and its workers during one throughput configuration."""
    if shutil.which("py-spy") is None:
        raise RuntimeError("py-spy is not installed: pip install py-spy")
    n = args.n_throughput
    workers, conc = (int(x) for x in args.profile_config.split("x"))
    data = dataset(n)
    result: dict = {"n": n, "workers": workers, "concurrency": conc, "rate": args.profile_rate}
    with Server(SCRIPT_TOOL, LATENCY, "profile") as server:
        for fmt in ("raw", "flamegraph"):
            name = f"profile-w{workers}-c{conc}-n{n}-{fmt}"
            _fresh(name)
            stem = f"profile-{TAG + '-' if TAG else ''}{workers}x{conc}"
            target = OUT / (f"{stem}.txt" if fmt == "raw" else f"{stem}.svg")
            wrap = ["py-spy", "record", "--subprocesses", "--threads", "--idle", "--rate", str(args.profile_rate), "--format", fmt,
                    "-o", str(target), "--"]
            say(f"profile {name} -> {target}")
            r = run_cli(cli_argv(data, name, server.url, workers, conc), name, n, server, timeout=1800,
                        sample_rss=False, prompt_walls=True, wrap=wrap)
            _drop(name, KEEP_RUNS)
            ideal = math.ceil(n / conc) * 2 * LATENCY
            result[fmt] = {"file": str(target.relative_to(ROOT)), "duration_s": r.duration_s,
                           "efficiency_under_profiler": ideal / r.duration_s if r.duration_s else None}
            if fmt == "raw":
                result["summary"] = summarize_profile(target)
    return result


FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
HEADER = re.compile(r'^((?:process \d+:"[^"]*";)*)(?:thread \((\d+)\)(?:: ([^;]*))?(?:;|$))?(.*)$')
PACKAGE_LABELS = {"selectors.py": "selectors", "subprocess.py": "subprocess", "threading.py": "threading",
                  "shutil.py": "shutil", "typing.py": "typing", "json": "json", "<frozen importlib._bootstrap>": "import",
                  "<frozen importlib._bootstrap_external>": "import"}


def _package(file: str) -> str:
    """py-spy prints files relative to sys.path: the first component is the package (or module)."""
    head = file.split("/", 1)[0] if "/" in file else file
    return PACKAGE_LABELS.get(head, head.removesuffix(".py"))


# Leaf frames that are a thread blocked in a system call, not work (py-spy's idle detection does not
# catch them here): the event loop's epoll wait, idle to_thread pool threads, waitpid threads, the
# worker's pipe-reader thread, rich's refresh thread between refreshes.
IDLE_LEAVES = ("_PollLikeSelector.select", "EpollSelector.select", "ThreadedChildWatcher._do_waitpid",
               "Condition.wait", "Event.wait", "Thread.join", "wait (multiprocessing/connection.py")
IDLE_IN_SIDE_THREADS = ("Connection._recv", "_worker (concurrent/futures/thread.py:81)")


def _process_role(headers: list[str]) -> str:
    if len(headers) <= 1:
        return "parent"
    return "worker" if "spawn_main" in headers[-1] else "other"


def _is_idle(leaf: str, main_thread: bool) -> bool:
    if any(k in leaf for k in IDLE_LEAVES):
        return True
    return not main_thread and any(k in leaf for k in IDLE_IN_SIDE_THREADS)


def summarize_profile(path: Path, top: int = 20) -> dict:
    """Collapsed stacks (py-spy record --format raw --threads --subprocesses) -> per process role:
    samples, how busy the main thread (the event loop) is, self time by package and the top
    inclusive frames, as shares of the busy samples (blocked-in-a-syscall leaves are excluded)."""
    roles: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        count = int(count)
        m = HEADER.match(stack)
        headers = re.findall(r'process \d+:"[^"]*"', m.group(1))
        role = _process_role(headers) if headers else "all"
        main = (m.group(3) or "").strip() == "MainThread"
        frames = [f for f in m.group(4).split(";") if f]
        r = roles.setdefault(role, {"samples": 0, "busy": 0, "main": 0, "main_busy": 0, "pids": set(),
                                    "self_pkg": collections.Counter(), "self_fn": collections.Counter(),
                                    "incl_fn": collections.Counter()})
        if headers:
            r["pids"].add(headers[-1].split(":", 1)[0])
        r["samples"] += count
        r["main"] += count if main else 0
        if not frames or _is_idle(frames[-1], main):
            continue
        r["busy"] += count
        r["main_busy"] += count if main else 0
        names = []
        for f in frames:
            fm = FRAME.match(f)
            file = fm.group("file") if fm else f
            func = fm.group("func") if fm else f
            short = re.sub(r"^.*?(site-packages|lib/python3\.\d+|work/main)/", "", file)
            names.append((f"{short}:{func}", file))
        leaf_name, leaf_file = names[-1]
        r["self_pkg"][_package(leaf_file)] += count
        r["self_fn"][leaf_name] += count
        for name in {n for n, _ in names}:
            r["incl_fn"][name] += count
    summary = {}
    for role, r in roles.items():
        busy = r["busy"] or 1
        processes = max(1, len(r["pids"]))
        summary[role] = {
            "processes": processes,
            "samples": r["samples"],
            "busy_samples": r["busy"],
            "main_thread_busy": round(r["main_busy"] / r["main"], 3) if r["main"] else None,
            "self_by_package": [(k, round(v / busy, 3)) for k, v in r["self_pkg"].most_common()],
            "top_self": [(k, round(v / busy, 3)) for k, v in r["self_fn"].most_common(top)],
            "top_inclusive": [(k, round(v / busy, 3)) for k, v in r["incl_fn"].most_common(top * 4)],
        }
    return summary


# ----------------------------------------------------------------------------- report


@dataclass
class Row:
    section: str
    config: str
    value: str
    target: str
    verdict: str  # PASS / FAIL / info
    note: str = ""


def _fmt(v, digits=2, unit=""):
    return "n/a" if v is None else f"{v:.{digits}f}{unit}"


def _verdict(ok) -> str:
    return "info" if ok is None else ("PASS" if ok else "FAIL")


def _throughput_rows(res: dict, section: str, targets: dict) -> list[Row]:
    rows = []
    n = res["n"]
    base = res["configs"].get("4x4")
    base_dur = median([r["duration_s"] for r in base]) if base else None
    for key, runs in res["configs"].items():
        workers, conc = runs[0]["workers"], runs[0]["concurrency"]
        tools = runs[0].get("tools", True)
        eff = median([r["efficiency"] for r in runs])
        dur = median([r["duration_s"] for r in runs])
        wall = median([r["wall_s"] for r in runs])
        ideal = runs[0]["ideal_s"]
        target = targets.get(key)
        note = (f"ideal {ideal:.1f} s; duration {_fmt(dur, 1)} s (subprocess wall {_fmt(wall, 1)} s); "
                f"runs {len(runs)}")
        if len(runs) > 1:
            note += f" (efficiency {spread([r['efficiency'] for r in runs])})"
        p50 = median([r.get("prompt_wall_p50") for r in runs])
        p95 = median([r.get("prompt_wall_p95") for r in runs])
        if p50 is not None:
            note += f"; per-prompt wall p50 {p50:.2f} s, p95 {p95:.2f} s (floor {runs[0].get('calls', 2) * LATENCY:.2f})"
        cpu = median([r["cpu_s"] for r in runs])
        scpu = median([r["server_cpu_s"] for r in runs])
        if cpu is not None and dur:
            note += (f"; CPU (getrusage) runner {cpu:.1f} s = {1000 * cpu / n:.1f} ms/prompt, server {scpu:.1f} s: "
                     f"{(cpu + scpu) / dur:.2f} of the 2 cores")
        mb = median([r.get("machine_busy") for r in runs])
        if mb is not None:
            kt = median([r.get("kthreads_cpu_s") for r in runs])
            fo = median([r.get("foreign_cpu_s") for r in runs])
            note += (f"; whole machine {100 * mb:.0f}% busy (CPU outside the CLI and the server {_fmt(fo, 1)} s"
                     + (f", kernel threads {kt:.1f} s" if kt is not None else "") + ")")
        if base_dur and dur and key != "4x4":
            note += f"; {base_dur / dur:.1f}x faster than 4x4"
        what = f"N={n:,} --num_workers={workers} --concurrency={conc}" + ("" if tools else ", no tool call (1 API call)")
        rows.append(Row(section, what, f"efficiency {_fmt(eff)}",
                        f">= {target}" if target else ("(reference defaults)" if key == "4x4" else ""),
                        _verdict(eff >= target if (target and eff is not None) else None), note))
    return rows


def rows_throughput(res: dict) -> list[Row]:
    return _throughput_rows(res, "throughput", {"2x64": 0.85, "2x256": 0.70})


def rows_diag(res: dict) -> list[Row]:
    return _throughput_rows(res, "diagnosis", {})


def rows_pool(res: dict) -> list[Row]:
    rows = []
    for key, runs in res["runs"].items():
        kind, conns = key.split("@")
        ms = median([r["cpu_ms_per_request"] for r in runs])
        wall = median([r["wall_s"] for r in runs])
        client = "openai.DefaultAioHttpClient (aiohttp)" if kind == "aiohttp" else f"{kind}.AsyncClient"
        rows.append(Row("http client", f"one process, openai.AsyncOpenAI + {client}, {conns} requests in flight",
                        f"{_fmt(ms)} ms CPU/request", "", "info",
                        f"{runs[0]['total']} requests at latency {LATENCY} s: wall {_fmt(wall, 1)} s for an ideal of "
                        f"{runs[0]['ideal_s']:.0f} s; runs {len(runs)}"
                        + {"httpx": " (trajgen/llm.py's client before d607319)",
                           "httpx2": " (the openai SDK's default client)",
                           "aiohttp": " (trajgen/llm.py's client since d607319)"}.get(kind, "")))
    return rows


def rows_overhead(res: dict) -> list[Row]:
    rows = []
    n = res["n"]
    cfg = f"N={n:,} latency 0, --num_workers={res['workers']} --concurrency={res['concurrency']}"
    per = {}
    for label in ("no_tools", "terminal"):
        if label not in res:
            continue
        runs = res[label]["runs"]
        ms = median([1000 * r["cpu_s"] / n for r in runs])
        dur = median([r["duration_s"] for r in runs])
        wall = median([r["wall_s"] for r in runs])
        srv = median([1000 * r["server_cpu_s"] / n for r in runs])
        fixed = res[label]["fixed_n1"]
        fixed_cpu = median([r["cpu_s"] for r in fixed])
        fixed_dur = median([r["duration_s"] for r in fixed])
        per[label] = (ms, dur, fixed_cpu)
        net = (median([r["cpu_s"] for r in runs]) - fixed_cpu) * 1000 / n if fixed_cpu is not None else None
        kt = median([r.get("kthreads_cpu_s") for r in runs])
        fo = median([r.get("foreign_cpu_s") for r in runs])
        note = (f"runs {len(runs)} (range {spread([1000 * r['cpu_s'] / n for r in runs])} ms); "
                f"machine CPU outside the CLI and the server {_fmt(1000 * fo / n if fo is not None else None, 1)} ms/prompt"
                + (f" (kernel threads {1000 * kt / n:.1f})" if kt is not None else "") + "; "
                f"fixed cost of one invocation (N=1): {_fmt(fixed_cpu, 2)} CPU-s, {_fmt(fixed_dur, 2)} s wall; "
                f"per prompt without it {_fmt(net, 2)} ms; server {_fmt(srv, 2)} ms/prompt (not included)")
        if label == "no_tools":
            rows.append(Row("overhead", f"{cfg}, no tools", f"{_fmt(ms)} ms CPU/prompt", "< 5 ms",
                            _verdict(ms < 5 if ms is not None else None), note))
            rows.append(Row("overhead", f"{cfg}, no tools", f"{_fmt(dur)} s wall ({_fmt(n / dur if dur else None, 0)} prompts/s)",
                            "", "info", f"subprocess wall {_fmt(wall)} s"))
        else:
            rows.append(Row("overhead", f"{cfg}, 1 terminal call (bwrap)", f"{_fmt(ms)} ms CPU/prompt", "", "info", note))
            rows.append(Row("overhead", f"{cfg}, 1 terminal call (bwrap)",
                            f"{_fmt(dur)} s wall ({_fmt(n / dur if dur else None, 0)} prompts/s)", "", "info",
                            f"subprocess wall {_fmt(wall)} s"))
    if "no_tools" in per and "terminal" in per and per["no_tools"][0] is not None:
        d_ms = per["terminal"][0] - per["no_tools"][0]
        d_s = (per["terminal"][1] or 0) - (per["no_tools"][1] or 0)
        rows.append(Row("overhead", "sandbox share (terminal - no tools)",
                        f"{_fmt(d_ms)} ms CPU/prompt ({100 * d_ms / per['terminal'][0]:.0f}% of CPU)", "", "info",
                        f"+{_fmt(d_s)} s wall for {n:,} prompts; the second API call adds part of this too"))
    return rows


def rows_scale(res: dict) -> list[Row]:
    rows = []
    sizes = res["sizes"]
    cfg = f"latency 0, no tools, --num_workers={res['workers']} --concurrency={res['concurrency']}"
    firsts = {}
    for n_str, entry in sizes.items():
        n = int(n_str)
        r = entry["run"]
        firsts[n] = r
        for role, key in (("parent", "parent_rss_mb"), ("one worker (max)", "worker_rss_mb")):
            v = r[key]
            rows.append(Row("scale", f"N={n:,} {cfg}: peak RSS {role}", f"{_fmt(v, 0)} MB", "< 300 MB",
                            _verdict(v < 300 if v is not None else None),
                            f"VmHWM polled every 0.2 s; run {_fmt(r['duration_s'], 1)} s, exit {r['returncode']}, "
                            f"ok {r['ok']:,}" if r["ok"] is not None else "no statistics"))
        rs = entry["resume"]
        rwall = median([x["wall_s"] for x in rs])
        rdur = median([x["duration_s"] for x in rs])
        target = "< 5 s" if n >= 100_000 else ""
        rows.append(Row("scale", f"N={n:,}: --resume of the finished run", f"{_fmt(rwall)} s wall",
                        target, _verdict(rwall < 5 if (target and rwall is not None) else None),
                        f"CLI duration_seconds {_fmt(rdur)} s; parent peak {_fmt(median([x['parent_rss_mb'] for x in rs]), 0)} MB; "
                        f"runs {len(rs)}; it scans, plans nothing, spawns 1 worker, merges"))
        d = entry["direct"]
        rows.append(Row("scale", f"N={n:,}: merge (trajgen.merge.merge, called directly)",
                        f"{_fmt(median([x['merge_s'] for x in d]))} s", "", "info",
                        f"the CLI does not time its merge separately; resume scan (store.scan) "
                        f"{_fmt(median([x['scan_s'] for x in d]))} s; run dir {entry['disk_mb']} MB"))
    if len(firsts) >= 2:
        lo, hi = min(firsts), max(firsts)
        for role, key in (("parent", "parent_rss_mb"), ("worker", "worker_rss_mb")):
            a, b = firsts[lo][key], firsts[hi][key]
            if a and b:
                rows.append(Row("scale", f"peak RSS growth {role}, N={lo:,} -> {hi:,}", f"x{b / a:.2f} (+{b - a:.0f} MB)",
                                "flat (<= x1.2)", _verdict(b / a <= 1.2), ""))
    return rows


def rows_sandbox(res: dict) -> list[Row]:
    rows = []
    labels = {"plain": "prlimit + bash, no bubblewrap", "bwrap": "prlimit + bwrap (the runner's argv)",
              "bwrap-with-network": "the same without --unshare-net"}
    for key, runs in res["runs"].items():
        variant, conc = key.split("@")
        per_s = median([r["per_s"] for r in runs])
        rows.append(Row("sandbox", f"{labels.get(variant, variant)}, {conc} command(s) in flight, `echo hi`",
                        f"{_fmt(per_s, 0)} commands/s", "", "info",
                        f"latency p50 {_fmt(1000 * median([r['p50_s'] for r in runs]), 0)} ms, p95 "
                        f"{_fmt(1000 * median([r['p95_s'] for r in runs]), 0)} ms; CPU "
                        f"{_fmt(median([r['cpu_ms'] for r in runs]), 1)} ms/command in our processes, "
                        f"{_fmt(median([r['machine_cpu_ms'] for r in runs]), 1)} ms machine-wide, of which kernel threads "
                        f"{_fmt(median([r.get('kthreads_ms') for r in runs]), 1)} ms; runs {len(runs)}"))
    return rows


KEY_FRAMES = (  # inclusive shares worth a line in the report
    "httpcore/_async/connection_pool.py:AsyncConnectionPool._assign_requests_to_connections",
    "subprocess.py:Popen._execute_child",
    "shutil.py:rmtree",
    "aiohttp/client.py:ClientSession._request",
    "trajgen/store.py:Writer._sync_loop",
    "httpcore/_async/http11.py:AsyncHTTP11Connection.has_expired",
    "anyio/abc/_sockets.py:_SocketProvider.extra_attributes",
    "httpx/_client.py:AsyncClient.send",
    "openai/_base_client.py:AsyncAPIClient.request",
    "openai/_utils/_transform.py:async_transform",
    "trajgen/sandbox/local.py:run_process",
    "trajgen/sandbox/config.py:open_sandbox",
    "trajgen/sandbox/local.py:LocalSandbox.close",
    "trajgen/store.py:atomic_write",
    "trajgen/store.py:Writer.end_batch",
    "batch_runner.py:_execute.<locals>.checkpoint",
    "trajgen/workers.py:ProcessPool.poll",
    "rich/live.py:Live.refresh",
)


def key_frames(summary_role: dict) -> list[tuple[str, float]]:
    incl = dict(summary_role["top_inclusive"])
    return [(k, incl[k]) for k in KEY_FRAMES if k in incl]


def rows_profile(res: dict) -> list[Row]:
    rows = []
    s = res.get("summary", {})
    for role in ("worker", "parent"):
        if role not in s:
            continue
        r = s[role]
        pk = ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["self_by_package"][:5])
        frames = "; ".join(f"{k.split(':', 1)[1]} {100 * v:.0f}%" for k, v in key_frames(r)[:6])
        rows.append(Row("profile", f"{res['workers']}x{res['concurrency']} N={res['n']:,} under py-spy: {role} "
                                   f"({r['processes']} process{'es' if r['processes'] > 1 else ''})",
                        f"main thread busy {_fmt(100 * r['main_thread_busy'] if r['main_thread_busy'] is not None else None, 0)}%",
                        "", "info", f"self time: {pk}. Inclusive: {frames}. Files: {res['raw']['file']}, "
                                    f"{res['flamegraph']['file']}"))
    return rows


ROW_BUILDERS = {"throughput": rows_throughput, "overhead": rows_overhead, "scale": rows_scale, "diag": rows_diag,
                "pool": rows_pool, "sandbox": rows_sandbox, "profile": rows_profile}


def section_order(results: dict) -> list[str]:
    """Keys of results.json in report order: `name` or `name:tag` (a run of another tree)."""
    order = list(ROW_BUILDERS)
    return sorted(results, key=lambda k: (order.index(k.split(":")[0]) if k.split(":")[0] in order else 99, k))


def build_rows(results: dict) -> list[Row]:
    rows: list[Row] = []
    for key in section_order(results):
        name, _, tag = key.partition(":")
        if name not in ROW_BUILDERS:
            continue
        for row in ROW_BUILDERS[name](results[key]["data"]):
            if tag:
                row.section = f"{row.section} [{tag}]"
            rows.append(row)
    return rows


def print_table(rows: list[Row]) -> None:
    table = Table(title=f"batch_runner benchmark ({MACHINE})", show_lines=True)
    for col in ("section", "configuration", "measured (median)", "target", "pass/fail", "details"):
        table.add_column(col, overflow="fold")
    colors = {"PASS": "green", "FAIL": "red", "info": "dim"}
    for r in rows:
        table.add_row(r.section, r.config, r.value, r.target, f"[{colors[r.verdict]}]{r.verdict}[/]", r.note)
    console.print(table)


def findings(results: dict) -> list[str]:
    """Data-driven sentences; the hand-written analysis lives between the notes markers."""
    out = []
    for section in ("throughput", "diag"):
        tp = results.get(section, {}).get("data")
        for key, runs in (tp or {}).get("configs", {}).items():
            eff = median([r["efficiency"] for r in runs])
            dur = median([r["duration_s"] for r in runs])
            cpu = median([r["cpu_s"] + r["server_cpu_s"] for r in runs])
            mb = median([r.get("machine_busy") for r in runs])
            if dur and cpu:
                out.append(f"{section.capitalize()} {key} (workers x concurrency{'' if runs[0].get('tools', True) else ', no tool'}): "
                           f"efficiency {_fmt(eff)}, {_fmt(dur, 1)} s for an ideal of {runs[0]['ideal_s']:.1f} s; "
                           f"the CLI and the server used {cpu / dur:.2f} of the 2 cores by getrusage"
                           + (f", the whole machine was {100 * mb:.0f}% busy." if mb is not None else "."))
    ov = results.get("overhead", {}).get("data")
    if ov and "no_tools" in ov:
        n = ov["n"]

        def per_prompt(label):
            runs = ov[label]["runs"]
            ours = median([1000 * r["cpu_s"] / n for r in runs])
            machine = median([1000 * (r["cpu_s"] + r["server_cpu_s"] + (r.get("foreign_cpu_s") or 0)) / n for r in runs])
            rate = median([n / r["duration_s"] for r in runs if r["duration_s"]])
            return ours, machine, rate

        ms, mm, rate = per_prompt("no_tools")
        out.append(f"Overhead without tools (latency 0): {_fmt(ms)} ms of CPU per prompt in the CLI and its children "
                   f"(getrusage), {_fmt(mm)} ms for the whole machine; {_fmt(rate, 0)} prompts/s.")
        if "terminal" in ov:
            ms2, mm2, rate2 = per_prompt("terminal")
            out.append(f"With one terminal call in bubblewrap: {_fmt(ms2)} ms per prompt by getrusage but {_fmt(mm2)} ms "
                       f"for the whole machine (kernel work of the sandbox is charged to no process of ours); at "
                       f"latency 0 the box does {_fmt(rate2, 0)} such prompts/s, which caps any run of this workload here: "
                       f"--concurrency=64 at 0.5 s per prompt asks for 128/s, --concurrency=256 for 512/s.")
    sc = results.get("scale", {}).get("data")
    if sc:
        for n_str, e in sc["sizes"].items():
            r = e["run"]
            out.append(f"Scale N={int(n_str):,}: parent peak {_fmt(r['parent_rss_mb'], 0)} MB, worker peak "
                       f"{_fmt(r['worker_rss_mb'], 0)} MB, run {_fmt(r['duration_s'], 1)} s; resume "
                       f"{_fmt(median([x['wall_s'] for x in e['resume']]))} s; merge "
                       f"{_fmt(median([x['merge_s'] for x in e['direct']]))} s.")
    pool = results.get("pool", {}).get("data")
    if pool:
        ms = {k: median([r["cpu_ms_per_request"] for r in v]) for k, v in pool["runs"].items()}
        if ms.get("httpx@128"):
            out.append(f"HTTP client alone, one process, CPU per request at 128 / 32 requests in flight: "
                       f"httpx (trajgen/llm.py before d607319) {_fmt(ms.get('httpx@128'))} / {_fmt(ms.get('httpx@32'))} ms, "
                       f"httpx2 (the SDK's default) {_fmt(ms.get('httpx2@128'))} / {_fmt(ms.get('httpx2@32'))} ms, "
                       f"aiohttp (trajgen/llm.py since d607319) {_fmt(ms.get('aiohttp@128'))} / {_fmt(ms.get('aiohttp@32'))} ms.")
    prof = results.get("profile", {}).get("data", {}).get("summary", {})
    if "worker" in prof:
        w = prof["worker"]
        frames = ", ".join(f"`{k}` {100 * v:.0f}%" for k, v in key_frames(w)[:4])
        out.append(f"Profile (py-spy): the workers' event loops were busy {100 * (w['main_thread_busy'] or 0):.0f}% of "
                   f"the time; of their busy samples: {frames}.")
    return out


def write_markdown(results: dict, rows: list[Row]) -> None:
    old_notes = ""
    if RESULTS_MD.exists():
        text = RESULTS_MD.read_text()
        if NOTES_START in text and NOTES_END in text:
            old_notes = text.split(NOTES_START, 1)[1].split(NOTES_END, 1)[0].strip("\n")
    date = subprocess.run(["date", "-u", "+%F"], capture_output=True, text=True).stdout.strip()
    lines = [
        "# batch_runner benchmark results",
        "",
        f"Machine: {MACHINE} (noisy; medians of repeated runs). Date: {date}. Python {sys.version.split()[0]}.",
        "",
        "Commands (per section, the latest run of each):",
        "",
    ]
    for key in section_order(results):
        r = results[key]
        lines.append(f"- {key} ({r['date']}, repeats {r['repeats']}, runner at {r.get('git_head', '?')}, "
                     f"sources {', '.join(r.get('code', [])) or '?'}): `{r['command']}`")
    lines += [
        "",
        "The CLI runs as `python batch_runner.py --dataset_file=... --run_name=... --output_dir=bench/out/runs "
        "--base_url=<scripted server> --api_key=dummy --model=bench --require_reasoning=False "
        "--distribution=terminal_only --num_workers=W --concurrency=C` against "
        "`python -m trajgen.scripted_server --script FILE --latency L` (both on 127.0.0.1).",
        "",
        "| section | configuration | measured (median) | target | pass/fail | details |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r.section, r.config, r.value, r.target, f"**{r.verdict}**" if r.verdict != "info" else "info", r.note]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", "## Findings", ""]
    lines += [f"- {s}" for s in findings(results)]
    for key in section_order(results):
        if key.split(":")[0] != "profile" or not results[key]["data"].get("summary"):
            continue
        d = results[key]["data"]
        prof = d["summary"]
        tag = key.partition(":")[2]
        lines += ["", f"## Profile{f' [{tag}]' if tag else ''} — runner at {results[key].get('git_head', '?')}, {d['workers']}x{d['concurrency']}, "
                      f"N={d['n']:,} (py-spy record --subprocesses --threads --idle; shares of busy samples)", "",
                  "Busy = samples whose leaf frame is not a thread blocked in a system call (epoll wait, idle "
                  "thread-pool threads, waitpid, the pipe reader). Files: "
                  f"`{d['raw']['file']}` (collapsed stacks), `{d['flamegraph']['file']}`.", ""]
        for role in ("worker", "parent"):
            if role not in prof:
                continue
            r = prof[role]
            lines.append(f"**{role}** ({r['processes']} process(es), {r['samples']} samples, {r['busy_samples']} busy; "
                         f"main thread busy {100 * (r['main_thread_busy'] or 0):.0f}%)")
            lines.append("")
            lines.append("- self time by package: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["self_by_package"][:8]))
            lines.append("- key frames (inclusive): " + "; ".join(f"`{k}` {100 * v:.0f}%" for k, v in key_frames(r)))
            lines.append("- top self frames: " + "; ".join(f"`{k}` {100 * v:.1f}%" for k, v in r["top_self"][:10]))
            lines.append("")
    lines += ["", "## Analysis", "", NOTES_START, old_notes or "(no notes yet)", NOTES_END, ""]
    RESULTS_MD.write_text("\n".join(lines))


# ----------------------------------------------------------------------------- main


SECTIONS = {"throughput": section_throughput, "overhead": section_overhead, "scale": section_scale,
            "profile": section_profile, "diag": section_diag, "pool": section_pool, "sandbox": section_sandbox}


def _run_records(obj):
    """Every RunResult dict inside a section's data (they carry the `code` fingerprint)."""
    if isinstance(obj, dict):
        if "code" in obj and "returncode" in obj:
            yield obj
        for v in obj.values():
            yield from _run_records(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _run_records(v)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="throughput,overhead,scale",
                   help="comma list of throughput, overhead, scale, diag, pool, sandbox, profile (default: the first three)")
    p.add_argument("--quick", action="store_true", help="small N and one repeat")
    p.add_argument("--repeats", type=int, help="repeats per configuration (default 3; 1 with --quick)")
    p.add_argument("--n-throughput", type=int, help="prompts in the throughput and profile runs (default 2000)")
    p.add_argument("--throughput-configs", help="comma list of WORKERSxCONCURRENCY (default 2x64,2x256,4x4)")
    p.add_argument("--n-overhead", type=int, help="prompts in the overhead runs (default 2000)")
    p.add_argument("--overhead-workers", type=int, default=2)
    p.add_argument("--overhead-concurrency", type=int, default=64)
    p.add_argument("--scale-sizes", help="comma list of N (default 10000,100000)")
    p.add_argument("--scale-workers", type=int, default=2)
    p.add_argument("--scale-concurrency", type=int, default=64)
    p.add_argument("--scale-timeout", type=float, default=7200)
    p.add_argument("--diag-configs", default="2x256-notools,4x256,8x256",
                   help="diag section: WORKERSxCONCURRENCY[-notools] list (default 2x256-notools,4x256,8x256)")
    p.add_argument("--profile-config", default="2x256", help="WORKERSxCONCURRENCY to profile (default 2x256)")
    p.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--quiet-threshold", type=float, default=0.25,
                   help="before each run, wait until the machine is less busy than this share of all cores")
    p.add_argument("--quiet-wait", type=float, default=60.0, help="longest wait for a quiet machine, seconds")
    p.add_argument("--cli-root", help="run batch_runner.py from this tree instead (e.g. `git archive COMMIT | tar -x -C DIR`)")
    p.add_argument("--tag", help="label of the results of --cli-root (kept apart in results.json as SECTION:TAG)")
    p.add_argument("--keep-runs", action="store_true", help="keep run directories under bench/out/runs")
    p.add_argument("--fresh", action="store_true", help="forget results of earlier runs in bench/out/results.json")
    p.add_argument("--render", action="store_true", help="run nothing: print the table and rewrite RESULTS.md")
    a = p.parse_args(argv)
    a.repeats = a.repeats or (1 if a.quick else 3)
    a.n_throughput = a.n_throughput or (400 if a.quick else 2000)
    a.n_overhead = a.n_overhead or (500 if a.quick else 2000)
    a.scale_sizes = [int(x) for x in (a.scale_sizes or ("1000,10000" if a.quick else "10000,100000")).split(",")]
    a.sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    unknown = set(a.sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown section(s): {', '.join(sorted(unknown))}")
    return a


def main(argv=None) -> int:
    global KEEP_RUNS, CLI_ROOT, TAG, RESULTS_JSON, RESULTS_MD
    args = parse_args(argv)
    if args.quick:  # a smoke run never replaces the full results
        RESULTS_JSON, RESULTS_MD = OUT / "results-quick.json", OUT / "RESULTS-quick.md"
    TAG = args.tag or ""
    if args.cli_root:
        CLI_ROOT = Path(args.cli_root).resolve()
        if not (CLI_ROOT / "batch_runner.py").exists():
            raise SystemExit(f"--cli-root {CLI_ROOT}: no batch_runner.py there")
        if not args.tag:
            raise SystemExit("--cli-root needs --tag (the results of another tree are kept apart)")
    head = args.tag or git_head()
    KEEP_RUNS = args.keep_runs
    QUIET.update(threshold=args.quiet_threshold, max_wait=args.quiet_wait)
    signal.signal(signal.SIGTERM, _on_sigterm)
    OUT.mkdir(parents=True, exist_ok=True)
    results = {} if args.fresh or not RESULTS_JSON.exists() else json.loads(RESULTS_JSON.read_text())
    command = "python bench/run.py " + " ".join(sys.argv[1:] if argv is None else argv)
    code = 0
    try:
        if not args.render:
            for name in args.sections:
                say(f"[bold]section {name}[/]")
                try:
                    data = SECTIONS[name](args)
                except (RuntimeError, OSError, ValueError, KeyError, json.JSONDecodeError) as e:
                    console.print(f"[red]section {name} failed:[/] {type(e).__name__}: {e}")
                    code = 1
                    continue
                codes = sorted({r["code"] for r in _run_records(data) if r.get("code")})
                results[name if not args.tag else f"{name}:{args.tag}"] = {
                    "data": data, "command": command.strip(), "repeats": args.repeats, "git_head": head,
                    "code": codes, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
                if len(codes) > 1:
                    console.print(f"[yellow]note:[/] the runner's sources changed during section {name} "
                                  f"(fingerprints {', '.join(codes)}): someone edited them meanwhile")
                RESULTS_JSON.write_text(json.dumps(results, indent=1))  # after every section: nothing is lost
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]: stopping the server and the CLI")
        code = 130
    finally:
        CHILDREN.stop_all()
    rows = build_rows(results)
    if rows:
        print_table(rows)
        write_markdown(results, rows)
        console.print(f"wrote {RESULTS_MD.relative_to(ROOT)} and {RESULTS_JSON.relative_to(ROOT)}")
    return code


if __name__ == "__main__":
    sys.exit(main())
