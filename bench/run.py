#!/usr/bin/env python
"""Benchmark of `python batch_runner.py`: throughput against the latency limit, overhead, scale.

Everything is driven from the outside, as a user would: the real CLI as a subprocess against the
loopback scripted server (`python -m tests.support.scripted_server`) as a separate process, on 127.0.0.1.

    python bench/run.py                                  # throughput, overhead, scale; full sizes (~35 min)
    python bench/run.py --quick                          # small N, one repeat: a smoke run
    python bench/run.py --sections=throughput,overhead   # some sections only
    python bench/run.py --sections=profile               # py-spy profile of the C=256 throughput run
    python bench/run.py --render                         # re-print the table from bench/out/results.json

Sections
  throughput  latency 0.25 s, 2 calls + 1 terminal call per prompt, real local sandbox;
              efficiency = ceil(N/C) * 2 * 0.25 s / wall time (statistics.json duration_seconds).
              Issue 53's W(1000) at C=32 is `--sections=throughput --throughput-configs=2x32
              --n-throughput=1000 --tag=w1000` (ideal ceil(1000/32) * 0.5 s = 16.0 s; the tag keeps
              its results apart from the default configurations', which a later run would replace).
  realistic   issue 53's realistic workload: as throughput, but latency 1 s and 6 calls per prompt (5
              terminal calls in the prompt's sandbox, then the answer): ideal = ceil(N/C) * 6 * 1 s;
              configurations 2x64, 2x128, 2x256 unless --throughput-configs; N is --n-throughput.
  overhead    latency 0: CPU seconds per prompt of the CLI and all its children
              (getrusage(RUSAGE_CHILDREN) deltas), without and with one terminal call per prompt.
  scale       latency 0, no tools, N = 10k and 100k: peak RSS (VmHWM) of the parent and of the
              workers, then the time of --resume on the finished run and of the merge.
  profile     py-spy record --subprocesses of one throughput configuration: where the time goes.

Results of each section are kept in bench/out/results.json (a later run of one section replaces
only that section); the table is printed and bench/RESULTS.md rewritten from all of them. Text
between the `<!-- notes -->` markers of RESULTS.md is kept across rewrites. --quick keeps its own
files (bench/out/results-quick.json, bench/out/RESULTS-quick.md) and never touches the full ones.

More sections, not run by default: realistic (above; about 6 min a repeat at N=2000), diag (same
workload with more workers, or without the tool call), pool (the HTTP client alone: httpx vs httpx2
vs aiohttp under openai.AsyncOpenAI), sandbox (the local bubblewrap sandbox alone), profile
(py-spy). --cli-root=DIR --tag=NAME runs the CLI of another tree
(e.g. `git archive 62d04ad | tar -x -C bench/out/trees/62d04ad`) and keeps its results apart,
for before/after comparisons; --cli-flags=--executor=ray --tag=ray does the same for
the Ray executor, run inside a loopback-only network namespace. Section versus (with --cli-flags)
runs the first throughput configuration without the flags and with them, alternately, and reports
the median ratio of the pairs (Ray against the process pool, the two runs of a pair a minute
apart, where separate invocations were many minutes apart). sh, not Python, must be the
namespace's PID 1: it reaps the orphans it adopts (a Python PID 1 collected them as zombies and
slowed the machine run after run):

    unshare --net --pid --fork --mount-proc sh -c 'ip link set lo up && python bench/run.py \
        --sections=versus --repeats=5 --cli-flags=--executor=ray --tag=ray'


Every CLI run waits first (up to --quiet-wait s) for the machine to be quiet, and records how busy
the whole machine was (/proc/stat) and how much CPU went to processes other than the CLI and the
server: other people's jobs, and kernel work of the sandboxes that getrusage does not see.
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import harness
from harness import (
    CHILDREN,
    OUT,
    QUIET,
    ROOT,
    _on_sigterm,
    console,
    git_head,
    say,
)
from sections import (
    section_diag,
    section_overhead,
    section_pool,
    section_profile,
    section_realistic,
    section_sandbox,
    section_scale,
    section_throughput,
    section_versus,
)
from report import (
    build_rows,
    print_table,
    write_markdown,
)


# ----------------------------------------------------------------------------- main


SECTIONS = {"throughput": section_throughput, "overhead": section_overhead, "scale": section_scale,
            "profile": section_profile, "diag": section_diag, "pool": section_pool, "sandbox": section_sandbox,
            "versus": section_versus, "realistic": section_realistic}


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
                   help="comma list of throughput, overhead, scale, realistic, diag, pool, sandbox, profile, versus "
                   "(default: the first three)")
    p.add_argument("--quick", action="store_true", help="small N and one repeat")
    p.add_argument("--repeats", type=int, help="repeats per configuration (default 3; 1 with --quick)")
    p.add_argument("--n-throughput", type=int,
                   help="prompts in the throughput, realistic and profile runs (default 2000)")
    p.add_argument("--throughput-configs", help="comma list of WORKERSxCONCURRENCY (default 2x64,2x256,4x4; "
                   "realistic: 2x64,2x128,2x256)")
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
    p.add_argument("--tag", help="label of these results, kept apart in results.json as SECTION:TAG "
                   "(needed with --cli-root and --cli-flags)")
    p.add_argument("--cli-flags", default="", help="space-separated flags added to every CLI run, with --tag "
                   "(e.g. --cli-flags=--executor=ray; run Ray inside `unshare --net`, see tests/test_ray.py)")
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


def compile_sources(root: Path) -> None:
    """Bytecode for the runner's modules first, as an installed package has: where
    PYTHONDONTWRITEBYTECODE is set (this VM sets it), every process of every run would otherwise
    compile each module edited since its last .pyc, and the fixed cost would depend on that."""
    files = ("trajgen", "batch_runner.py", "model_tools.py", "toolset_distributions.py")
    sources = [str(root / f) for f in files]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *sources], check=True, stdout=subprocess.DEVNULL)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:  # a smoke run never replaces the full results
        harness.RESULTS_JSON, harness.RESULTS_MD = harness.OUT / "results-quick.json", OUT / "RESULTS-quick.md"
    harness.TAG = args.tag or ""
    if args.cli_root:
        harness.CLI_ROOT = Path(args.cli_root).resolve()
        if not (harness.CLI_ROOT / "batch_runner.py").exists():
            raise SystemExit(f"--cli-root {harness.CLI_ROOT}: no batch_runner.py there")
        if not args.tag:
            raise SystemExit("--cli-root needs --tag (the results of another tree are kept apart)")
    harness.CLI_FLAGS = tuple(args.cli_flags.split())
    if harness.CLI_FLAGS and not args.tag:
        raise SystemExit("--cli-flags needs --tag (the results of other flags are kept apart)")
    head = args.tag if args.cli_root else git_head()  # --cli-flags runs this tree
    harness.KEEP_RUNS = args.keep_runs
    QUIET.update(threshold=args.quiet_threshold, max_wait=args.quiet_wait)
    signal.signal(signal.SIGTERM, _on_sigterm)
    OUT.mkdir(parents=True, exist_ok=True)
    if not args.render:
        compile_sources(harness.CLI_ROOT)
    results = {} if args.fresh or not harness.RESULTS_JSON.exists() else json.loads(harness.RESULTS_JSON.read_text())
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
                harness.RESULTS_JSON.write_text(json.dumps(results, indent=1))  # after every section: nothing is lost
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]: stopping the server and the CLI")
        code = 130
    finally:
        CHILDREN.stop_all()
    rows = build_rows(results)
    if rows:
        print_table(rows)
        write_markdown(results, rows)
        console.print(f"wrote {harness.RESULTS_MD.relative_to(ROOT)} and {harness.RESULTS_JSON.relative_to(ROOT)}")
    return code


if __name__ == "__main__":
    sys.exit(main())
