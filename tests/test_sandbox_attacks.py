"""A hostile model against the sandboxes, through the CLI: each attack is stopped, its neighbour unharmed.

The model is the loopback scripted server; the sandboxes, worker processes and files are real.
To keep the suite short, one local run carries most attacks at once, side by side with healthy
prompts on the same single worker (so "unharmed" means: same worker, same time). The write race
needs a sandbox process running while a file tool works, which one prompt's tool calls (run one
after the other) cannot produce, so it drives a real sandbox directly.
"""
from __future__ import annotations

import ast
import asyncio
import errno
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import CLI, call, kill_group, mount_points, read_jsonl, think, tool_outputs, write_jsonl
from tests.test_browser_tools import LAUNCH_PROBLEM, LOOPBACK_ONLY
from tests.test_web_tools import local_site  # noqa: F401  (fixture)
from tests.support.inline import Runs
from tests.support.scripted_server import start_server
from trajgen import locks
from trajgen.sandbox import SandboxConfig, shares
from trajgen.sandbox.backends import bwrap_problem, cleanup, open_sandbox
from trajgen.sandbox.roots import ROOT_BASE, ROOT_PREFIX, UID_BASE, UID_COUNT, new_root_dir

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


def _rows(runs: Runs, run_name: str) -> dict[str, dict]:
    return {r["conversations"][1]["value"]: r for r in read_jsonl(runs.run_dir(run_name) / "trajectories.jsonl")}


def _run_roots(cli: int) -> tuple[str, ...]:
    """The sandbox roots of the runner `cli` (each ending in /): each root's lock file holds its runner's pid."""
    roots = []
    for lock in Path(ROOT_BASE).glob(f"{ROOT_PREFIX}*.lock"):
        try:
            if lock.read_text() == f"{cli}\n":
                roots.append(str(lock)[:-len(".lock")] + "/")
        except OSError:  # a root removed meanwhile
            pass
    return tuple(roots)


def _children(pid: int | str) -> list[str]:
    try:
        return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []


def _watch_workers(process: subprocess.Popen) -> tuple[int, set[str], set[str]]:
    """Run until `process` ends: the highest peak RSS (VmHWM, bytes) of its children and theirs (the
    fork server and the workers it forks), the sandbox mounts seen in their mount tables, and those
    of them in the host's."""
    peak, in_workers, in_host = 0, set(), set()
    while process.poll() is None:
        roots = _run_roots(process.pid)  # other tests' sandboxes, in this process or beside it, are not the run's
        for pid in [p for child in _children(process.pid) for p in (child, *_children(child))]:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]) * 1024)
            mounts = mount_points(pid, roots)
            in_workers |= mounts
            in_host |= mounts & mount_points("self", roots)
        time.sleep(0.05)
    return peak, in_workers, in_host


