#!/usr/bin/env python
"""What each part of a fresh local sandbox costs in CPU: bubblewrap's namespaces, the network
namespace, the mounts, the seccomp filter, the loop's uid (setpriv), the devpts instance and the
cgroup, each made per sandbox or kept (slots.py), / and /dev (bubblewrap's binds and --dev, or what a
worker makes once: local.process_view), and the runner's own Python.

    sudo python bench/sandbox_parts.py --sandboxes=200 --rounds=5

Every variant runs `bash -c 'echo hi'` through the sandbox's real bwrap options (local.py), one at a
time, in rounds that interleave the variants so each sees the same machine; a part's cost is the
difference between two variants. CPU is this process's and its children's (getrusage) plus kernel
threads' (namespaces and cgroups are torn down there); the machine's own figure (/proc/stat) also
counts the CPU no task is charged for (a few ms a sandbox on this VM), and everyone's jobs on a
shared machine: it is the one to read on a quiet machine. `python` is the runner's side of a whole
fresh sandbox (SANDBOX_MICRO in bench/sections.py, `fresh`, 1 in flight): its process alone, its
cgroup and devpts work included; its machine figure is the whole sandbox's. Needs root (uids,
cgroups, devpts instances). Prints medians, ms of CPU per sandbox.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

from harness import CHILDREN, CLK_TCK, _cpu_jiffies, _kthreads_cpu
from sections import SANDBOX_MICRO
from trajgen.sandbox import SandboxConfig, cgroups, local, roots, shares, slots
from trajgen.sandbox.gate import gated

ROOT = Path(__file__).resolve().parent.parent
COMMAND = ["bash", "-c", "echo hi"]
MINIMAL = ["--dev-bind", "/", "/"]  # one recursive bind, nothing remounted: namespaces without the mounts
# how a sandbox joined its cgroup before gate.py: a shell wrote its pid in each cgroup.procs, then became bwrap
SH_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 126; shift; done; shift; exec "$@"'


def cpu() -> tuple[float, float]:
    """CPU seconds so far of this process, its reaped children and every kernel thread; and of the machine."""
    mine = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return sum(r.ru_utime + r.ru_stime for r in mine) + _kthreads_cpu(), _cpu_jiffies()[0] / CLK_TCK


class Variant:
    """One way of running the command: which of the sandbox's parts it has."""

    def __init__(self, config: SandboxConfig, host_dir: str, uid: int, *, bwrap: bool = True, net: bool = True,
                 mounts: bool = True, seccomp: bool = True, setpriv: bool = True, pts: str = "", group: str = "",
                 view: str = "bwrap", sh_join: bool = False):
        self.config, self.host_dir, self.uid = config, host_dir, uid
        self.bwrap, self.net, self.mounts, self.seccomp, self.setpriv = bwrap, net, mounts, seccomp, setpriv
        self.pts, self.group = pts, group  # "", "new" (made and removed per sandbox) or "kept" (slots.py)
        self.view = view  # / and /dev: bubblewrap's binds and --dev, "dev" the worker's /dev, "whole" its / (VIEWS)
        self.sh_join = sh_join  # the cgroup joined by a shell (SH_JOIN), not through the gate

    def once(self) -> None:
        if not self.bwrap:
            subprocess.run(COMMAND, stdout=subprocess.DEVNULL, check=True)
            return
        slot = slots.take(self.config) if "kept" in (self.pts, self.group) else None
        pts = (slot.pts if self.pts == "kept" else
               roots.new_devpts(self.config.root_dir, "bench", 48) if self.pts else None)
        group = (slot.group if self.group == "kept" else
                 cgroups.create("", "bench-parts", "g", 1 << 32, 512) if self.group else None)
        argv, fds = local.bwrap_argv(self.host_dir, "/workspace", not self.net, 1024, self.uid, COMMAND)
        options = Path(f"/proc/self/fd/{fds[1]}").read_bytes().split(b"\0")[:-1]
        os.close(fds.pop())
        options = shown_by(self.view, [o.decode() for o in options], local.process_view(self.config.root_dir), pts)
        if not self.seccomp:
            at = options.index("--seccomp")
            del options[at:at + 2]
            os.close(fds.pop())
        if not self.mounts:
            start, end = 0, options.index("--unshare-ipc")
            options[start:end] = [*MINIMAL, "--chdir", "/"]
        argv, through = ["bwrap", *options, "--", *(argv[4:] if self.setpriv else COMMAND)], None
        if group and self.sh_join:
            argv = ["sh", "-c", SH_JOIN, "sh", *group.procs_files, "--", *argv]
        else:
            argv, fds, through = gated(argv, fds, group)
        try:
            process = subprocess.Popen(argv, pass_fds=fds, stdout=subprocess.DEVNULL)
        finally:
            for fd in fds:
                os.close(fd)
        if through:  # as gate.start does
            through.group.enter(process.pid)
            os.close(through.fd)
        if process.wait():
            raise subprocess.CalledProcessError(process.returncode, argv)
        CHILDREN.reap_adopted()  # bwrap's init, left to exit alone when bwrap ends by itself (supervisor.py)
        if slot:
            slots.give_back(slot, self.config)
        if group and self.group == "new":
            group.remove()
        if pts and self.pts == "new":
            roots.remove_work_dir(pts)


