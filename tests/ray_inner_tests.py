"""The Ray executor end to end. Run only by tests/test_ray.py, inside a private network namespace.

Ray may take the machine's non-loopback address and listen on it, so these tests start Ray only
where loopback is the sole interface, and refuse anywhere else. The model server
is the loopback scripted server, in the same namespace. An actor is killed the way the OOM
killer would: SIGKILL to its process, found by the process title Ray gives it.
"""
from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

if socket.if_nameindex() != [(1, "lo")]:
    pytest.exit(f"refusing to start Ray outside a loopback-only network namespace (interfaces: "
                f"{[name for _, name in socket.if_nameindex()]}); run tests/test_ray.py instead", returncode=3)

# This process hosts private instances and a test cluster, and Ray fixes its auth mode when it is
# imported: one token for all. The CLI runs below get a clean environment (the `cli` fixture).
os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from tests.support.ray_actors import actor_pids  # noqa: E402
from tests.conftest import call, kill_group, read_jsonl, think, write_jsonl  # noqa: E402
from tests.test_guard_rails import gated_calls, replies_sent  # noqa: E402
from tests.test_vision_image_tools import PNG  # noqa: E402
from tests.test_web_tools import fake_api, no_provider_env  # noqa: E402, F401  (fixtures)
from trajgen import scheduler  # noqa: E402
from trajgen.errors import WorkerCrashed  # noqa: E402
from trajgen.messages import Event, Fatal, Finished, Log, Throttled  # noqa: E402
from trajgen.plan import Plan  # noqa: E402
from trajgen.ray_executor import RayPool  # noqa: E402
from trajgen.sandbox.backends import SandboxConfig, cleanup  # noqa: E402
from trajgen.tools import ToolSettings  # noqa: E402
from trajgen.task import ModelSettings, Task, WorkerConfig  # noqa: E402

SLOW = [{**call("terminal", command="echo hi"), "delay": 0.4}, {**think(), "delay": 0.4}]
# blocks in its sandbox until the test creates `release` in the sandbox's work dir
GATED = [call("terminal", command="until [ -e release ]; do sleep 0.05; done"), think()]


@pytest.fixture
def cli(cli):
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        cli.env.pop(name)
    return cli


def assert_actors_without_uvloop() -> None:
    """uvloop starts each sandbox's process with a fork of the whole actor (twice its CPU, and a hang once)."""
    for pid in wait_for(actor_pids, what="an actor"):
        assert b"RAY_USE_UVLOOP=0" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def wait_for(predicate, timeout: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"no {what} after {timeout} s")


def rows_landed(run_dir: Path) -> int:
    return sum(1 for p in run_dir.glob("batch_*.jsonl") for _ in p.open())


def prompts_of(rows: list[dict]) -> list[str]:
    return [r["conversations"][1]["value"] for r in rows]


# --------------------------------------------------------------------------- the executor itself


def _task(i: int, prompt: str) -> Task:
    return Task(key=f"key-{i}", prompt_index=i, batch_num=0, prompt=prompt, image=None, cwd=None, extra={},
                toolsets_sampled=["terminal"], toolsets_offered=["terminal"])


_SANDBOXES: list[SandboxConfig] = []  # the pools' sandbox settings, given up after each test


@pytest.fixture(autouse=True)
def _slots_given_up():
    """A killed actor cannot give up its sandboxes' cgroups (a run's next invocation does, by run id): the test does."""
    yield
    while _SANDBOXES:
        cleanup(_SANDBOXES.pop())


def _pool(server, tmp_path: Path, crash_retries: int, address: str | None = None,
          num_workers: int | None = 2) -> RayPool:
    _SANDBOXES.append(SandboxConfig(root_dir=str(tmp_path / "sandboxes")))
    config = WorkerConfig(
        model=ModelSettings(model="test-model", base_url=server.url, api_key="dummy-key", max_retries=1),
        sandbox=_SANDBOXES[-1], tools=ToolSettings(), unavailable_tools={}, concurrency=4)
    return RayPool(num_workers, config, address, worker_memory=256, crash_retries=crash_retries)