FD_FILLER = """import os, resource, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
r, w = os.pipe()
for _ in range(8):
    if os.fork() == 0:
        n = 0
        try:
            while n < 5000:
                os.open("/dev/null", os.O_RDONLY)
                n += 1
        except OSError:
            pass
        os.write(w, b"%d\\n" % n)
        time.sleep(4)
        os._exit(0)
lines = os.fdopen(r)
held = [int(lines.readline()) for _ in range(8)]
print("held", max(held), sum(held))
"""
PTY_FILLER = """import os, time
r, w = os.pipe()
for _ in range(6):
    if os.fork() == 0:
        n = 0
        try:
            while n < 250:
                os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY)
                n += 1
        except OSError:
            pass
        os.write(w, b"%d\\n" % n)
        time.sleep(4)
        os._exit(0)
lines = os.fdopen(r)
print("ptys", sum(int(lines.readline()) for _ in range(6)))
"""
# syscall numbers: io_setup, io_uring_setup, personality, modify_ldt (x86 only)
KERNEL_CALLS = {"x86_64": (206, 425, 135, 154), "aarch64": (0, 425, 92, None)}
KERNEL_PROBE = """import ctypes, socket
io_setup, io_uring_setup, personality, modify_ldt = %r
libc = ctypes.CDLL(None, use_errno=True)
def call(number, *args):
    ctypes.set_errno(0)
    return libc.syscall(number, *args) >= 0 or ctypes.get_errno()
ctx, params = ctypes.c_ulong(0), ctypes.create_string_buffer(120)
found = {"io_setup": call(io_setup, 16, ctypes.byref(ctx)), "io_uring": call(io_uring_setup, 8, params),
         "personality_query": call(personality, 0xFFFFFFFF), "personality_set": call(personality, 0x0040000)}
if modify_ldt is not None:
    found["modify_ldt"] = call(modify_ldt, 0, ctypes.create_string_buffer(16), 16)
for name, family in (("vsock", socket.AF_VSOCK), ("inet", socket.AF_INET), ("netlink", socket.AF_NETLINK),
                     ("unix", socket.AF_UNIX)):
    try:
        socket.socket(family, socket.SOCK_DGRAM if family == socket.AF_NETLINK else socket.SOCK_STREAM).close()
        found[name] = True
    except OSError as e:
        found[name] = e.errno
print(repr(found))
"""
# reads the command loop's memory for the marker that ends a command's output, prints it with a
# made-up exit status, and goes on running
FORGER = """import os, re, sys, time
try:
    maps = open("/proc/2/maps").read().splitlines()
    mem = os.open("/proc/2/mem", os.O_RDONLY)
except OSError as e:
    print("refused", e.errno)
    sys.exit(3)
found = set()
for line in maps:
    span, perms = line.split()[:2]
    if perms.startswith("rw"):
        start, end = (int(x, 16) for x in span.split("-"))
        try:
            found.update(re.findall(rb"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])", os.pread(mem, end - start, start)))
        except OSError:
            pass
for marker in found:
    sys.stdout.buffer.write(marker + b" 0\\n")
sys.stdout.flush()
time.sleep(2)
open("late.txt", "w").write("after the end")
sys.exit(3)
"""
# The same attack in an image with only bash and busybox, given the loop's pid (the command's parent)
SHELL_FORGER = """ls /proc/$loop/fd >/dev/null 2>&1 && echo fds-open
maps=$(cat /proc/$loop/maps 2>/dev/null) || { echo refused; exit 3; }
while read -r span perms _; do
    case $perms in rw*) dd if=/proc/$loop/mem bs=4096 skip=$((16#${span%-*} / 4096)) \\
                           count=$(((16#${span#*-} - 16#${span%-*}) / 4096)) 2>/dev/null ;; esac
done <<< "$maps" | grep -aoE '[0-9a-f]{32}' | sort -u | sed 's/$/ 0/'
sleep 2
exit 3
"""
PLANT_USERCUSTOMIZE = ('d=$(python3 -m site --user-site) && mkdir -p "$d" && '
                       "echo 'import os; os._exit(0)' > \"$d/usercustomize.py\" && echo planted")
FAILING_CHECK = "python3 -c 'import sys; sys.exit(1)'"
CONCURRENCY = 8  # the CLI's in these tests: each sandbox's share of the machine's tables follows from it

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
    "file table filler": [call("write_file", path="fill.py", content=FD_FILLER), call("terminal", command="python3 fill.py"),
                          think()],
    "file table victim": [call("terminal", command="sleep 1; cat /etc/hostname > /dev/null && echo victim-ran"), think()],
    "pty filler": [call("write_file", path="fill.py", content=PTY_FILLER), call("terminal", command="python3 fill.py"),
                   think()],
    "pty victim": [call("terminal", command="sleep 1; script -qc 'echo pty-ran' /dev/null"), think()],
    "kernel calls": [call("write_file", path="probe.py", content=KERNEL_PROBE % (KERNEL_CALLS.get(platform.machine()),)),
                     call("terminal", command="python3 probe.py"), think()],
    "forged end": [call("write_file", path="forge.py", content=FORGER), call("terminal", command="python3 forge.py"),
                   think()],
    "check hijack": [call("terminal", command=PLANT_USERCUSTOMIZE), think()],
    "private vision": [call("vision_analyze", image_url="http://169.254.169.254/latest/meta-data/", question=QUESTION),
                       call("vision_analyze", image_url="http://127.0.0.1:9/cat.png", question=QUESTION),
                       think()],
}, "default": [think()]}


@pytest.fixture(scope="module")
def planted_symlink(tmp_path_factory):
    """What a local user (uid 4242) plants where runners used to keep sandbox roots (TMPDIR): a root
    that is a symlink to a directory with a mount point in it, and its lock, unheld. Yields
    (that TMPDIR, the mount point) and unmounts it afterwards."""
    tmpdir, victim = Path(tempfile.mkdtemp(prefix="trajgen-shared-tmp-")), tmp_path_factory.mktemp("victim")
    tmpdir.chmod(0o1777)  # reachable by that user, as /tmp is
    (victim / "mnt").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "trajgen-victim", str(victim / "mnt")], check=True)
    plant = f"ln -s {victim} {tmpdir}/trajgen-sandboxes-evil && touch {tmpdir}/trajgen-sandboxes-evil.lock"
    subprocess.run(["setpriv", "--reuid=4242", "--regid=4242", "--clear-groups", "sh", "-c", plant], check=True)
    yield tmpdir, victim / "mnt"
    subprocess.run(["umount", str(victim / "mnt")], capture_output=True)
    shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.fixture(scope="module")
