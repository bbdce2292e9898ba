#!/usr/bin/env python
"""What one process start costs on this machine, and how much of it is the C library's start-up.

A prompt's first command starts four programs (bubblewrap, setpriv, the command loop's bash and
the command's), a later command one. Each runs glibc's x86 CPU and cache detection before `main`,
dozens of `cpuid` instructions; in a virtual machine each `cpuid` traps to the hypervisor. This
times a spawn of `/bin/true` (dynamic glibc), of busybox (static glibc, where installed) and of a
program with no C library at all, and one `cpuid`, so a reader can see that share on any machine.

    python bench/process_start.py [--spawns=2000] [--rounds=3]

x86-64 only (`cpuid`, and the libc-free program's `exit` system call); needs a C compiler (`cc`)
for that program and the `cpuid` timer. Prints medians, ms of CPU a spawn: the children's
(getrusage) and the whole machine's (/proc/stat).
"""
from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile

from harness import CLK_TCK, _cpu_jiffies

NO_LIBC = "void _start(void) { __asm__ volatile(\"mov $60, %eax; xor %edi, %edi; syscall\"); }\n"
CPUID = r"""
#include <cpuid.h>
#include <stdio.h>
#include <time.h>
int main(void) {
    unsigned a, b, c, d; struct timespec t0, t1; const int n = 20000;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < n; i++) __cpuid_count(4, 0, a, b, c, d);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("%.3f\n", ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / n / 1e3);
    return 0;
}
"""


def build(tmp: str, name: str, source: str, *flags: str) -> str:
    """Compile `source` into tmp/name; the generic x86-64 target, never this host's CPU."""
    path = os.path.join(tmp, name)
    with open(path + ".c", "w") as f:
        f.write(source)
    built = subprocess.run(["cc", "-O2", *flags, "-o", path, path + ".c"], capture_output=True, text=True)
    if built.returncode:
        errors = [line for line in built.stderr.splitlines() if "error" in line]
        said = errors[0] if errors else built.stderr.strip() or "no output"
        sys.exit(f"process_start.py: cc could not build {name}: {said}")
    return path


def spawn_cost(argv: list[str], spawns: int) -> tuple[float, float]:
    """ms of CPU a spawn and wait of argv: its own (getrusage of children) and the machine's."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0 = _cpu_jiffies()[0]
    for _ in range(spawns):
        os.waitpid(os.posix_spawn(argv[0], argv, {}), 0)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return 1000 * own / spawns, 1000 * (_cpu_jiffies()[0] - busy0) / CLK_TCK / spawns


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spawns", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    if platform.machine() != "x86_64":
        sys.exit(f"process_start.py: measures x86-64's cpuid; this machine is {platform.machine()}")
    if not shutil.which("cc"):
        sys.exit("process_start.py: no C compiler (cc) to build the libc-free program")
    with tempfile.TemporaryDirectory(prefix="process-start-") as tmp:
        programs = {"no C library (static, `_start` exits)": [build(tmp, "nolibc", NO_LIBC, "-static", "-nostdlib")],
                    "/bin/true (dynamic glibc)": ["/bin/true"]}
        if busybox := shutil.which("busybox"):
            programs["busybox true (static glibc)"] = [busybox, "true"]
        cpuid = build(tmp, "cpuid", CPUID)
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in programs}
        cpuid_us = []
        for _ in range(a.rounds):  # interleaved, so each sees the same machine
            for name, argv in programs.items():
                runs[name].append(spawn_cost(argv, a.spawns))
            cpuid_us.append(float(subprocess.run([cpuid], capture_output=True, text=True, check=True).stdout))
    print(f"{'ms of CPU a spawn, median (range)':44s} {'the process':22s} machine")
    for name, values in runs.items():
        own, machine = zip(*values)
        print(f"{name:44s} {statistics.median(own):.3f} ({min(own):.3f}-{max(own):.3f})      "
              f"{statistics.median(machine):.3f} ({min(machine):.3f}-{max(machine):.3f})")
    print(f"one cpuid (leaf 4): {statistics.median(cpuid_us):.2f} µs (runs {', '.join(f'{v:.2f}' for v in cpuid_us)})")


if __name__ == "__main__":
    main()