def _drain(pool: RayPool, until=None, timeout: float = 120) -> list[Event]:
    """Poll (which also hands queued prompts to actors that are up) until `until()`, else until nothing is in flight."""
    messages: list[Event] = []
    deadline = time.monotonic() + timeout
    while not (until() if until else not pool.inflight):
        assert time.monotonic() < deadline, f"still waiting after {timeout} s"
        messages += pool.poll(0.1)
    return messages


def test_executor_relays_results_throttle_and_fatal_once_each(scripted_server, tmp_path):
    server = scripted_server({"prompts": {
        "limited": [{"status": 429, "retry_after": "0", "times": 1, "then": think()}],
        "refused": [{"status": 401, "error": "bad key"}],
    }, "default": [call("terminal", command="echo hi"), think()]})
    pool = _pool(server, tmp_path, crash_retries=0)
    pool.start()
    try:
        tasks = [_task(i, f"prompt {i}") for i in range(10)] + [_task(10, "limited"), _task(11, "refused")]
        for task in tasks:
            pool.submit(task)
        messages = _drain(pool)
    finally:
        pool.close()
    results = {m.outcome.key: m.outcome for m in messages if isinstance(m, Finished)}
    assert len([m for m in messages if isinstance(m, Finished)]) == len(results) == 12
    assert all(results[t.key].row is not None for t in tasks[:11])
    assert results["key-11"].reason == "FatalAPIError"
    assert Throttled() in messages and any(isinstance(m, Fatal) and "HTTP 401" in m.reason for m in messages)
    assert not (tmp_path / "sandboxes").exists()  # closing removed every sandbox


def _outcomes(messages: list[Event]) -> list:
    return [m.outcome for m in messages if isinstance(m, Finished)]


def test_executor_killed_actor_prompts_come_back_failed_and_the_actor_restarts(scripted_server, tmp_path):
    server = scripted_server({"default": GATED})
    pool = _pool(server, tmp_path, crash_retries=0)
    sandboxes = tmp_path / "sandboxes"
    pool.start()
    try:
        for i in range(8):
            pool.submit(_task(i, f"prompt {i}"))
        # every prompt is inside its gated command, so none can finish before the kill
        work_dirs = lambda: [p for p in sandboxes.iterdir() if p.suffix not in (".pts", ".view")] if sandboxes.exists() else []  # noqa: E731
        early = _drain(pool, until=lambda: len(work_dirs()) >= 8)  # beside the work dirs: PTY instances, workers' /dev
        victim = actor_pids()[0]
        os.kill(victim, signal.SIGKILL)
        crashed = _outcomes(early + _drain(pool, until=lambda: pool.inflight <= 4))
        for work_dir in work_dirs():
            (work_dir / "release").touch()
        finished = _outcomes(_drain(pool))
        assert sorted(r.key for r in crashed + finished) == sorted(f"key-{i}" for i in range(8))
        assert len(crashed) == 4 and {r.reason for r in crashed} == {WorkerCrashed.__name__}
        assert all(r.row for r in finished)
        # Ray restarted the actor, and the pool sends it prompts again
        _drain(pool, until=lambda: all(slot.up for slot in pool.slots), timeout=60)
        assert len(pool.slots) == 2 and len(actor_pids()) == 2 and victim not in actor_pids()
        server.set_script({"default": SLOW})  # no gate now
        for i in range(8, 16):
            pool.submit(_task(i, f"prompt {i}"))
        again = _outcomes(_drain(pool))
        assert len(again) == 8 and all(r.row for r in again)
    finally:
        pool.close()


def test_executor_spend_limit_stops_within_the_calls_in_flight(scripted_server, tmp_path):
    """Replies reach the driver as they arrive (a paid reply is urgent): a limit of 2 replies over 16 prompts
    of 9 calls on 2 actors of 4 conversations stops at the first turns' replies, the later calls cancelled."""
    server = scripted_server({"default": gated_calls("later")})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    limits = scheduler.Limits(run_name="run", batch_size=16, concurrency=8, max_cost=0.002)
    run = scheduler.Scheduler(Plan(remaining=16), _pool(server, tmp_path, crash_retries=0), limits, run_dir, {}, 0.0,
                              time.monotonic())
    failing = threading.Timer(60, server.open_gate, ["later"])  # a run that does not stop still ends
    failing.start()
    try:
        end = run.execute(iter([_task(i, f"prompt {i}") for i in range(16)]), on_exit=lambda: None)
    finally:
        failing.cancel()
    sent = replies_sent(server, probes=0)
    assert end.budget == "--max_cost=0.002" and sent <= 2 + 8, f"{sent} replies paid"
    assert 0.002 <= end.paid_cost <= 0.001 * sent