def local_attacks(tmp_path_factory, planted_symlink):
    """One run of every local attack beside healthy prompts on a single worker, then a second run reading the keyring."""
    server = start_server(LOCAL_SCRIPT)
    cli = CLI(tmp_path_factory.mktemp("attacks"))
    cli.env["TMPDIR"] = str(planted_symlink[0])
    rows = [{"prompt": p} for p in LOCAL_SCRIPT["prompts"]]
    rows[list(LOCAL_SCRIPT["prompts"]).index("check hijack")]["verify"] = FAILING_CHECK
    write_jsonl(cli.cwd / "prompts.jsonl", rows)
    flags = dict(distribution="default", num_workers=1, sandbox_memory=MEMORY_MB, sandbox_disk=DISK_MB,
                 concurrency=CONCURRENCY)
    process = cli.start(*cli.args(server, **flags))
    peak, mounts, leaked = _watch_workers(process)
    first = process.communicate()
    write_jsonl(cli.cwd / "again.jsonl", [{"prompt": "keyring reader"}])
    second = cli.run(*cli.args(server, run_name="later", dataset_file="again.jsonl"))
    yield cli, server, (peak, mounts, leaked), first, second
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
    cli, _, (peak, _, _), *_ = local_attacks
    made, read, patched, seen = tool_outputs(_rows(cli, "run")["big file"])
    assert made["output"] == "made\n"
    assert read["success"] is True and read["total_lines"] == BIG_FILE_MB << 20
    lines = BIG_FILE_MB << 20
    assert read["content"] == f"{lines - 2:6d}|\n{lines - 1:6d}|\n{lines:6d}|\n"
    assert patched["success"] is False and "too large" in patched["error"]
    assert seen["success"] is False and "too large" in seen["error"]
    assert 0 < peak < (BIG_FILE_MB << 20) * 3 // 4, f"a worker peaked at {peak >> 20} MB"


@ROOT_ONLY
def test_the_sandboxes_mounts_stay_in_their_workers_mount_table(local_attacks):
    _, _, (_, mounts, leaked), *_ = local_attacks
    assert any(m.endswith(".pts") for m in mounts) and any(not m.endswith(".pts") for m in mounts), mounts
    assert leaked == set()  # so no other process's sandbox reads them (bubblewrap parses the table at each bind)


@ROOT_ONLY
def test_the_sweep_follows_no_symlink_planted_by_another_user(local_attacks, planted_symlink):
    _, mount = planted_symlink
    assert os.path.ismount(mount)  # the runner swept stale roots, and left the planted one's target alone


@ROOT_ONLY
def test_a_file_table_filler_holds_only_its_share_and_its_neighbour_runs(local_attacks):
    cli, *_ = local_attacks
    rows = _rows(cli, "run")
    _, filled = tool_outputs(rows["file table filler"])
    per_process, total = map(int, filled["output"].split()[1:])
    share = shares.open_files(CONCURRENCY, SandboxConfig().max_processes)
    assert per_process < share and total < 8 * share, filled
    assert share * SandboxConfig().max_processes * 2 * CONCURRENCY <= int(Path("/proc/sys/fs/file-max").read_text())
    assert tool_outputs(rows["file table victim"])[0]["output"] == "victim-ran\n"


@ROOT_ONLY
def test_a_pty_filler_holds_only_its_share_and_its_neighbour_gets_a_pty(local_attacks):
    cli, *_ = local_attacks
    rows = _rows(cli, "run")
    _, filled = tool_outputs(rows["pty filler"])
    assert filled["output"] == f"ptys {shares.ptys(CONCURRENCY)}\n", filled
    victim = tool_outputs(rows["pty victim"])[0]
    assert victim["exit_code"] == 0 and "pty-ran" in victim["output"], victim


@pytest.mark.skipif(platform.machine() not in KERNEL_CALLS, reason="syscall numbers known for x86_64 and aarch64")
def test_aio_io_uring_ldt_personality_and_every_socket_family_but_unix_are_denied(local_attacks):
    cli, *_ = local_attacks
    _, probe = tool_outputs(_rows(cli, "run")["kernel calls"])
    found = ast.literal_eval(probe["output"])
    expected = {"io_setup": errno.EPERM, "io_uring": errno.EPERM, "personality_query": True,
                "personality_set": errno.EPERM, "vsock": errno.EAFNOSUPPORT, "inet": errno.EAFNOSUPPORT,
                "netlink": errno.EAFNOSUPPORT, "unix": True}
    if platform.machine() == "x86_64":
        expected["modify_ldt"] = errno.EPERM
    assert found == expected


