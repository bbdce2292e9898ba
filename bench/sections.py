"""The bench sections: each runs the CLI (or a part of it) and returns its measurements."""
from __future__ import annotations

import collections
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import harness
from harness import (
    CHILDREN,
    OUT,
    ROOT,
    SCRIPT_NO_SANDBOX,
    SCRIPT_PLAIN,
    SCRIPT_TOOL,
    Server,
    _drop,
    _env,
    _fresh,
    cli_argv,
    dataset,
    run_cli,
    say,
    wait_for_quiet,
)

# ----------------------------------------------------------------------------- sections


LATENCY = 0.25
REALISTIC_LATENCY, REALISTIC_COMMANDS = 1.0, 5  # issue 53's realistic workload


def _throughput_runs(configs: list[tuple[int, int, bool]], n: int, repeats: int, tag: str,
                     flags: tuple[str, ...] | None = None, latency: float = LATENCY, commands: int = 1) -> dict:
    """`latency` s per call, `commands` + 1 replies: each of the first `commands` calls `terminal` (echo hi)
    in the prompt's sandbox, or without tools one tool the run does not offer (answered at once; no
    toolset that needs a sandbox is offered); the last ends. `flags`: as cli_argv's."""
    data = dataset(n)
    runs: dict[str, list[dict]] = collections.defaultdict(list)
    servers = {}
    command, final = SCRIPT_TOOL["default"]
    script_tool = {"default": [command] * commands + [final]}
    try:
        for tools in sorted({c[2] for c in configs}, reverse=True):
            servers[tools] = Server(script_tool if tools else SCRIPT_NO_SANDBOX, latency,
                                    f"{tag}-{'tool' if tools else 'plain'}")
        for rep in range(repeats):
            for workers, conc, tools in configs:  # interleaved, so that noise spreads over every configuration
                calls = commands + 1 if tools else 2
                ideal = math.ceil(n / conc) * calls * latency
                key = f"{workers}x{conc}" + ("" if tools else "-notools")
                name = f"{tag}-w{workers}-c{conc}{'' if tools else '-notools'}-n{n}-r{rep}"
                _fresh(name)
                say(f"{tag} {name}: ideal {ideal:.1f} s")
                argv = cli_argv(data, name, servers[tools].url, workers, conc, flags=flags, sandbox=tools)
                r = run_cli(argv, name, n, servers[tools], timeout=max(300.0, 10 * ideal), sample_rss=False,
                            prompt_walls=True)
                _drop(name, harness.KEEP_RUNS)
                eff = ideal / r.duration_s if r.duration_s else None
                say(f"  duration {r.duration_s} s, wall {r.wall_s:.2f} s, efficiency {eff and round(eff, 3)}, "
                    f"cpu {r.cpu_s:.1f} s, server cpu {r.server_cpu_s:.1f} s, prompt wall p50 {r.prompt_wall_p50}")
                runs[key].append({**r.__dict__, "ideal_s": ideal, "efficiency": eff, "workers": workers,
                                  "concurrency": conc, "tools": tools, "calls": calls, "latency": latency})
    finally:
        for server in servers.values():
            server.close()
    return dict(runs)


def _configs(text: str) -> list[tuple[int, int, bool]]:
    """WORKERSxCONCURRENCY[-notools],... -> (workers, concurrency, tools): with the terminal tool
    unless -notools."""
    configs = []
    for c in text.split(","):
        workers, conc = (int(x) for x in c.removesuffix("-notools").split("x"))
        configs.append((workers, conc, not c.endswith("-notools")))
    return configs


def section_throughput(args) -> dict:
    return {"n": args.n_throughput, "latency": LATENCY,
            "configs": _throughput_runs(_configs(args.throughput_configs or "2x64,2x256,4x4"), args.n_throughput,
                                        args.repeats, "tp")}


