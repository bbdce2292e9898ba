"""Ray at scale, as ratios: a 3-node local Ray cluster against one node, and the Ray executor against
the process pool on one machine, on the same latency-bound workload (the endpoint takes DELAY s a call).

    python bench/ray_scale.py [--prompts=N] [--repeats=R]

Ray listens on every interface it finds, so this script runs itself again inside a loopback-only
network namespace (`unshare --net`, then `ip link set lo up`; needs root) and refuses to start Ray
anywhere else. Each figure is the median over the repeats of the steady rate: prompts per second
from the first row written to the last (start-up is reported on its own). The section between
`<!-- ray -->` and `<!-- /ray -->` in bench/RESULTS.md is replaced.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_MD = ROOT / "bench" / "RESULTS.md"
START, END = "<!-- ray -->", "<!-- /ray -->"
DELAY = 1.0  # seconds the scripted endpoint takes per call: the workload waits, it does not compute
PER_WORKER = 4  # conversations each worker holds; one worker per CPU of a node
NODE_CPUS = 2
SCRIPT = {"default": [{"content": "done", "reasoning": "let me think", "delay": DELAY}]}


def in_loopback_namespace() -> bool:
    return socket.if_nameindex() == [(1, "lo")]


def measure(argv: list[str], env: dict[str, str], run_dir: Path, prompts: int) -> tuple[float, float]:
    """(start-up seconds until the first row, steady prompts/s from the first row to the last) of one CLI run."""
    started = time.monotonic()
    process = subprocess.Popen(argv, cwd=run_dir.parent.parent, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    first = None
    while process.poll() is None:
        rows = sum(1 for p in run_dir.glob("batch_*.jsonl") for _ in p.open()) if run_dir.exists() else 0
        if rows and first is None:
            first = (time.monotonic(), rows)
        time.sleep(0.05)
    ended = time.monotonic()
    if process.returncode != 0:
        raise SystemExit(f"run failed ({process.returncode}): {process.stderr.read()[-2000:]}")
    if first is None:
        raise SystemExit("no row was written")
    return first[0] - started, (prompts - first[1]) / (ended - first[0])


def bench(prompts: int, repeats: int) -> dict[str, list[tuple[float, float]]]:
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    from ray.cluster_utils import Cluster

    sys.path.insert(0, str(ROOT))
    from tests.support.scripted_server import start_server

    work = Path(tempfile.mkdtemp(prefix="rb", dir="/tmp"))  # short: Ray's socket paths live under it
    os.environ["RAY_TMPDIR"] = str(work)
    server = start_server(SCRIPT)
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(prompts)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(work)}
    env = {k: v for k, v in env.items() if k not in ("OPENROUTER_API_KEY", "OPENAI_API_KEY")}
    results: dict[str, list[tuple[float, float]]] = {}
    runs = 0

    def run(name: str, workers: int, **flags: str) -> None:
        nonlocal runs
        runs += 1
        argv = [sys.executable, str(ROOT / "batch_runner.py"), "--dataset_file=prompts.jsonl", f"--run_name=r{runs}",
                f"--output_dir={work / 'data'}", f"--base_url={server.url}", "--api_key=dummy", "--model=m",
                "--distribution=minimal", "--batch_size=50", f"--num_workers={workers}",
                f"--concurrency={workers * PER_WORKER}", *(f"--{k}={v}" for k, v in flags.items())]
        results.setdefault(name, []).append(measure(argv, env, work / "data" / f"r{runs}", prompts))
        print(f"{name}: start-up {results[name][-1][0]:.1f} s, {results[name][-1][1]:.2f} prompts/s", flush=True)

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(repeats):
            run("pool, 1 machine", NODE_CPUS, executor="processes")
            run("ray, 1 machine", NODE_CPUS, executor="ray")
        cluster.add_node(num_cpus=NODE_CPUS)
        cluster.wait_for_nodes()
        for _ in range(repeats):
            run("ray cluster, 1 node", NODE_CPUS, executor="ray", ray_address=cluster.address)
        for _ in range(2):
            cluster.add_node(num_cpus=NODE_CPUS)
        cluster.wait_for_nodes()
        for _ in range(repeats):
            run("ray cluster, 3 nodes", 3 * NODE_CPUS, executor="ray", ray_address=cluster.address)
    finally:
        cluster.shutdown()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return results


def report(results: dict[str, list[tuple[float, float]]], prompts: int, repeats: int) -> str:
    rate = {name: statistics.median(r for _, r in runs) for name, runs in results.items()}
    startup = {name: statistics.median(s for s, _ in runs) for name, runs in results.items()}
    lines = [
        f"Latency-bound workload: {prompts} prompts, one call each, the scripted endpoint takes {DELAY:.0f} s a call; "
        f"one worker per CPU, {PER_WORKER} conversations per worker ({NODE_CPUS}-CPU nodes, all on this 2-core "
        f"machine, in a loopback-only network namespace). Median of {repeats} run(s); rate = prompts/s from the "
        "first row to the last.", "",
        "| setup | workers | start-up to first row | prompts/s | ideal prompts/s |", "|---|---|---|---|---|"]
    for name in rate:
        workers = 3 * NODE_CPUS if "3 nodes" in name else NODE_CPUS
        lines.append(f"| {name} | {workers} | {startup[name]:.1f} s | {rate[name]:.2f} | "
                     f"{workers * PER_WORKER / DELAY:.0f} |")
    lines += ["", f"- Ray executor / process pool, one machine: **{rate['ray, 1 machine'] / rate['pool, 1 machine']:.2f}**",
              f"- 3 nodes / 1 node: **{rate['ray cluster, 3 nodes'] / rate['ray cluster, 1 node']:.2f}** (ideal 3.00)"]
    return "\n".join(lines)


def write(section: str) -> None:
    text = RESULTS_MD.read_text() if RESULTS_MD.exists() else ""
    block = f"{START}\n## Ray at scale (bench/ray_scale.py)\n\n{section}\n{END}"
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block + "\n"
    RESULTS_MD.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=240)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    if not in_loopback_namespace():
        if os.environ.get("RAY_SCALE_INNER"):
            raise SystemExit("refusing to start Ray outside a loopback-only network namespace")
        inner = 'ip link set lo up && "$0" "$@"'  # sh stays PID 1 and reaps the orphans it adopts
        done = subprocess.run(["unshare", "--net", "--pid", "--fork", "--mount-proc", "sh", "-c", inner,
                               sys.executable, *sys.argv], env={**os.environ, "RAY_SCALE_INNER": "1"})
        raise SystemExit(done.returncode)
    section = report(bench(args.prompts, args.repeats), args.prompts, args.repeats)
    write(section)
    print(section)


if __name__ == "__main__":
    main()