@ROOT_ONLY
def test_a_command_cannot_forge_the_end_of_its_output(local_attacks):
    cli, *_ = local_attacks
    _, forged = tool_outputs(_rows(cli, "run")["forged end"])
    assert forged["exit_code"] == 3 and forged["output"] == f"refused {errno.EACCES}\n", forged


def test_the_model_cannot_make_its_check_pass(local_attacks):
    cli, *_ = local_attacks
    row = _rows(cli, "run")["check hijack"]
    assert tool_outputs(row)[0]["output"] == "planted\n"
    assert (row["verify"]["status"], row["verify"]["exit_code"]) == ("failed", 1), row["verify"]


def test_batch_and_side_files_are_private_to_the_runner(local_attacks):
    cli, *_ = local_attacks
    files = [p for p in cli.run_dir("run").iterdir() if p.suffix == ".jsonl"]
    assert any(p.name.startswith("batch_") for p in files)
    assert {p.name: oct(p.stat().st_mode & 0o077) for p in files} == {p.name: "0o0" for p in files}


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
    # each a sized work dir of a live sandbox, or a worker's / and the mounts in it (a worker with no table of its own)
    roots = {m: root[1] for m in mounts if (root := re.match(r"(.*/trajgen-sandboxes-[^/]+)/", m))}
    assert not [m for m, root in roots.items() if not locks.is_held(Path(root + ".lock"))]


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


def test_a_slow_page_fails_on_time_and_its_neighbour_reads_its_page(inline, scripted_server):
    site = _Site()
    try:
        server = scripted_server({"prompts": {
            "slow": [call("web_extract", urls=[site.url + "/slow"]), think()],
            "fine": [call("web_extract", urls=[site.url + "/fine"]), think()],
        }})
        write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "slow"}, {"prompt": "fine"}])
        done = inline.run(*inline.args(server, distribution="minimal", num_workers=1, allow_private_urls=True))
    finally:
        site.server.shutdown()
    assert done.returncode == 0, done.stderr
    rows = _rows(inline, "run")
    slow, fine = tool_outputs(rows["slow"])[0], tool_outputs(rows["fine"])[0]
    assert slow["success"] is False and "took longer than 10 s" in slow["error"]
    assert fine["success"] is True and "All good here." in fine["results"][0]["content"]


# --- docker: what one terminal call leaves behind, and what a command may do ---


def test_docker_calls_leave_nothing_running_and_run_without_privileges_as_a_uid_per_prompt(
        inline, scripted_server, docker_engine, busybox_image, bash_image):
    server = scripted_server({"prompts": {
        "leave a process": [call("terminal", command="sleep 4242 & setsid sleep 4343 & (sleep 4444 &) ; "
                                                     "echo started"),
                            call("terminal", command="ps -o args | grep -c '[s]leep 4'; id -u; grep Cap /proc/self/status; "
                                                     "chown 0 . 2>/dev/null; echo chown=$?; touch /etc/x 2>/dev/null; echo etc=$?; "
                                                     "echo files=$(ulimit -n); nc 127.0.0.1 9 </dev/null 2>&1; "
                                                     "for i in $(seq 250); do sleep 3 3<>/dev/ptmx 2>/dev/null & done; "
                                                     "sleep 1; echo ptys=$(($(ls /dev/pts | wc -l) - 1))"),
                            think()],
        "neighbour": [call("terminal", command="echo fine > f && cat f && id -u"), think()],
        "forged end": [call("write_file", path="forge.sh", content=SHELL_FORGER), call("terminal", command="loop=$PPID bash forge.sh"),
                       think()],
    }})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "leave a process", "image": busybox_image},
                                               {"prompt": "neighbour", "image": busybox_image},
                                               {"prompt": "forged end", "image": bash_image}])
    done = inline.run(*inline.args(server, terminal_backend="docker"), env={"DOCKER_HOST": docker_engine})
    assert done.returncode == 0, done.stderr
    rows = _rows(inline, "run")
    started, probe = tool_outputs(rows["leave a process"])
    assert started["output"] == "started\n"
    lines = probe["output"].splitlines()  # stdout only: its order against stderr is not kept across docker exec
    uid = int(lines[1])
    assert lines[0] == "0" and UID_BASE <= uid < UID_BASE + UID_COUNT, probe  # no sleep survived its call
    caps = dict(line.split(":\t") for line in lines if line.startswith("Cap"))
    assert caps["CapEff"] == caps["CapPrm"] == "0000000000000000"
    assert int(caps["CapBnd"], 16) & (1 << 21) == 0  # CAP_SYS_ADMIN is not even in the bounding set
    assert "chown=1" in lines and "etc=1" in lines
    assert f"files={shares.open_files(CONCURRENCY, SandboxConfig().max_processes)}" in lines
    assert "Address family not supported by protocol" in probe["output"]  # the seccomp filter: AF_UNIX only
    assert f"ptys={shares.ptys(CONCURRENCY)}" in lines  # of 250 asked for, with a devpts instance of its own
    fine, neighbour_uid = tool_outputs(rows["neighbour"])[0]["output"].splitlines()
    assert fine == "fine" and UID_BASE <= int(neighbour_uid) < UID_BASE + UID_COUNT and int(neighbour_uid) != uid
    _, forged = tool_outputs(rows["forged end"])  # the loop's memory and fds are out of reach: its answer is the real one
    assert forged["exit_code"] == 3 and forged["output"] == "refused\n", forged


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


