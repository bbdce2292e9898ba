"""A hostile model against the sandboxes, through the real CLI: each attack is stopped, its neighbour unharmed.

The model is the loopback scripted server; the sandboxes, worker processes and files are real.
To keep the suite short, one local run carries most attacks at once, side by side with healthy
prompts on the same single worker (so "unharmed" means: same worker, same time). The write race
needs a sandbox process running while a file tool works, which one prompt's tool calls (run one
after the other) cannot produce, so it drives a real sandbox directly.
"""
from __future__ import annotations

import asyncio
import os
import platform
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import CLI, call, read_jsonl, think, tool_outputs, write_jsonl
from trajgen.scripted_server import start_server
from trajgen import locks
from trajgen.sandbox import SandboxConfig
from trajgen.sandbox.config import bwrap_problem, cleanup, open_sandbox
from trajgen.sandbox.roots import new_root_dir

pytest_plugins = ["tests.dockerd"]

pytestmark = pytest.mark.skipif(bwrap_problem() is not None, reason=f"bubblewrap cannot run here: {bwrap_problem()}")

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="per-prompt uids, cgroups and sized work dirs need root")
SYSCALLS = {"x86_64": (248, 250), "aarch64": (217, 219)}  # add_key, keyctl
MEMORY_MB, DISK_MB = 300, 256
BIG_FILE_MB = 200
QUESTION = "what is in this image?"


def _keyring_probe(write: bool) -> str:
    """Python that adds a key to the user keyring (or searches it), printing the result and errno."""
    add_key, keyctl = SYSCALLS[platform.machine()]
    call_text = (f"l.syscall({add_key}, b'user', b'trajgen-shared', b'SECRET-42', 10, -4)" if write
                 else f"l.syscall({keyctl}, 10, -4, b'user', b'trajgen-shared', 0)")  # KEYCTL_SEARCH in @u
    return (f"python3 -c \"import ctypes; l = ctypes.CDLL(None, use_errno=True); r = {call_text}; "
            f"print('KEY', r, ctypes.get_errno())\"")


def _rows(cli: CLI, run_name: str) -> dict[str, dict]:
    return {r["conversations"][1]["value"]: r for r in read_jsonl(cli.run_dir(run_name) / "trajectories.jsonl")}


def _peak_child_memory(process: subprocess.Popen) -> int:
    """Run until `process` ends, returning the highest peak RSS (VmHWM, bytes) of its direct children: the workers."""
    peak = 0
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    while process.poll() is None:
        try:
            pids = children.read_text().split()
        except OSError:
            pids = []
        for pid in pids:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]) * 1024)
        time.sleep(0.05)
    return peak


LOCAL_SCRIPT = {"prompts": {
    "keyring writer": [call("terminal", command=_keyring_probe(True)), think()],
    "keyring reader": [call("terminal", command="sleep 1; " + _keyring_probe(False)), think()],
    "fork bomb": [call("terminal", command=":(){ :|:& };: ; sleep 30", timeout=6), think()],
    "healthy": [call("terminal", command="sleep 2; for i in $(seq 40); do sleep 0.2 & done; wait; echo healthy-$((6*7))"),
                think()],
    "memory fill": [call("terminal", command="for i in 1 2 3 4; do python3 -c 'x = b\"m\" * (100 << 20); "
                                             "import time; time.sleep(4)' & done; wait; echo done"), think()],
    "disk fill": [call("terminal", command=f"head -c {DISK_MB + 50}M /dev/zero > /tmp/fill; echo tmp=$?"),
                  call("terminal", command=f"head -c {DISK_MB + 50}M /dev/zero > fill; echo work=$?"),
                  call("write_file", path="after.txt", content="x" * (1 << 20)),
                  think()],
    "big file": [call("terminal", command=f"head -c {BIG_FILE_MB}M /dev/zero | tr '\\0' '\\n' > big.txt; echo made"),
                 call("read_file", path="big.txt", offset=BIG_FILE_MB * 1024 * 1024 - 2),
                 call("patch", path="big.txt", old_string="\n\n", new_string="x"),
                 call("vision_analyze", image_url="big.txt", question=QUESTION),
                 think()],
    "private vision": [call("vision_analyze", image_url="http://169.254.169.254/latest/meta-data/", question=QUESTION),
                       call("vision_analyze", image_url="http://127.0.0.1:9/cat.png", question=QUESTION),
                       think()],
}, "default": [think()]}


