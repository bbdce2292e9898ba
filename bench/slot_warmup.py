#!/usr/bin/env python
"""The CPU of a run's first sandboxes' slots (slots.py): at a run's start every one of the C sandboxes
in flight makes a slot (a uid, a devpts instance, a cgroup), W workers at once.

    sudo python bench/slot_warmup.py --workers=2 --concurrency=256 --rounds=5 [--before=TREE]

Each worker is a process taking its C/W slots one after another, as a worker's first prompts do, all
workers at once; then it frees them. Prints the median ms of process CPU per slot taken, and with
--before, the same for the tree at TREE (run interleaved, round by round). Needs root.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = r"""
import json, sys, time
from trajgen.sandbox import SandboxConfig, slots
from trajgen.sandbox.backends import cleanup
config = SandboxConfig(root_dir=sys.argv[1], slots=int(sys.argv[2]))
n = int(sys.argv[3])
sys.stdin.readline()  # every worker starts at once
t = time.process_time()
taken = [slots.take(config) for _ in range(n)]
cpu = time.process_time() - t
for slot in taken:
    slots.free(slot)
cleanup(config)  # the groups' parent
print(json.dumps({"cpu_s": cpu, "n": n}))
"""


def one_round(tree: Path, workers: int, concurrency: int) -> float:
    """ms of CPU per slot, over every worker."""
    root = tempfile.mkdtemp(prefix="bench-slots-", dir="/run")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, root, str(concurrency), str(concurrency // workers)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tree)
             for _ in range(workers)]
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [json.loads(p.communicate()[0]) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("a worker failed")
    return 1000 * sum(r["cpu_s"] for r in results) / sum(r["n"] for r in results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--before", type=Path, help="another checkout to measure alongside this one")
    args = ap.parse_args()
    trees = {"after": ROOT, **({"before": args.before.resolve()} if args.before else {})}
    ms: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            ms[name].append(one_round(tree, args.workers, args.concurrency))
    for name, values in ms.items():
        rounds = ", ".join(f"{v:.2f}" for v in values)
        print(f"{name}: {statistics.median(values):.2f} ms of CPU a slot (rounds: {rounds})")


if __name__ == "__main__":
    main()
