#!/usr/bin/env python
"""What a user would compare: the reference implementation beside ours, each at its own defaults,
on the same W(N) prompts and the same loopback scripted server.

    python bench/reference.py                       # N=1,000; ours 3 runs, the reference 1 (about 5 min)
    python bench/reference.py --prompts=20 --reference-repeats=1 --repeats=1

The workload is bench's throughput one: 250 ms per API call, 2 calls per prompt, the first asking
for one `terminal` call (`echo hi`). Every reply also carries a `reasoning` field, because at its
defaults the reference discards a row without reasoning (it would keep nothing); ours runs with
--require_reasoning=False and keeps every row either way.

- The reference: hermes-agent 0.19.0 from PyPI, installed once into its own venv
  (bench/out/reference-venv, never into this project's environment); its batch runner is the
  top-level module `batch_runner` (`python -m batch_runner`), run with --num_workers=4 (its default),
  --batch_size=10 (required, no default; the seed's quick start and our default), its terminal
  tool on its local backend, HOME and TMPDIR inside the run directory (it writes ~/.hermes and
  /tmp/hermes-snap-*).
- Ours: `python batch_runner.py` at our defaults (no worker or concurrency flags).

Both run inside a loopback-only network namespace: the script installs the venv, then runs itself
again under `unshare --net` (needs root), so whatever the reference reaches for (OpenRouter and
Nous for its auxiliary models, PyPI for a package it installs on first use unless it is there)
fails closed. A run counts only the rows whose `terminal`
call ran and answered `hi` with exit code 0, one per prompt. The section between
`<!-- reference -->` and `<!-- /reference -->` in bench/RESULTS.md is replaced.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from rich.table import Table

import harness
from harness import (
    CHILDREN,
    OUT,
    RESULTS_MD,
    ROOT,
    SCRIPT_TOOL,
    Server,
    _cpu_jiffies,
    _drop,
    _env,
    _fresh,
    _on_sigterm,
    _wait_cli,
    cli_argv,
    console,
    dataset,
    git_head,
    median,
    run_cli,
    say,
    wait_for_quiet,
    write_section,
)
from ray_scale import in_loopback_namespace
from sections import LATENCY

START, END = "<!-- reference -->", "<!-- /reference -->"
VERSION = "0.19.0"
# edge-tts: it pip-installs this at its first start when it can (`tools/lazy_deps.py`, tts.edge); installed with it
# here, as a user's venv holds it after one run with a network, so the run starts as theirs would
REQUIREMENTS = (f"hermes-agent=={VERSION}", "edge-tts==7.2.7")
VENV = OUT / "reference-venv"
REFERENCE_PYTHON = VENV / "bin" / "python"
REFERENCE_WORKERS = 4
REFERENCE_BATCH = 10
INNER = "TRAJGEN_REFERENCE_INNER"  # set for the run inside the namespace: it refuses to run anywhere else
SCRIPT = {"default": [{**reply, "reasoning": "the scripted model thinks"} for reply in SCRIPT_TOOL["default"]]}


@dataclass(frozen=True)
class Run:
    wall_s: float  # the CLI process from start to exit, start-up and merge included
    returncode: int
    rows: int  # rows in trajectories.jsonl
    executed: int  # distinct prompts whose row holds the terminal call's `hi`, exit code 0
    cpu_s: float  # user+sys of the CLI and all its descendants (getrusage)
    server_cpu_s: float
    machine_busy: float  # share of both cores busy during the run, everyone's jobs included


# ----------------------------------------------------------------------------- the reference's venv


def ensure_venv() -> None:
    """The reference's own interpreter, installed on first use (outside the namespace: pip needs the registry)."""
    if not _installed(REFERENCE_PYTHON):
        say(f"installing {' '.join(REQUIREMENTS)} into {VENV.relative_to(ROOT)}")
        steps = ([[sys.executable, "-m", "venv", str(VENV)]] if not REFERENCE_PYTHON.exists() else []) + [
            [str(REFERENCE_PYTHON), "-m", "pip", "install", "--quiet", *REQUIREMENTS]]
        for argv in steps:
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode != 0:
                tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
                raise SystemExit(f"installing the reference failed: {' '.join(argv)}: {tail}")


def _installed(python: Path) -> bool:
    if not python.exists():
        return False
    check = ("import importlib.metadata as m, sys; "
             "sys.exit(any(m.version(n) != v for n, v in (r.split('==') for r in sys.argv[1:])))")
    return subprocess.run([str(python), "-c", check, *REQUIREMENTS], capture_output=True).returncode == 0


# ----------------------------------------------------------------------------- the runs


def run_ours(data: Path, server: Server, name: str, n: int) -> Run:
    """Our CLI at its defaults: bench's argv without its worker and concurrency flags."""
    argv = [a for a in cli_argv(data, name, server.url, 0, 0) if not a.startswith(("--num_workers=", "--concurrency="))]
    _fresh(name)
    r = run_cli(argv, name, n, server, timeout=1800, sample_rss=False)
    rows, executed = count_rows(OUT / "runs" / name / "trajectories.jsonl")
    _drop(name, harness.KEEP_RUNS)
    return Run(r.wall_s, r.returncode, rows, executed, r.cpu_s, r.server_cpu_s, r.machine_busy)