def section_realistic(args) -> dict:
    """Issue 53's realistic workload: 1 s per call, five sandboxed commands per prompt, then the answer."""
    configs = _configs(args.throughput_configs or "2x64,2x128,2x256")
    return {"n": args.n_throughput, "latency": REALISTIC_LATENCY, "commands": REALISTIC_COMMANDS,
            "configs": _throughput_runs(configs, args.n_throughput, args.repeats, "re",
                                        latency=REALISTIC_LATENCY, commands=REALISTIC_COMMANDS)}


def section_versus(args) -> dict:
    """The first throughput configuration without --cli-flags and with them, alternately (A B A B ...), so
    that each pair meets the same machine: separate invocations minutes apart moved the ratio by 0.2."""
    if not harness.CLI_FLAGS:
        raise ValueError("section versus compares runs with --cli-flags against runs without: give --cli-flags")
    workers, conc = (int(x) for x in (args.throughput_configs or "2x64").split(",")[0].split("x"))
    pairs = []
    for rep in range(args.repeats):
        pair = {}
        for which, flags in (("without", ()), ("with", None)):
            runs = _throughput_runs([(workers, conc, True)], args.n_throughput, 1, f"vs-{which}-r{rep}", flags)
            pair[which] = next(iter(runs.values()))[0]
        pairs.append(pair)
    return {"n": args.n_throughput, "latency": LATENCY, "workers": workers, "concurrency": conc,
            "flags": " ".join(harness.CLI_FLAGS), "pairs": pairs}


def section_diag(args) -> dict:
    """Where the throughput limit comes from: more workers for the same concurrency (fewer
    connections per httpx pool), and the same run without the sandbox (no tool call)."""
    return {"n": args.n_throughput, "latency": LATENCY,
            "configs": _throughput_runs(_configs(args.diag_configs), args.n_throughput, args.repeats, "diag")}


POOL_MICRO = r"""
import asyncio, json, resource, sys, time
import openai
kind, url, conns, total = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if kind == "aiohttp":  # openai.DefaultAioHttpClient (needs `pip install aiohttp`)
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
    --concurrency): CPU per request of the openai SDK over the legacy httpx client (what trajgen/chat_calls.py
    passed until d607319), over httpx2 (the SDK's own default) and over aiohttp (openai.DefaultAioHttpClient;
    `pip install aiohttp`), at latency 0.25 s. The runner uses aiohttp without the SDK (trajgen/chat_calls.py;
    bench/http_client.py measures it)."""
    out: dict = {"latency": LATENCY, "runs": collections.defaultdict(list)}
    with Server(SCRIPT_PLAIN, LATENCY, "pool") as server:
        for rep in range(args.repeats):
            for kind in ("httpx", "httpx2", "aiohttp"):
                for conns in (32, 128):
                    total = 40 * conns  # 40 waves: ideal 10 s
                    background = wait_for_quiet()
                    say(f"pool {kind} connections={conns} requests={total}")
                    r = _micro(POOL_MICRO, [kind, server.url, str(conns), str(total)], ROOT, 600, "pool micro-benchmark")
                    r.update(total=total, ideal_s=40 * LATENCY, cpu_ms_per_request=1000 * r["cpu_s"] / total,
                             background_busy=background)
                    say(f"  cpu {r['cpu_ms_per_request']:.2f} ms/request, wall {r['wall_s']:.1f} s (ideal 10 s)")
                    out["runs"][f"{kind}@{conns}"].append(r)
    out["runs"] = dict(out["runs"])
    return out


