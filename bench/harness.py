"""The bench harness: child processes, the scripted server, quiet-machine waits, the memory sampler, one CLI run."""
from __future__ import annotations

import collections
import ctypes
import hashlib
import json
import math
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from rich.console import Console

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
CLI_ROOT = ROOT  # where batch_runner.py runs from; --cli-root points at another tree (an older commit)
KEEP_RUNS = False  # --keep-runs
TAG = ""  # --tag: the label of --cli-root's (or --cli-flags') results
CLI_FLAGS: tuple[str, ...] = ()  # --cli-flags: added to every CLI run (e.g. --executor=ray)
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
# two calls and no sandbox (with cli_argv's sandbox=False): the run does not offer this tool, so the agent
# answers it with an error at once
SCRIPT_NO_SANDBOX = {"default": [{"tool_calls": [{"name": "not_offered", "arguments": {}}]}, {"content": "done"}]}

console = Console(highlight=False)
if not console.is_terminal:  # logs and pipes: wide enough for the table
    console = Console(highlight=False, width=220)


# ----------------------------------------------------------------------------- process hygiene


PR_SET_CHILD_SUBREAPER = 36  # prctl(2)


def _children() -> set[int]:
    """This process's children, zombies included."""
    return {int(pid) for f in Path("/proc/self/task").glob("*/children") for pid in f.read_text().split()}


class Children:
    """Every process this benchmark starts, so that all of them are stopped on any exit path.

    Each child gets its own session (its process group id is its pid): Ctrl-C in the terminal
    reaches only this script, which then stops its children by their ids.
    """

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        # what a CLI leaves behind comes here rather than to init: multiprocessing's fork server, which
        # reaped the workers, outlives the CLI by milliseconds, and RUSAGE_CHILDREN counts it once reaped
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

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

    def reap_adopted(self, timeout: float = 30.0) -> None:
        """Wait for the processes an exited CLI left behind (they end once its pipes close)."""
        deadline = time.monotonic() + timeout
        while adopted := _children() - {p.pid for p in self.procs}:
            for pid in adopted:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
            if time.monotonic() > deadline:
                say(f"[yellow]warning:[/] processes {sorted(adopted)} outlived their CLI by {timeout:.0f} s")
                return
            time.sleep(0.01)

    def stop_all(self) -> None:
        for proc in list(reversed(self.procs)):
            self.stop(proc, grace=15.0)


CHILDREN = Children()


def _on_sigterm(signum, frame):  # turn SIGTERM into the same clean exit as Ctrl-C
    raise KeyboardInterrupt


# ----------------------------------------------------------------------------- scripted server


class Server:
    """`python -m tests.support.scripted_server` as a separate process; its CPU time is read from /proc."""

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
            [sys.executable, "-m", "tests.support.scripted_server", "--script", str(self.script_path), "--latency", str(latency)],
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


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _role(root: int, pid: int, cmdline: str) -> str:
    if pid == root:
        return "parent"
    if "multiprocessing.forkserver" in cmdline:  # the fork server, the CLI's child, and the workers it forks
        return "fork_server" if _ppid(pid) == root else "worker"
    if "resource_tracker" in cmdline:
        return "resource_tracker"
    return "other"  # sandboxes: bwrap, setpriv, bash


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
    steady_rate: float | None = None  # prompts/s between the 10th and the 90th percentile of the rows' end times
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


def cli_argv(data: Path, run_name: str, url: str, workers: int, concurrency: int, extra: tuple = (),
             flags: tuple[str, ...] | None = None, sandbox: bool = True) -> list[str]:
    """`flags`: the run's own flags, --cli-flags when None. A prompt offered the terminal starts its
    sandbox during its first call, whether it calls the tool or not: without `sandbox` the run offers
    only the web toolset, which needs none."""
    return [
        sys.executable, "batch_runner.py", f"--dataset_file={data}", f"--run_name={run_name}",
        f"--output_dir={OUT / 'runs'}", f"--base_url={url}", "--api_key=dummy", "--model=bench",
        "--require_reasoning=False", f"--distribution={'terminal_only' if sandbox else 'minimal'}",
        f"--num_workers={workers}", f"--concurrency={concurrency}", *extra, *(CLI_FLAGS if flags is None else flags),
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
            rc = _wait_cli(proc, server, time.monotonic() + timeout, f"{run_name} (see {log_path})")
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
    if prompt_walls and (walls := _prompt_walls(run_dir)):
        result.prompt_wall_p50 = walls[len(walls) // 2]
        result.prompt_wall_p95 = walls[min(len(walls) - 1, int(len(walls) * 0.95))]
        result.steady_rate = _steady_rate(run_dir)
    if rc != 0 or result.ok != n:
        console.print(f"[yellow]warning:[/] {run_name}: exit {rc}, ok={result.ok}/{n}, failed={result.failed} "
                      f"(see {log_path})")
    return result


def _wait_cli(proc: subprocess.Popen, server: Server, deadline: float, what: str) -> int:
    """The CLI's exit status; ServerDied when the scripted server dies first."""
    while True:
        try:
            code = proc.wait(1.0)
            CHILDREN.reap_adopted()  # before the caller reads getrusage: the workers' CPU is theirs
            return code
        except subprocess.TimeoutExpired:
            if not server.alive():
                CHILDREN.stop(proc)
                raise ServerDied(what)
            if time.monotonic() > deadline:
                CHILDREN.stop(proc)
                raise RuntimeError(f"{what}: the CLI did not finish in time")


def _prompt_walls(run_dir: Path) -> list[float]:
    """Each kept prompt's wall time, sorted."""
    if not (run_dir / "trajectories.jsonl").exists():
        return []
    with open(run_dir / "trajectories.jsonl", "rb") as f:
        return sorted(json.loads(line)["metadata"]["usage"]["wall_seconds"] for line in f)


def _steady_rate(run_dir: Path) -> float | None:
    """Prompts per second once the run is going: start-up and the last stragglers left out (the rows'
    end times have 1 s resolution, over runs of tens of seconds)."""
    with open(run_dir / "trajectories.jsonl", "rb") as f:
        ends = sorted(datetime.fromisoformat(json.loads(line)["metadata"]["timestamp"]).timestamp() for line in f)
    low, high = ends[len(ends) // 10], ends[(9 * len(ends)) // 10]
    return (9 * len(ends) // 10 - len(ends) // 10) / (high - low) if high > low else None


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


def write_section(start: str, end: str, section: str) -> None:
    """Replace a standalone benchmark's section of RESULTS.md, from `start` to `end` (report.py keeps
    it when it rewrites the rest), or append it."""
    text = RESULTS_MD.read_text() if RESULTS_MD.exists() else ""
    if start in text and end in text:
        text = text.split(start, 1)[0] + section + text.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    RESULTS_MD.write_text(text)


def say(message: str) -> None:
    console.print(f"[dim]{datetime.now().strftime('%H:%M:%S')}[/] {message}")