def test_executor_without_any_worker_left_stops_the_run(scripted_server, tmp_path):
    server = scripted_server({"default": SLOW})
    pool = _pool(server, tmp_path, crash_retries=2)
    pool.start()
    try:
        pool.submit(_task(0, "prompt 0"))
        _drain(pool, until=server.requests)
        for slot in pool.slots:
            ray.kill(slot.actor, no_restart=True)  # as an operator's `ray kill` would: no restart
        with pytest.raises(WorkerCrashed, match="every Ray worker is gone for good"):
            _drain(pool, timeout=60)
    finally:
        pool.close()


def test_executor_on_a_cluster_whose_node_dies_runs_the_lost_prompts_elsewhere(scripted_server, tmp_path, monkeypatch):
    """Three Ray nodes on this machine: a head with no CPUs for workers, and two worker nodes, one of which dies."""
    temp_dir = tempfile.mkdtemp(prefix="c", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", temp_dir)  # the cluster's files, instead of /tmp/ray
    for name, value in (("RAY_health_check_period_ms", "500"), ("RAY_health_check_failure_threshold", "3")):
        monkeypatch.setenv(name, value)  # the node's death is noticed in 1.5 s instead of about 15
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    server = scripted_server({"default": [{**call("terminal", command="echo hi"), "delay": 2}, think()]})
    pool = _pool(server, tmp_path, crash_retries=1, address="auto")  # found as `ray start` leaves it
    try:
        pool.start()  # the driver joins the head, so that either worker node can die
        nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
        for i in range(8):
            pool.submit(_task(i, f"prompt {i}"))
        early = _drain(pool, until=lambda: len(server.requests()) >= 8)
        raylet = int(Path(f"/proc/{actor_pids()[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its parent
        cluster.remove_node(next(n for n in nodes if n.all_processes["raylet"][0].process.pid == raylet),
                            allow_graceful=False)
        messages = early + _drain(pool)
    finally:
        pool.close()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    results = _outcomes(messages)
    assert sorted(r.key for r in results) == sorted(f"key-{i}" for i in range(8))
    assert all(r.row for r in results)  # the lost ones ran again, on the surviving node
    assert any(isinstance(m, Log) and "died" in m.text for m in messages) and len(server.requests()) > 2 * 8


# --------------------------------------------------------------------------- the CLI


def _normalized(run_dir: Path) -> dict:
    """What must not depend on the executor: files, rows (less times and ids), statistics (less durations)."""
    rows = sorted(({"index": r["prompt_index"], "batch": r["metadata"]["batch_num"], "completed": r["completed"],
                    "turns": [t["from"] for t in r["conversations"]], "api_calls": r["api_calls"],
                    "tool_stats": r["tool_stats"], "verify": r["verify"]["status"]}
                   for r in read_jsonl(run_dir / "trajectories.jsonl")),
                  key=lambda r: r["index"])
    statistics = json.loads((run_dir / "statistics.json").read_text())
    for key in ("run_name", "duration_seconds", "duration_seconds_total", "merged_from", "latency"):  # times differ
        statistics.pop(key)
    return {"files": sorted(p.name for p in run_dir.iterdir()), "rows": rows, "statistics": statistics}


def test_cli_ray_run_matches_the_process_pool_and_resumes(cli, scripted_server):
    server = scripted_server({"default": [call("terminal", command="echo hi"), think()]})
    names = [f"prompt {i}" for i in range(12)]
    checks = ["grep -qx thinking .trajgen/final_answer.txt", "grep -q nope .trajgen/final_answer.txt"]  # pass, fail
    rows = [{"prompt": n, **({"verify": checks[i % 4 // 2]} if i % 2 else {})} for i, n in enumerate(names)]
    write_jsonl(cli.cwd / "prompts.jsonl", rows)
    tmp = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # short: Ray's socket paths live under it
    env = {"TMPDIR": str(tmp)}
    done = cli.run(*cli.args(server, run_name="p", batch_size=5, executor="processes"), env=env)
    assert done.returncode == 0, done.stderr
    done = cli.run(*cli.args(server, run_name="r", batch_size=5, executor="ray"), env=env)
    assert done.returncode == 0, done.stderr
    assert _normalized(cli.run_dir("r")) == _normalized(cli.run_dir("p"))
    assert sorted(prompts_of(read_jsonl(cli.run_dir("r") / "trajectories.jsonl"))) == sorted(names)
    verdicts = json.loads((cli.run_dir("r") / "statistics.json").read_text())["verification"]["samples"]
    assert verdicts == {"passed": 3, "failed": 3, "error": 0, "timeout": 0, "unverified": 6}
    # nothing left behind: Ray's session files, sandboxes, the home directory
    assert not list(tmp.iterdir()) and not list((cli.cwd / "home").iterdir())

    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": "new 1"}, *rows, {"prompt": "new 2"}])
    before = len(server.requests())
    done = cli.run(*cli.args(server, run_name="r", batch_size=5, executor="ray", resume=True), env=env)
    assert done.returncode == 0, done.stderr
    assert sorted({r["prompt"] for r in server.requests()[before:]}) == ["new 1", "new 2"]
    assert sorted(prompts_of(read_jsonl(cli.run_dir("r") / "trajectories.jsonl"))) == sorted(names + ["new 1", "new 2"])
    assert json.loads((cli.run_dir("r") / "statistics.json").read_text())["total_batches"] == 4
    tmp.rmdir()


def test_cli_ray_actor_killed_mid_run_loses_and_repeats_nothing(cli, scripted_server):
    delay = 0.4
    turn = {**call("terminal", command="echo hi"), "delay": delay}
    server = scripted_server({"default": [turn, turn, {**think(), "delay": delay}]})
    names = [f"prompt {i}" for i in range(30)]
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": n} for n in names])
    process = cli.start(*cli.args(server, batch_size=5, concurrency=8, executor="ray"))
    try:
        wait_for(lambda: rows_landed(cli.run_dir()) >= 5, what="5 rows")
        assert_actors_without_uvloop()  # a private instance's actors, which inherit it from the driver
        victim = wait_for(actor_pids, what="an actor")[0]
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        _, stderr = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            kill_group(process)
    assert process.returncode == 0, stderr
    assert "died" in stderr and "gone for good" not in stderr  # Ray restarted the actor
    # the lost prompts ran again on the restarted actor, replaying the replies the driver had journaled:
    # only a call in flight at the kill (answered after it, at the latest `delay` s after it arrived) was paid twice
    first: dict[tuple[str, int], float] = {}
    for r in server.requests():
        first.setdefault((r["prompt"], r["turn"]), r["t"])
    asked = Counter((r["prompt"], r["turn"]) for r in server.requests())
    assert [key for key, n in asked.items() if n > 1 and first[key] < killed_at - delay - 0.1] == []
    rows = read_jsonl(cli.run_dir() / "trajectories.jsonl")
    assert sorted(prompts_of(rows)) == sorted(names)  # each exactly once: the lost prompts ran again
    assert read_jsonl(cli.run_dir() / "failures.jsonl") == []
    statistics = json.loads((cli.run_dir() / "statistics.json").read_text())
    assert statistics["ok"] == 30 and statistics["failed"]["total"] == 0


def test_cli_ray_sigterm_mid_run_then_resume(cli, scripted_server):
    server = scripted_server({"default": SLOW})
    names = [f"prompt {i}" for i in range(30)]
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": n} for n in names])
    process = cli.start(*cli.args(server, batch_size=5, concurrency=4, executor="ray"))
    try:
        wait_for(lambda: rows_landed(cli.run_dir()) >= 4, what="4 rows")
        process.send_signal(signal.SIGTERM)  # ray.init takes SIGTERM; the executor gives it back to the runner
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            kill_group(process)
    assert process.returncode == 143, stderr
    assert not actor_pids()
    landed = {r["conversations"][1]["value"] for p in cli.run_dir().glob("batch_*.jsonl") for r in read_jsonl(p)}
    before = len(server.requests())
    done = cli.run(*cli.args(server, batch_size=5, concurrency=4, executor="ray", resume=True))
    assert done.returncode == 0, done.stderr
    assert sorted(prompts_of(read_jsonl(cli.run_dir() / "trajectories.jsonl"))) == sorted(names)
    assert not {r["prompt"] for r in server.requests()[before:]} & landed


# --------------------------------------------------------------------------- a cluster of nodes started by `ray start`


class Node:
    """A worker node joined the way an operator joins one (`ray start --address`), in its own mount and
    PID namespace: it sees `read_only` read-only, and dies whole when killed, as a lost machine does."""

    def __init__(self, address: str, cpus: int, read_only: Path, env: dict[str, str]):
        mount = f'mount --bind "{read_only}" "{read_only}" && mount -o remount,bind,ro "{read_only}" "{read_only}"'
        start = (f'exec "$0" -m ray.scripts.scripts start --block --address={address} --num-cpus={cpus} '
                 "--node-ip-address=127.0.0.1 --disable-usage-stats")
        self.process = subprocess.Popen(
            ["unshare", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c", f"{mount} && {start}",
             sys.executable], env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        said = []
        for line in self.process.stdout:  # until the node has joined (or died: the end of its output)
            said.append(line)
            if "Ray runtime started" in line:
                break
        else:
            raise AssertionError("the node did not start:\n" + "".join(said[-20:]))
        threading.Thread(target=self.process.stdout.read, daemon=True).start()  # never blocks on a full pipe

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=60)


class LocalCluster:
    """A head with no CPUs for workers, and worker nodes added and removed by the tests."""

    def __init__(self, root: Path):
        self.runs = root / "runs"  # run directories: read-only on every worker node
        self.runs.mkdir()
        self.head = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        self.address = self.head.address
        self.nodes: list[Node] = []

    def add(self, cpus: int, **env: str) -> Node:
        self.nodes.append(Node(self.address, cpus, self.runs, env))
        return self.nodes[-1]

    def remove(self, node: Node) -> None:
        node.kill()
        self.nodes.remove(node)

    def shutdown(self) -> None:
        for node in list(self.nodes):
            self.remove(node)
        self.head.shutdown()


@pytest.fixture(scope="module")
def cluster():
    temp_dir = tempfile.mkdtemp(prefix="c", dir="/tmp")  # short: Ray's socket paths live under it
    saved = {name: os.environ.get(name) for name in ("RAY_TMPDIR", "RAY_health_check_period_ms",
                                                     "RAY_health_check_failure_threshold")}
    os.environ.update(RAY_TMPDIR=temp_dir, RAY_health_check_period_ms="500", RAY_health_check_failure_threshold="3")
    test_cluster = LocalCluster(Path(temp_dir))
    try:
        test_cluster.add(cpus=2)
        yield test_cluster
    finally:
        test_cluster.shutdown()
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)
        shutil.rmtree(temp_dir, ignore_errors=True)


def without(program: str, where: Path) -> str:
    """A PATH with every program of this one but `program`."""
    where.mkdir()
    for folder in os.environ["PATH"].split(os.pathsep):
        for entry in Path(folder).glob("*") if Path(folder).is_dir() else []:
            if entry.name != program and not (where / entry.name).exists():
                (where / entry.name).symlink_to(entry)
    return str(where)


def test_cluster_image_files_come_home_to_the_driver(cli, cluster, scripted_server, fake_api):
    fal = fake_api({"/fal-ai/flux/schnell": (200, {"images": [
        {"url": "data:image/png;base64," + base64.b64encode(PNG).decode()}]})})
    server = scripted_server({"default": [call("image_generate", prompt="a cat"), think("Here is the cat.")]})
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": f"draw cat {i}"} for i in range(6)])
    fal_env = {"FAL_KEY": "fal-key", "FAL_BASE_URL": fal.url}
    env = {**fal_env, "TMPDIR": os.environ["RAY_TMPDIR"],
           **{name: os.environ[name] for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}}
    node = cluster.add(cpus=1, **fal_env)  # the base node has no FAL_KEY: it takes none of these prompts
    try:
        done = cli.run(*cli.args(server, executor="ray", ray_address=cluster.address, output_dir=cluster.runs,
                                 distribution="default", num_workers="auto"), env=env)
    finally:
        cluster.remove(node)
    assert done.returncode == 0, done.stderr
    assert "lacks image_generate (no image backend" in done.stderr
    run_dir = cluster.runs / "run"
    rows = read_jsonl(run_dir / "trajectories.jsonl")
    paths = [path for r in rows for m in r["conversations"] if m["from"] == "tool"
             for path in re.findall(r"files/image-[0-9a-f]+\.png", m["value"])]
    assert len(rows) == 6 and len(set(paths)) == 6  # the workers see the run directory read-only
    assert sorted(p.name for p in (run_dir / "files").iterdir()) == sorted(Path(p).name for p in paths)
    assert all((run_dir / p).read_bytes() == PNG for p in paths)


def test_cluster_node_without_bubblewrap_takes_no_sandboxed_prompt(cluster, scripted_server, tmp_path):
    server = scripted_server({"default": [call("terminal", command="echo hi"), think()]})
    node = cluster.add(cpus=1, PATH=without("bwrap", tmp_path / "bin"))
    pool = _pool(server, tmp_path, crash_retries=0, address=cluster.address, num_workers=3)
    try:
        pool.start()
        plain = [Task(key=f"plain-{i}", prompt_index=100 + i, batch_num=0, prompt=f"plain {i}", image=None, cwd=None,
                      extra={}, toolsets_sampled=[], toolsets_offered=[]) for i in range(6)]
        for task in [_task(i, f"prompt {i}") for i in range(12)] + plain:
            pool.submit(task)
        messages = _drain(pool, until=lambda: not pool.inflight and all(s.up for s in pool.slots))
        reports = {slot.report.node: slot.report.missing for slot in pool.slots}
        assert_actors_without_uvloop()  # a cluster's actors, which get it from their runtime environment
    finally:
        pool.close()
        cluster.remove(node)
    results = _outcomes(messages)
    assert len(results) == 18 and all(r.row for r in results)  # none failed for want of bubblewrap
    lacking = [node for node, missing in reports.items() if "sandbox" in missing]
    assert len(reports) == 2 and len(lacking) == 1 and "bwrap" in reports[lacking[0]]["sandbox"]
    said = [m.text for m in messages if isinstance(m, Log) and "sandbox (bubblewrap cannot run" in m.text]
    assert len(said) == 1 and lacking[0] in said[0]  # once for the node, not once per actor or prompt


def test_cluster_auto_pool_follows_nodes_that_join_and_leave(cluster, scripted_server, tmp_path):
    server = scripted_server({"default": [{**call("terminal", command="echo hi"), "delay": 1.5},
                                          {**think(), "delay": 1.5}]})
    pool = _pool(server, tmp_path, crash_retries=2, address=cluster.address, num_workers=None)
    try:
        pool.start()
        for i in range(60):
            pool.submit(_task(i, f"prompt {i}"))
        messages = _drain(pool, until=lambda: len(pool.slots) == 2 and all(s.up for s in pool.slots))
        base = {s.report.node for s in pool.slots}  # one actor per CPU of the one worker node
        joined = cluster.add(cpus=2)
        messages += _drain(pool, until=lambda: sum(s.up for s in pool.slots) == 4)
        newcomers = [s for s in pool.slots if s.report.node not in base]
        assert len(newcomers) == 2  # the new node's CPUs got actors
        messages += _drain(pool, until=lambda: any(slot.inflight for slot in newcomers))
        cluster.remove(joined)  # with prompts running on it
        messages += _drain(pool, until=lambda: not pool.inflight and len(pool.slots) == 2)
    finally:
        pool.close()
    results = _outcomes(messages)
    assert sorted(r.key for r in results) == sorted(f"key-{i}" for i in range(60))  # nothing lost, nothing twice
    assert all(r.row for r in results)
    assert any(isinstance(m, Log) and "grew" in m.text for m in messages)
    assert any(isinstance(m, Log) and "shrank" in m.text for m in messages)