SANDBOX_MICRO = r"""
import asyncio, json, os, resource, sys, tempfile, time
from trajgen.sandbox.backends import SandboxConfig, cleanup, open_sandbox, prepare_worker
from trajgen.sandbox.local import LocalSandbox

variant, conc, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
config = SandboxConfig(root_dir=tempfile.mkdtemp(prefix="bench-sandbox-"), network=variant == "fresh-with-network")
prepare_worker(config)  # as a run's worker does before its first sandbox

def make(key):
    if variant != "plain":
        return open_sandbox(config, key)
    host_dir = os.path.join(config.root_dir, key)  # what --unsafe_local runs where bubblewrap cannot
    os.mkdir(host_dir)
    return LocalSandbox(config, host_dir, host_dir, isolated=False)

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

async def main():
    lat = []
    async def command(sandbox):
        t = time.perf_counter()
        r = await sandbox.run("echo hi", 60)
        lat.append(time.perf_counter() - t)
        if r.exit_code != 0 or "hi" not in r.output:
            raise SystemExit(f"sandbox command failed: {r}")
    async def slot(s):
        if variant == "same":  # commands after the first of a prompt: one sandbox, started before the clock
            sandbox = await asyncio.to_thread(make, f"s{s}")
            await sandbox.run("true", 60)
            await warm.wait()
            await ready.wait()
            for i in range(s, total, conc):
                await command(sandbox)
            await finished.wait()
            await measured.wait()  # the sandbox's end is not a command's: it is outside the clock
            await sandbox.close()
            return
        await warm.wait()
        await ready.wait()
        for i in range(s, total, conc):  # a prompt's first command: a sandbox of its own
            sandbox = await asyncio.to_thread(make, f"p{i}")
            await command(sandbox)
            await sandbox.close()
    warm, ready = asyncio.Barrier(conc + 1), asyncio.Event()
    finished, measured = asyncio.Barrier(conc + 1), asyncio.Event()
    slots = [asyncio.create_task(slot(s)) for s in range(conc)]
    await warm.wait()
    j0, k0, t0 = jiffies(), kthreads(), time.perf_counter()
    r0 = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    ready.set()
    await (finished.wait() if variant == "same" else asyncio.gather(*slots))
    r1 = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    j1, k1, t1 = jiffies(), kthreads(), time.perf_counter()
    measured.set()
    await asyncio.gather(*slots)
    cpu = sum((b.ru_utime - a.ru_utime) + (b.ru_stime - a.ru_stime) for a, b in zip(r0, r1))
    lat.sort()
    self_cpu = (r1[0].ru_utime - r0[0].ru_utime) + (r1[0].ru_stime - r0[0].ru_stime)  # the runner's side alone
    print(json.dumps({"wall_s": t1 - t0, "cpu_s": cpu, "machine_cpu_s": (j1[0] - j0[0]) / os.sysconf("SC_CLK_TCK"),
                      "kthreads_cpu_s": k1 - k0, "self_cpu_s": self_cpu,
                      "p50_s": lat[len(lat) // 2], "p95_s": lat[int(len(lat) * 0.95)]}))
    cleanup(config)

asyncio.run(main())
"""