@pytest.fixture(scope="module")
def local_attacks(tmp_path_factory):
    """One run of every local attack beside healthy prompts on a single worker, then a second run reading the keyring."""
    server = start_server(LOCAL_SCRIPT)
    cli = CLI(tmp_path_factory.mktemp("attacks"))
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": p} for p in LOCAL_SCRIPT["prompts"]])
    flags = dict(distribution="default", num_workers=1, sandbox_memory=MEMORY_MB, sandbox_disk=DISK_MB)
    process = cli.start(*cli.args(server, **flags))
    peak = _peak_child_memory(process)
    first = process.communicate()
    write_jsonl(cli.cwd / "again.jsonl", [{"prompt": "keyring reader"}])
    second = cli.run(*cli.args(server, run_name="later", dataset_file="again.jsonl"))
    yield cli, server, peak, first, second
    server.stop()


@ROOT_ONLY
def test_prompts_cannot_pass_data_through_the_kernel_keyring(local_attacks):
    cli, _, _, first, second = local_attacks
    assert second.returncode == 0, second.stderr
    for rows in (_rows(cli, "run"), _rows(cli, "later")):
        for name in ("keyring writer", "keyring reader"):
            if name in rows:
                output = tool_outputs(rows[name])[0]["output"]
                assert output == "KEY -1 1\n", output  # EPERM: the seccomp filter refuses the keyring
    assert "SECRET" not in (cli.run_dir("later") / "trajectories.jsonl").read_text()


@ROOT_ONLY
def test_a_fork_bomb_is_contained_and_its_neighbour_runs(local_attacks):
    cli, *_ = local_attacks
    rows = _rows(cli, "run")
    healthy = tool_outputs(rows["healthy"])[0]
    assert healthy["exit_code"] == 0 and healthy["output"] == "healthy-42\n", healthy
    bomb = tool_outputs(rows["fork bomb"])[0]
    assert bomb["success"] is False and "timed out after 6 s" in bomb["error"]


@ROOT_ONLY
def test_memory_tmp_and_disk_fills_hit_the_sandbox_limits(local_attacks):
    cli, *_ = local_attacks
    rows = _rows(cli, "run")
    memory = tool_outputs(rows["memory fill"])[0]
    assert memory["success"] is False and "hit its memory limit" in memory["error"], memory
    tmp, work, after = tool_outputs(rows["disk fill"])
    for fill, name in ((tmp, "tmp"), (work, "work")):
        assert fill["exit_code"] == 0 and fill["output"].endswith(f"No space left on device\n{name}=1\n"), fill
    assert after["success"] is False and "No space left on device" in after["error"]


@ROOT_ONLY
def test_a_large_file_does_not_fill_the_worker(local_attacks):
    cli, _, peak, *_ = local_attacks
    made, read, patched, seen = tool_outputs(_rows(cli, "run")["big file"])
    assert made["output"] == "made\n"
    assert read["success"] is True and read["total_lines"] == BIG_FILE_MB << 20
    lines = BIG_FILE_MB << 20
    assert read["content"] == f"{lines - 2:6d}|\n{lines - 1:6d}|\n{lines:6d}|\n"
    assert patched["success"] is False and "too large" in patched["error"]
    assert seen["success"] is False and "too large" in seen["error"]
    assert 0 < peak < (BIG_FILE_MB << 20) * 3 // 4, f"a worker peaked at {peak >> 20} MB"


def test_vision_refuses_private_urls_and_sends_nothing(local_attacks):
    cli, server, *_ = local_attacks
    metadata, loopback = tool_outputs(_rows(cli, "run")["private vision"])
    for result in (metadata, loopback):
        assert result["success"] is False and result["error"].startswith("refused: ")
    assert not [r for r in server.requests() if r["prompt"] == QUESTION]


def test_every_prompt_of_the_attack_run_finished(local_attacks):
    cli, _, _, first, _ = local_attacks
    assert set(_rows(cli, "run")) == set(LOCAL_SCRIPT["prompts"]), first[1]
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    work_dirs = [m for m in mounts if "/trajgen-sandboxes-" in m]  # each a sized work dir of a live sandbox
    assert not [m for m in work_dirs if not locks.is_held(Path(str(Path(m).parent) + ".lock"))]


# --- web_extract: a page that would hold the converter for minutes ---


