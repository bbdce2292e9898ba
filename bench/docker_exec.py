#!/usr/bin/env python
"""CPU per terminal call of the docker backend, for commands after the first of a prompt.

Each of C sandboxes (containers) runs one command first, outside the clock (the container's
start), then its share of N `echo hi` commands. CPU, not wall time: the machine is shared.
  runner     this process and its children (a docker CLI process per call, if the tree runs one)
  daemons    dockerd and its containerd
  containers the containerd shims of our containers and every process under them, live or reaped:
             runc, each exec's processes, the command loop and its commands, PID 1
  machine    all CPU of the machine (/proc/stat), other people's jobs included: a noisy upper bound

    DOCKER_HOST=unix:///tmp/trajgen-ci-dockerd/docker.sock python bench/docker_exec.py
    git archive 6d9be41 | tar -x -C /tmp/before && python bench/docker_exec.py --tree=/tmp/before

Prints one JSON object per run, then medians over --repeats per concurrency.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

MICRO = r"""
import asyncio, json, os, resource, sys, time
from trajgen.sandbox.backends import SandboxConfig, cleanup, open_sandbox

image, conc, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engine = [int(p) for p in sys.argv[4].split(",")]
config = SandboxConfig(backend="docker")
TICK = os.sysconf("SC_CLK_TCK")

def proc_cpu(pid):
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in f[11:15]) / TICK  # utime stime cutime cstime

def shim_trees(ids):  # our containers' shims and their live children (PID 1, a running command loop)
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                args = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"-id" in args and args[args.index(b"-id") + 1].decode() in ids:
                found += [int(entry), *map(int, open(f"/proc/{entry}/task/{entry}/children").read().split())]
    return found

def machine():
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / TICK

async def main():
    boxes = [open_sandbox(config, f"b{i}", image, None) for i in range(conc)]
    for box in boxes:
        assert (await box.run("true", 60)).exit_code == 0
    trees = shim_trees({box._id for box in boxes})
    d0, c0, m0, t0 = sum(map(proc_cpu, engine)), sum(map(proc_cpu, trees)), machine(), time.perf_counter()
    r0 = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]

    async def share(box, n):
        for _ in range(n):
            r = await box.run("echo hi", 60)
            if r.exit_code != 0 or r.output != "hi\n":
                raise SystemExit(f"command failed: {r}")
    await asyncio.gather(*(share(box, len(range(i, total, conc))) for i, box in enumerate(boxes)))
    r1 = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    d1, c1, m1, t1 = sum(map(proc_cpu, engine)), sum(map(proc_cpu, trees)), machine(), time.perf_counter()
    for box in boxes:
        await box.close()
    runner = sum((b.ru_utime - a.ru_utime) + (b.ru_stime - a.ru_stime) for a, b in zip(r0, r1))
    print(json.dumps({"runner_ms": 1000 * runner / total, "daemons_ms": 1000 * (d1 - d0) / total,
                      "containers_ms": 1000 * (c1 - c0) / total,
                      "machine_ms": 1000 * (m1 - m0) / total, "wall_ms": 1000 * (t1 - t0) / total}))

try:
    asyncio.run(main())
finally:  # a failed command leaves no container behind
    cleanup(config)
"""


def engine_pids(host: str) -> list[int]:
    """dockerd listening on `host`, and its children (its own containerd)."""
    socket = host.removeprefix("unix://")
    daemon = None
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if args and args[0].endswith("dockerd") and any(socket in a for a in args):
            daemon = entry
    if daemon is None:
        raise SystemExit(f"no dockerd listening on {host} found")
    children = Path(f"/proc/{daemon}/task/{daemon}/children").read_text().split()
    return [int(daemon), *map(int, children)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent), help="the trajgen tree to measure")
    parser.add_argument("--image", default="trajgen-test-busybox:latest")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    pids = ",".join(map(str, engine_pids(host)))
    runs: dict[int, list[dict]] = {}
    for _ in range(args.repeats):
        for conc, total in ((1, 100), (8, 400)):
            done = subprocess.run([sys.executable, "-c", MICRO, args.image, str(conc), str(total), pids],
                                  cwd=args.tree, env={**os.environ, "PYTHONPATH": args.tree}, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(done.stderr[-2000:] or done.stdout[-2000:])
            run = json.loads(done.stdout)
            print(json.dumps({"concurrency": conc, **run}), flush=True)
            runs.setdefault(conc, []).append(run)
    print(f"medians of {args.repeats}, ms per command ({args.tree})")
    print("concurrency  runner  daemons  containers  total  machine  wall")
    for conc, rs in runs.items():
        m = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        total = statistics.median(r["runner_ms"] + r["daemons_ms"] + r["containers_ms"] for r in rs)
        print(f"{conc:11d}  {m['runner_ms']:6.1f}  {m['daemons_ms']:7.1f}  {m['containers_ms']:10.1f}  {total:5.1f}  "
              f"{m['machine_ms']:7.1f}  {m['wall_ms']:4.0f}")


if __name__ == "__main__":
    main()