def section_sandbox(args) -> dict:
    """The local sandbox alone, one `echo hi` per command: latency, commands per second, CPU per
    command, and how much CPU the machine spent beyond our processes (kernel namespace set-up and
    teardown). `fresh`: each command the first of its prompt (a sandbox of its own, opened, run,
    closed); `same`: commands after the first, in an already running sandbox; `plain`: no bubblewrap,
    as --unsafe_local runs where bubblewrap cannot."""
    out: dict = {"runs": collections.defaultdict(list)}
    for rep in range(args.repeats):
        for variant in ("plain", "fresh", "fresh-with-network", "same"):
            for conc, total in ((1, 100), (32, 400)):
                background = wait_for_quiet()
                say(f"sandbox {variant} concurrency={conc} commands={total}")
                r = _micro(SANDBOX_MICRO, [variant, str(conc), str(total)], ROOT, 900, "sandbox micro-benchmark")
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
            # the fixed cost of one invocation (imports, dataset check, worker start, merge): N = 1
            one = dataset(1)
            fixed = []
            for rep in range(args.repeats):
                name = f"ov-{label}-n1-r{rep}"
                _fresh(name)
                r = run_cli(cli_argv(one, name, server.url, workers, conc, sandbox=label == "terminal"), name, 1,
                            server, timeout=120, sample_rss=False)
                _drop(name, harness.KEEP_RUNS)
                fixed.append(r.__dict__)
            runs = []
            for rep in range(args.repeats):
                name = f"ov-{label}-n{n}-r{rep}"
                _fresh(name)
                say(f"overhead {name}")
                r = run_cli(cli_argv(data, name, server.url, workers, conc, sandbox=label == "terminal"), name, n,
                            server, timeout=1800, sample_rss=False, prompt_walls=True)
                _drop(name, harness.KEEP_RUNS)
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
            argv = cli_argv(data, name, server.url, args.scale_workers, args.scale_concurrency, sandbox=False)
            say(f"scale {name}")
            r = run_cli(argv, name, n, server, timeout=args.scale_timeout)
            say(f"  duration {r.duration_s} s, parent peak {r.parent_rss_mb} MB, worker peak {r.worker_rss_mb} MB, "
                f"cpu {r.cpu_s:.1f} s")
            entry = {"run": r.__dict__}
            run_dir = OUT / "runs" / name
            entry["disk_mb"] = round(sum(p.stat().st_size for p in run_dir.iterdir()) / 2**20, 1)
            # --resume on the finished run: scans every batch file, plans nothing, starts the pool, merges
            resumes = []
            for rep in range(args.repeats):
                rname = f"{name}"
                say(f"  resume #{rep + 1} of {name}")
                rr = run_cli([*argv, "--resume"], rname, n, server, timeout=1800)
                say(f"    wall {rr.wall_s:.2f} s, duration {rr.duration_s} s, parent peak {rr.parent_rss_mb} MB")
                resumes.append(rr.__dict__)
            entry["resume"] = resumes
            # the merge and the resume scan alone: trajgen.merge.merge / trajgen.resume_scan.scan called directly
            entry["direct"] = [_time_merge(run_dir) for _ in range(args.repeats)]
            say(f"  direct: {entry['direct'][-1]}")
            out["sizes"][str(n)] = entry
            _drop(name, harness.KEEP_RUNS)
    return out


MERGE_TIMER = r"""
import json, sys, time, resource
from pathlib import Path
from trajgen import merge, resume_scan
run_dir = Path(sys.argv[1])
t0 = time.perf_counter(); s = resume_scan.scan(run_dir); t1 = time.perf_counter()
m = merge.merge(run_dir, merge.Filtering()); t2 = time.perf_counter()
print(json.dumps({"scan_s": t1 - t0, "merge_s": t2 - t1, "rows": m.kept.rows, "done": len(s.done),
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _time_merge(run_dir: Path) -> dict:
    return _micro(MERGE_TIMER, [str(run_dir)], harness.CLI_ROOT, 1800, "merge timer")


def _micro(code: str, argv: list[str], cwd: Path, timeout: float, what: str) -> dict:
    """Run `python -c code argv...` in `cwd`; its stdout is one JSON object."""
    proc = CHILDREN.start([sys.executable, "-c", code, *argv], cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, env=_env())
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        CHILDREN.stop(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed: {(out + err).decode()[-2000:]}")
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
            stem = f"profile-{harness.TAG + '-' if harness.TAG else ''}{workers}x{conc}"
            target = OUT / (f"{stem}.txt" if fmt == "raw" else f"{stem}.svg")
            wrap = ["py-spy", "record", "--subprocesses", "--threads", "--idle", "--rate", str(args.profile_rate), "--format", fmt,
                    "-o", str(target), "--"]
            say(f"profile {name} -> {target}")
            r = run_cli(cli_argv(data, name, server.url, workers, conc), name, n, server, timeout=1800,
                        sample_rss=False, prompt_walls=True, wrap=wrap)
            _drop(name, harness.KEEP_RUNS)
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
    if "multiprocessing.forkserver" not in headers[-1]:
        return "other"
    return "worker" if len(headers) > 2 else "fork_server"  # workers are the fork server's children


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