class _Site:
    """A loopback site: /slow is one table row of 2 MB (trafilatura is quadratic on it), /fine a normal page."""

    def __init__(self) -> None:
        row = "<table><tr>" + "<td>cell</td>" * 150_000 + "</tr></table>"
        pages = {"/slow": f"<html><body>{row}</body></html>",
                 "/fine": "<html><head><title>Fine</title></head><body><h1>Fine page</h1><p>All good here.</p></body></html>"}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = pages[self.path].encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_slow_page_fails_on_time_and_its_neighbour_reads_its_page(cli, scripted_server):
    site = _Site()
    try:
        server = scripted_server({"prompts": {
            "slow": [call("web_extract", urls=[site.url + "/slow"]), think()],
            "fine": [call("web_extract", urls=[site.url + "/fine"]), think()],
        }})
        write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": "slow"}, {"prompt": "fine"}])
        done = cli.run(*cli.args(server, distribution="minimal", num_workers=1, allow_private_urls=True))
    finally:
        site.server.shutdown()
    assert done.returncode == 0, done.stderr
    rows = _rows(cli, "run")
    slow, fine = tool_outputs(rows["slow"])[0], tool_outputs(rows["fine"])[0]
    assert slow["success"] is False and "took longer than 10 s" in slow["error"]
    assert fine["success"] is True and "All good here." in fine["results"][0]["content"]


# --- docker: what one terminal call leaves behind, and what a command may do ---


def test_docker_calls_leave_nothing_running_and_run_without_privileges(cli, scripted_server, docker_engine,
                                                                       busybox_image):
    server = scripted_server({"prompts": {
        "leave a process": [call("terminal", command="sleep 4242 & setsid sleep 4343 & (sleep 4444 &) ; "
                                                     "echo started"),
                            call("terminal", command="ps -o args | grep -c '[s]leep 4'; id -u; grep Cap /proc/self/status; "
                                                     "chown 0 . 2>/dev/null; echo chown=$?; touch /etc/x 2>/dev/null; echo etc=$?"),
                            think()],
        "neighbour": [call("terminal", command="echo fine > f && cat f"), think()],
    }})
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": "leave a process", "image": busybox_image},
                                            {"prompt": "neighbour", "image": busybox_image}])
    done = cli.run(*cli.args(server, terminal_backend="docker"), env={"DOCKER_HOST": docker_engine})
    assert done.returncode == 0, done.stderr
    rows = _rows(cli, "run")
    started, probe = tool_outputs(rows["leave a process"])
    assert started["output"] == "started\n"
    lines = probe["output"].splitlines()  # stdout only: its order against stderr is not kept across docker exec
    assert lines[:2] == ["0", "65534"], probe  # no sleep survived its call; commands run as uid 65534
    caps = dict(line.split(":\t") for line in lines if line.startswith("Cap"))
    assert caps["CapEff"] == caps["CapPrm"] == "0000000000000000"
    assert int(caps["CapBnd"], 16) & (1 << 21) == 0  # CAP_SYS_ADMIN is not even in the bounding set
    assert "chown=1" in lines and "etc=1" in lines
    assert tool_outputs(rows["neighbour"])[0]["output"] == "fine\n"


# --- the write race: a link swapped in while write_file works ---


@ROOT_ONLY
def test_write_file_never_follows_a_link_swapped_in_by_the_sandbox(tmp_path):
    """A sandbox process flips `d` between a directory and a link to a host directory while the
    host writes d/x again and again: the host directory must stay untouched, and unowned."""
    victim = tmp_path / "victim"
    victim.mkdir()
    config = SandboxConfig(root_dir=new_root_dir(), command_timeout=60)
    flipper = f"""import os, shutil, time
end = time.time() + 3
while time.time() < end:
    shutil.rmtree("d", ignore_errors=True)
    try:
        os.symlink({str(victim)!r}, "d")
        os.unlink("d")
    except OSError:
        pass
    try:
        os.mkdir("d")
    except OSError:
        pass
print("flipped")
"""
    try:
        sandbox = open_sandbox(config, "race")

        async def race():
            await sandbox.write_file("flip.py", flipper.encode())
            flipping = asyncio.create_task(sandbox.run("python3 flip.py", 60))
            refused = written = 0
            while not flipping.done():
                try:
                    await sandbox.write_file("d/x", b"from the model")
                    written += 1
                except Exception:
                    refused += 1
            await sandbox.close()
            return await flipping, written, refused

        result, written, refused = asyncio.run(race())
    finally:
        cleanup(config)
    assert result.output.endswith("flipped\n")
    assert written + refused > 100
    assert list(victim.iterdir()) == [] and victim.stat().st_uid == 0