def shown_by(view: str, options: list[str], made: str, pts: str | None) -> list[str]:
    """bubblewrap's options (local.bwrap_options, no devices) with / and /dev shown the `view` way, and
    the sandbox's own PTY instance on /dev/pts if it has one."""
    tmp, proc = options.index("--size"), options.index("--proc")  # the root's options come first, /dev's last
    root = ["--dev-bind", made, "/"] if view == "whole" else options[:tmp]
    dev = {"bwrap": ["--dev", "/dev"], "dev": ["--dev-bind", f"{made}/dev", "/dev"], "whole": []}[view]
    return [*root, *options[tmp:tmp + 6], *dev, *(["--dev-bind", pts, "/dev/pts"] if pts else []), *options[proc:]]


def python_side(tree: Path, sandboxes: int) -> tuple[float, float]:
    """The runner process's own CPU per fresh sandbox (SANDBOX_MICRO's `self_cpu_s`), run from `tree`,
    and the machine's for the whole of it (`machine_cpu_s`: the issue's first command)."""
    out = subprocess.run([sys.executable, "-c", SANDBOX_MICRO, "fresh", "1", str(sandboxes)], cwd=tree,
                         capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(tree)})
    figures = json.loads(out.stdout)
    return 1000 * figures["self_cpu_s"] / sandboxes, 1000 * figures["machine_cpu_s"] / sandboxes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sandboxes", type=int, default=200, help="sandboxes per variant and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", type=Path, help="a checkout of the code before, for the Python side's figure")
    args = parser.parse_args()
    root = roots.new_root_dir()
    config = SandboxConfig(root_dir=root, label="bench-parts")
    uid, lock = roots.take_uid()
    host_dir = roots.new_work_dir(root, "w", 64, uid, sized=True)
    make = lambda **parts: Variant(config, host_dir, uid, **parts)  # noqa: E731
    variants = {
        "bash -c alone": make(bwrap=False),
        "bwrap: pid, ipc, uts, cgroup namespaces": make(net=False, mounts=False, seccomp=False, setpriv=False),
        "+ network namespace": make(mounts=False, seccomp=False, setpriv=False),
        "+ mounts": make(seccomp=False, setpriv=False),
        "+ seccomp": make(setpriv=False),
        "+ seccomp, the worker's /dev": make(setpriv=False, view="dev"),
        "+ seccomp, the worker's / and /dev": make(setpriv=False, view="whole"),
        "+ the loop's uid (setpriv)": make(),
        "+ devpts, new per sandbox": make(pts="new"),
        "+ devpts, kept": make(pts="kept"),
        "+ cgroup, new per sandbox": make(group="new"),
        "+ cgroup, kept": make(group="kept"),
        "+ devpts and cgroup, new": make(pts="new", group="new"),
        "+ devpts and cgroup, kept": make(pts="kept", group="kept"),
        "+ devpts and cgroup, kept, the worker's /dev": make(pts="kept", group="kept", view="dev"),
        "  the same, the cgroup joined by sh (before)": make(pts="kept", group="kept", view="dev", sh_join=True),
        "+ devpts and cgroup, kept, the worker's /": make(pts="kept", group="kept", view="whole"),
    }
    figures: dict[str, list[float]] = {name: [] for name in variants}
    machine: dict[str, list[float]] = {name: [] for name in variants}
    trees = {"python, before": args.before, "python, after": ROOT} if args.before else {"python": ROOT}
    figures.update({name: [] for name in trees})
    machine.update({name: [] for name in trees})
    try:
        for _ in range(args.rounds):
            for name, variant in variants.items():
                start = cpu()
                for _ in range(args.sandboxes):
                    variant.once()
                end = cpu()
                figures[name].append(1000 * (end[0] - start[0]) / args.sandboxes)
                machine[name].append(1000 * (end[1] - start[1]) / args.sandboxes)
            for name, tree in trees.items():
                ours, whole = python_side(tree, args.sandboxes)
                figures[name].append(ours)
                machine[name].append(whole)
    finally:
        slots.drop(config)
        cgroups.remove(label="bench-parts")
        roots.remove_root(root)
        roots.release_root(root)
    print(f"{'ms of CPU a sandbox, median (range)':45s} {'ours and kernel threads':>24s} {'machine':>20s}")
    print("(the python rows: the runner's own process; the machine's, for the whole fresh sandbox it opened)")
    for name, values in figures.items():
        whole = f"{statistics.median(machine[name]):6.2f} ({min(machine[name]):.2f}-{max(machine[name]):.2f})"
        print(f"{name:45s} {statistics.median(values):6.2f} ({min(values):.2f}-{max(values):.2f}) {whole:>20s}")
    print(f"load average {os.getloadavg()[0]:.1f}; PTY share {shares.ptys(config.slots)}")


if __name__ == "__main__":
    main()