def run_reference(data: Path, server: Server, name: str) -> tuple[Run, int]:
    """The reference at its defaults; also how many times it tried to install a package at run time."""
    work = OUT / "runs" / name  # its cwd: it writes data/<run_name>/ there
    _fresh(name)
    for sub in ("home", "tmp"):
        (work / sub).mkdir(parents=True)
    argv = [str(REFERENCE_PYTHON), "-m", "batch_runner", f"--dataset_file={data}", f"--batch_size={REFERENCE_BATCH}",
            f"--run_name={name}", "--model=bench", f"--base_url={server.url}", "--api_key=dummy",
            f"--num_workers={REFERENCE_WORKERS}", "--distribution=terminal_only"]
    env = {**_env(), "HOME": str(work / "home"), "TMPDIR": str(work / "tmp"), "TERMINAL_ENV": "local"}
    log_path = OUT / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    wait_for_quiet()
    before, server_cpu0, jiffies0 = resource.getrusage(resource.RUSAGE_CHILDREN), server.cpu_seconds(), _cpu_jiffies()
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = CHILDREN.start(argv, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
        returncode = _wait_cli(proc, server, time.monotonic() + 3600, f"{name} (see {log_path})")
    CHILDREN.procs.remove(proc)
    wall = time.perf_counter() - t0
    after, jiffies1 = resource.getrusage(resource.RUSAGE_CHILDREN), _cpu_jiffies()
    rows, executed = count_rows(work / "data" / name / "trajectories.jsonl")
    agent_log = work / "home" / ".hermes" / "logs" / "agent.log"
    installs = agent_log.read_text(errors="replace").count("Lazy-installing") if agent_log.exists() else 0
    _drop(name, harness.KEEP_RUNS)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    busy = (jiffies1[0] - jiffies0[0]) / max(1, jiffies1[1] - jiffies0[1])
    return Run(wall, returncode, rows, executed, cpu, server.cpu_seconds() - server_cpu0, busy), installs


def count_rows(path: Path) -> tuple[int, int]:
    """(rows, distinct prompts whose row holds a tool turn that answered `hi` with exit code 0).

    Both row formats carry ShareGPT turns whose tool turn is `<tool_response>{json}</tool_response>`."""
    rows, executed = 0, set()
    if not path.exists():
        return 0, 0
    with open(path, "rb") as f:
        for line in f:
            row = json.loads(line)
            rows += 1
            turns = row["conversations"]
            prompt = next(t["value"] for t in turns if t["from"] == "human")
            if any(_said_hi(t["value"]) for t in turns if t["from"] == "tool"):
                executed.add(prompt)
    return rows, len(executed)


def _said_hi(value: str) -> bool:
    body = value.removeprefix("<tool_response>").removesuffix("</tool_response>")
    try:
        content = json.loads(body)["content"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(content, dict) and str(content.get("output", "")).strip() == "hi" and content.get("exit_code") == 0


# ----------------------------------------------------------------------------- report


def our_defaults() -> tuple[int, int]:
    """(--num_workers, --concurrency) when not given, from trajgen/options.py."""
    sys.path.insert(0, str(ROOT))
    from trajgen.options import RunOptions
    defaults = {f.name: f.default for f in dataclasses.fields(RunOptions)}
    return defaults["num_workers"], defaults["concurrency"]


def report(ours: list[Run], ref: list[Run], installs: list[int], n: int, load: tuple[float, float]) -> tuple[Table, str]:
    """The rich table and the RESULTS.md section."""
    workers, conc = our_defaults()
    batches = math.ceil(n / REFERENCE_BATCH)  # a worker runs a whole batch, one prompt after the other
    ideal = {"ours": math.ceil(n / conc) * 2 * LATENCY,
             "reference": math.ceil(batches / REFERENCE_WORKERS) * min(n, REFERENCE_BATCH) * 2 * LATENCY}
    what = {"ours": f"`python batch_runner.py` at our defaults (--concurrency={conc} conversations in {workers} processes)",
            "reference": f"hermes-agent {VERSION}, `python -m batch_runner --num_workers={REFERENCE_WORKERS} "
                         f"--batch_size={REFERENCE_BATCH}` (one prompt at a time per process)"}
    head = ["implementation", "runs", "wall time (median)", "rows with the tool call run / rows / prompts", "ideal",
            "CPU per prompt (CLI + children)", "machine busy"]
    table = Table(title=f"W({n:,}): the reference beside ours ({harness.MACHINE})", show_lines=True)
    for col in head:
        table.add_column(col, overflow="fold")
    lines = [START, "## The reference implementation beside ours (bench/reference.py)", ""]
    walls = {}
    md_rows = []
    for key, runs in (("reference", ref), ("ours", ours)):
        walls[key] = median([r.wall_s for r in runs])
        bad = [r for r in runs if r.returncode != 0 or r.executed != n]
        cells = [what[key], str(len(runs)) + (f" ({len(bad)} incomplete)" if bad else ""),
                 f"{walls[key]:.1f} s" + (f" ({min(r.wall_s for r in runs):.1f}–{max(r.wall_s for r in runs):.1f})"
                                          if len(runs) > 1 else ""),
                 " / ".join(f"{min(v):,}" for v in ([r.executed for r in runs], [r.rows for r in runs])) + f" / {n:,}",
                 f"{ideal[key]:.1f} s", f"{1000 * median([r.cpu_s / n for r in runs]):.1f} ms",
                 f"{100 * median([r.machine_busy for r in runs]):.0f}%"]
        table.add_row(*cells)
        md_rows.append("| " + " | ".join(cells) + " |")
    ratio = walls["reference"] / walls["ours"]
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines += [
        f"`python bench/reference.py --prompts={n} --repeats={len(ours)} --reference-repeats={len(ref)}` ({date}, "
        f"runner at {git_head()}; {harness.MACHINE}, shared: load average {load[0]:.1f} at the start, {load[1]:.1f} at "
        f"the end). Both against one `python -m tests.support.scripted_server --latency {LATENCY}` on 127.0.0.1, inside a "
        "loopback-only network namespace: 2 API calls per prompt, the first asking for one `terminal` call (`echo hi`; "
        "ours runs it in the prompt's bubblewrap sandbox, the reference's local backend runs it on the host), every "
        "reply with a `reasoning` field (the reference drops rows without one). Wall time is the CLI process from start "
        "to exit; ideal is the latency floor at each one's concurrency (the reference's: 4 processes, each running "
        "whole batches of 10 one prompt after the other); rows count only prompts whose row holds the `hi` of the "
        "terminal call (the lowest count over the runs).", "",
        "| " + " | ".join(head) + " |", "|" + "---|" * len(head), *md_rows, "",
        f"- Wall time, reference / ours: **{ratio:.1f}x**" + (" (one run of the reference)" if len(ref) == 1 else ""),
        f"- Packages the reference tried to install while it ran (`Lazy-installing` in its agent.log): {max(installs)} "
        "(edge-tts is installed beforehand, as a user's venv holds it after one run with a network).",
        END]
    return table, "\n".join(lines)


# ----------------------------------------------------------------------------- main


def bench(n: int, repeats: int, reference_repeats: int) -> tuple[Table, str]:
    data = dataset(n)
    load0 = os.getloadavg()[0]
    ours: list[Run] = []
    ref: list[Run] = []
    installs: list[int] = []
    with Server(SCRIPT, LATENCY, "reference") as server:
        for rep in range(max(repeats, reference_repeats)):  # interleaved: noise spreads over both
            if rep < repeats:
                say(f"ours, run {rep + 1} of {repeats}")
                ours.append(run_ours(data, server, f"ours-n{n}-r{rep}", n))
                say(f"  {_line(ours[-1])}")
            if rep < reference_repeats:
                say(f"the reference, run {rep + 1} of {reference_repeats}")
                run, tried = run_reference(data, server, f"reference-n{n}-r{rep}")
                ref.append(run)
                installs.append(tried)
                say(f"  {_line(run)}")
    return report(ours, ref, installs, n, (load0, os.getloadavg()[0]))


def _line(run: Run) -> str:
    return (f"wall {run.wall_s:.1f} s, exit {run.returncode}, rows {run.rows:,}, with the tool call run {run.executed:,}, "
            f"CPU {run.cpu_s:.1f} s, machine {100 * run.machine_busy:.0f}% busy")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3, help="runs of ours (the median is reported)")
    parser.add_argument("--reference-repeats", type=int, default=1, help="runs of the reference (about 5 min each)")
    parser.add_argument("--keep-runs", action="store_true", help="keep run directories under bench/out/runs")
    args = parser.parse_args()
    if min(args.prompts, args.repeats, args.reference_repeats) < 1:
        parser.error("--prompts, --repeats and --reference-repeats must be at least 1")
    if not in_loopback_namespace():
        if os.environ.get(INNER):
            raise SystemExit("refusing to run outside a loopback-only network namespace")
        ensure_venv()
        inner = 'ip link set lo up && exec "$0" "$@"'
        done = subprocess.run(["unshare", "--net", "--fork", "sh", "-c", inner, sys.executable, *sys.argv],
                              env={**os.environ, INNER: "1"})
        return done.returncode
    harness.KEEP_RUNS = args.keep_runs
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        table, section = bench(args.prompts, args.repeats, args.reference_repeats)
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]: stopping the server and the CLIs")
        return 130
    except RuntimeError as e:  # a CLI that did not finish, a server that died
        console.print(f"[red]failed:[/] {e}")
        return 1
    finally:
        CHILDREN.stop_all()
    console.print(table)
    write_section(START, END, section)
    console.print(f"wrote the reference section of {RESULTS_MD.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