# --- the browser: its uid must not reach root, nor the runner's secrets ---

CANARY = "sk-or-canary-4242"  # the runner's API key, for this test


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (the CLI's own tree: its workers, their drivers, their browsers)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            children = [int(c) for c in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()]
        except OSError:
            continue
        found += children
        todo += children
    return found


def _chromium(pid: int) -> dict[int, tuple[int, bytes]]:
    """The run's Chromium processes: pid -> (uid, environment)."""
    found = {}
    for child in _descendants(pid):
        try:
            if b"chrom" in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0]:
                found[child] = (Path(f"/proc/{child}").stat().st_uid, Path(f"/proc/{child}/environ").read_bytes())
        except OSError:
            continue
    return found


@ROOT_ONLY
@pytest.mark.skipif(LAUNCH_PROBLEM is not None, reason=f"the browser needs chromium: {LAUNCH_PROBLEM}")
def test_the_browser_uid_cannot_swap_its_launcher_nor_read_the_runners_key(cli, scripted_server, local_site, tmp_path):
    """Acting as Chromium's uid mid-run: replace every launcher root runs, kill the browser; the next
    navigation starts it again, and nothing of the uid's may have run as root. No Chromium process
    has the runner's key in its environment."""
    site = local_site.url
    server = scripted_server({"prompts": {"browse": [
        call("browser_navigate", url=site + "/"), {**call("browser_navigate", url=site + "/form"), "delay": 8},
        think()]}})
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": "browse"}])
    cli.env.update(OPENROUTER_API_KEY=CANARY, TRAJGEN_CHROMIUM_ARGS=LOOPBACK_ONLY)
    process = cli.start(*cli.args(server, distribution="browser_only", allow_private_urls=True, api_key=None))
    try:
        deadline = time.monotonic() + 60  # the first page is open once the model is asked again (8 s to answer)
        while len(server.requests()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        browsers = _chromium(process.pid)
        assert browsers, "no Chromium started"
        uid = min(uid for uid, _ in browsers.values())
        home = next((e.split(b"=", 1)[1].decode() for _, env in browsers.values() for e in env.split(b"\0")
                     if e.startswith(b"HOME=")), "/nonexistent")
        swapped = tmp_path / "swapped"
        swapped.mkdir(mode=0o777)
        swapped.chmod(0o777)
        evil = f"#!/bin/sh\nid -u > {swapped}/ran-as\n"
        launchers = [f"{home}/chromium-as-user", *map(str, Path("/run/trajgen").glob("*/chromium"))]  # before, after
        attack = " ".join(f"([ -f {q} ] && rm -f {q} && printf %s {shlex.quote(evil)} > {q} && chmod 755 {q} && echo swapped);"
                          for q in map(shlex.quote, launchers))
        as_uid = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sh", "-c"]
        swaps = subprocess.run([*as_uid, attack + " kill -9 -1"], capture_output=True, text=True)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            kill_group(process)
    assert uid != 0 and all(CANARY.encode() not in env for _, env in browsers.values())
    assert "swapped" not in swaps.stdout, swaps.stdout
    assert not (swapped / "ran-as").exists()
    first, second = tool_outputs(_rows(cli, "run")["browse"])
    assert first["success"] is True and second["success"] is True and second["url"] == site + "/form", (second, err)
