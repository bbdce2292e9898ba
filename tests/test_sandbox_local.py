"""The bubblewrap sandbox, tested for what a user would notice if it leaked."""
from __future__ import annotations

import asyncio
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from trajgen.sandbox import SandboxError, cgroups, read_file, roots, shares, supervisor
from trajgen.sandbox.backends import SandboxConfig, bwrap_problem, cleanup, open_sandbox, prepare_host
from trajgen.sandbox.binds import SystemView, parents_to_pass, system_view
from trajgen.sandbox.local import LocalSandbox, bwrap_system_binds
from trajgen.sandbox.process import OUTPUT_CAP, kill_pids
from trajgen.sandbox.roots import sweep_stale_roots
from tests.conftest import arun, call, read_jsonl, think, tool_outputs, write_jsonl
from tests.support.inline import stopped_if_it_hangs, when

pytestmark = pytest.mark.skipif(bwrap_problem() is not None, reason=f"bubblewrap cannot run here: {bwrap_problem()}")

@pytest.fixture
def config(tmp_path: Path):
    config = SandboxConfig(root_dir=str(tmp_path / "sandboxes"), command_timeout=30)
    yield config
    cleanup(config)


def run(sandbox, command: str, timeout: float = 30):
    return arun(sandbox.run(command, timeout))


def survivors(marker: str) -> str:
    """Live processes whose command line contains marker (zombies have none, so they do not count)."""
    return subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout.strip()


def test_command_runs_as_its_own_uid_in_workspace_with_a_clean_env(config, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    sandbox = open_sandbox(config, "p1", None, None)
    result = run(sandbox, "id -u; pwd; env; cat /etc/shadow")
    assert result.error is None
    uid, cwd = result.output.splitlines()[:2]
    assert (int(uid), cwd) == (sandbox.uid, "/workspace")
    assert sandbox.uid != 0 and sandbox.uid != open_sandbox(config, "p2", None, None).uid
    assert "sk-secret" not in result.output and "OPENAI_API_KEY" not in result.output
    assert "HOME=/workspace" in result.output
    assert "Permission denied" in result.output or "No such file" in result.output
    assert result.exit_code != 0


def test_state_persists_in_files_between_commands(config):
    sandbox = open_sandbox(config, "p1", None, None)
    assert run(sandbox, "mkdir sub && cd sub && echo kept > note.txt").exit_code == 0
    result = run(sandbox, "pwd; cat sub/note.txt")
    assert result.output == "/workspace\nkept\n"


def test_command_cannot_write_outside_its_work_dir(config):
    sandbox = open_sandbox(config, "p1", None, None)
    marker = f"trajgen-escape-{uuid.uuid4().hex}"
    result = run(sandbox, f"touch /tmp/{marker} && echo tmp-ok; touch /usr/{marker} /etc/{marker} {config.root_dir}/{marker}")
    assert "tmp-ok" in result.output  # the sandbox's /tmp is its own tmpfs
    assert result.exit_code != 0
    for place in ("/tmp", "/usr", "/etc", config.root_dir):
        assert not os.path.exists(f"{place}/{marker}")


DEV_LISTING = "stat -c '%n %F %a %u %g %t:%T %N' /dev/* /dev/pts/* /dev/shm; ls -A /dev/shm"


def test_the_sandbox_dev_is_bubblewraps_own_made_once_and_read_only(config):
    """As root a worker makes one /dev for all its sandboxes (fewer mounts for bubblewrap to make and
    read): it must show what bubblewrap's --dev does, nothing more, and no sandbox may change it."""
    bwraps = subprocess.run(["bwrap", *bwrap_system_binds(), "--dev", "/dev", "--proc", "/proc", "--unshare-pid",
                             "--", "bash", "-c", DEV_LISTING], capture_output=True, text=True, check=True).stdout
    first, second = open_sandbox(config, "p1", None, None), open_sandbox(config, "p2", None, None)
    assert run(first, DEV_LISTING).output == bwraps
    result = run(second, "touch /dev/x /dev/shm/x; echo touch=$?; echo x > /dev/null && head -c 3 /dev/zero | wc -c")
    assert result.output.splitlines()[-2:] == ["touch=1", "3"], result
    assert not os.path.exists(f"{config.root_dir}/{os.getpid()}.view/dev/x")
    if os.geteuid() == 0:  # one /dev for both sandboxes of this process
        assert [p.name for p in Path(config.root_dir).glob("*.view")] == [f"{os.getpid()}.view"]


SHOWN_DIRS = "|".join(re.escape(d) for d in system_view().dirs)  # the system dirs and the Python: their mounts' flags
ROOT_LISTING = ("stat -c '%n %F %a %u %g %N' / /* | grep -v ^/workspace; "
                f"awk '{{print $5, $6}}' /proc/self/mountinfo | grep -E {shlex.quote(f'^({SHOWN_DIRS})[ /]')}")


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root runner's worker makes the sandboxes' / once")
def test_the_sandbox_root_is_the_one_bubblewrap_makes_made_once_and_read_only(config):
    """A worker makes one read-only / for its sandboxes (one bind for bubblewrap to make and read, not
    one per system dir): it must show what bubblewrap's binds do, and no sandbox may change it, nor make
    a mount point there that a later prompt's sandbox would see (a row's cwd elsewhere)."""
    bwraps = subprocess.run(["bwrap", *bwrap_system_binds(), "--dev", "/dev", "--proc", "/proc", "--perms", "1777",
                             "--tmpfs", "/tmp", "--unshare-pid", "--", "bash", "-c", ROOT_LISTING],
                            capture_output=True, text=True, check=True).stdout
    elsewhere = open_sandbox(config, "p1", None, "/srv/project")  # no mount point in the view: bound as bubblewrap's
    assert run(elsewhere, "pwd").output == "/srv/project\n"
    first, second = open_sandbox(config, "p2", None, None), open_sandbox(config, "p3", None, None)
    assert run(first, ROOT_LISTING).output == bwraps
    result = run(second, "touch /x /root/x; mkdir /y; echo made=$?; echo $(ls /)")
    made, listing = result.output.splitlines()[-2:]
    assert made == "made=1" and not {"x", "y", "srv"} & set(listing.split()), result
    view = Path(config.root_dir) / f"{os.getpid()}.view"
    assert sorted(p.name for p in view.iterdir()) == listing.split()
    assert [p.name for p in Path(config.root_dir).glob("*.view")] == [view.name]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts")
def test_the_root_shows_a_system_dirs_own_mounts_read_only_keeping_their_flags(tmp_path):
    """In a container /etc/hosts is a mount of its own: the sandboxes' / must show it as bubblewrap's
    --ro-bind would, read-only, and a flag it had (noexec) must not be lost."""
    system = tmp_path / "system"
    (system / "sub").mkdir(parents=True)
    roots._mount(b"tmpfs", str(system / "sub"), b"tmpfs", roots.MS_NOEXEC, "size=64k")
    (system / "sub" / "file").write_text("kept")
    view = tmp_path / "view"
    roots.new_view(str(view), SystemView((), (str(system),), tuple(parents_to_pass(str(system)))), ("/srv",))
    shown = f"{view}{system}/sub"
    table = {line.split()[4]: line.split()[5].split(",") for line in Path("/proc/self/mountinfo").read_text().splitlines()}
    assert {"ro", "nosuid", "nodev", "noexec"} <= set(table[shown]) and "ro" in table[str(view)]
    assert Path(shown, "file").read_text() == "kept"
    assert sorted(p.name for p in view.iterdir()) == ["dev", "srv", tmp_path.parts[1]]


def test_prompts_cannot_see_each_others_files(config):
    first = open_sandbox(config, "first", None, None)
    second = open_sandbox(config, "second", None, None)
    arun(first.write_file("secret.txt", b"TOKEN-1234"))
    # run both at once: each sees only its own work dir at /workspace
    a, listing, peek = arun(_gather(
        first.run("sleep 0.5; cat secret.txt", 30),
        second.run("ls -A /workspace", 30),
        second.run(f"cat {first.host_dir}/secret.txt /workspace/../first/secret.txt; ls -R {config.root_dir}", 30),
    ))
    assert a.output == "TOKEN-1234"
    assert listing.output == ""
    assert "TOKEN-1234" not in peek.output and peek.exit_code != 0
    with pytest.raises(SandboxError):
        arun(read_file(second, f"{first.host_dir}/secret.txt", 1 << 20))


async def _gather(*coroutines):
    return await asyncio.gather(*coroutines)


def test_home_repo_and_test_files_are_invisible(config, tmp_path):
    (tmp_path / "test-secret.txt").write_text("hidden")
    home = os.path.expanduser("~")
    runner = [Path(sys.base_prefix)]  # the running Python: read-only in every sandbox, on the commands' PATH
    entries = [e for e in os.listdir(home) if not any(r.is_relative_to(Path(home, e)) for r in runner)]
    sandbox = open_sandbox(config, "p1", None, None)
    probes = [str(tmp_path / "test-secret.txt"), os.getcwd(), *(f"{home}/{e}" for e in entries)]
    result = run(sandbox, "; ".join(f"test -e {p} && echo VISIBLE {p}" for p in probes) + "; true")
    assert "VISIBLE" not in result.output


def test_timeout_kills_the_command_and_all_its_children(config):
    sandbox = open_sandbox(config, "p1", None, None)
    started = time.monotonic()
    result = run(sandbox, "setsid sleep 4242 & (sleep 4243 &); echo begun; sleep 4244", timeout=1)
    assert time.monotonic() - started < 10
    assert result.exit_code is None
    assert result.error == "timed out after 1 s; the command and its children were killed"
    assert "begun" in result.output
    time.sleep(0.2)
    assert survivors("sleep 424") == ""


def test_a_cancelled_command_leaves_nothing_running(config):
    sandbox = open_sandbox(config, "p1", None, None)

    async def cancel_midway():
        task = asyncio.create_task(sandbox.run("setsid sleep 4261 & sleep 4262", 60))
        await asyncio.sleep(1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    arun(cancel_midway())
    time.sleep(0.2)
    assert survivors("sleep 426") == ""


def test_background_jobs_end_with_the_command(config):
    sandbox = open_sandbox(config, "p1", None, None)
    started = time.monotonic()
    result = run(sandbox, "setsid sleep 4245 & echo started")
    assert (result.output, result.exit_code) == ("started\n", 0)
    assert time.monotonic() - started < 5
    time.sleep(0.2)
    assert survivors("sleep 4245") == ""


def _connect_probe(port: int) -> str:
    return (
        "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", %d), timeout=3); print(\"CONNECTED\")'" % port
    )


def test_no_network_by_default(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        closed = SandboxConfig(root_dir=str(tmp_path / "closed"))
        opened = SandboxConfig(root_dir=str(tmp_path / "opened"), network=True)
        try:
            blocked = run(open_sandbox(closed, "p1", None, None), _connect_probe(port))
            allowed = run(open_sandbox(opened, "p1", None, None), _connect_probe(port))
        finally:
            cleanup(closed)
            cleanup(opened)
    assert "CONNECTED" not in blocked.output and blocked.exit_code != 0
    assert "CONNECTED" in allowed.output  # the probe itself works when the network is shared


def test_with_the_network_on_vsock_is_still_refused(tmp_path):
    """AF_VSOCK's port space is shared by every sandbox and may reach the VM's host, network or not."""
    opened = SandboxConfig(root_dir=str(tmp_path / "opened"), network=True)
    probe = ("python3 -c 'import socket\nfor f in (socket.AF_VSOCK, socket.AF_INET):\n"
             "    try: socket.socket(f, socket.SOCK_STREAM).close(); print(\"made\")\n"
             "    except OSError as e: print(e.errno)'")
    try:
        result = run(open_sandbox(opened, "p1", None, None), probe)
    finally:
        cleanup(opened)
    assert result.output.split() == ["97", "made"], result  # EAFNOSUPPORT for vsock; TCP works


def test_output_is_capped_keeping_head_and_tail(config):
    sandbox = open_sandbox(config, "p1", None, None)
    result = run(sandbox, "echo FIRST-LINE; head -c 300000 /dev/zero | tr '\\0' x; echo; echo LAST-LINE")
    assert result.output.startswith("FIRST-LINE\n")
    assert result.output.endswith("LAST-LINE\n")
    assert "bytes of output cut" in result.output
    assert len(result.output) < OUTPUT_CAP + 100


def test_resource_limits_apply(tmp_path):
    config = SandboxConfig(root_dir=str(tmp_path / "sb"), file_size_mb=1, cpu_seconds=7, max_processes=99, memory_mb=300)
    try:
        sandbox = open_sandbox(config, "p1", None, None)
        limits = run(sandbox, "ulimit -t; ulimit -u; ulimit -f; ulimit -d")
        big = run(sandbox, "head -c 2000000 /dev/zero > big; wc -c < big")
    finally:
        cleanup(config)
    assert limits.output.split() == ["7", "99", str(1024), str(300 * 1024)]
    assert big.output.split()[-1] == "1048576"  # the write stopped at 1 MiB


# `open`, `mmap`, `close` in a loop: the file objects stay, no rlimit counts them. N processes (forked: one
# Python's memory) each map the file up to 65,000 times (about vm.max_map_count) and say how many they held
FILE_TABLE_FILLER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
reports = []
for _ in range(int(sys.argv[1])):
    report, out = os.pipe()
    release, hold = os.pipe()
    if os.fork() == 0:
        os.close(report)
        os.close(hold)
        open("/proc/self/oom_score_adj", "w").write("1000")  # the memory limit kills a filler, not this parent
        held, why = 0, "65000"
        while held < 65000:
            fd = os.open("f", os.O_RDONLY)
            if libc.mmap(None, 1, 1, 2, fd, 0) == ctypes.c_void_p(-1).value:
                why = os.strerror(ctypes.get_errno())
                break
            os.close(fd)
            held += 1
        os.write(out, f"{held} {why}\\n".encode())
        os.read(release, 1)  # held until this parent ends
        os._exit(0)
    os.close(out)
    reports.append(report)
for report in reports:
    print(os.read(report, 100).decode().strip() or "killed")
"""


@pytest.mark.skipif(cgroups.problem() is not None, reason=f"no cgroups for sandboxes here: {cgroups.problem()}")
def test_a_sandbox_holds_file_objects_only_within_its_memory_limit(tmp_path):
    """4 x 65,000 file objects (about 100 MB of kernel memory) in a sandbox of 64 MB: its memory
    cgroup is charged for them and stops it; fs.file-max, raised as systemd does, is then no
    bound any sandbox can reach (docs/sandboxes.md)."""
    config = SandboxConfig(root_dir=str(tmp_path / "sb"), memory_mb=64)
    before = int(shares.FILE_MAX.read_text())
    said = [] if before == shares.UNBOUNDED else [
        f"raised fs.file-max from {before:,} to {shares.UNBOUNDED} (as systemd does), so that each sandbox's "
        "memory limit bounds the kernel file objects it holds (docs/sandboxes.md)"]
    assert prepare_host(config) == said
    assert int(shares.FILE_MAX.read_text()) == shares.UNBOUNDED
    try:
        sandbox = open_sandbox(config, "filler", None, None)
        arun(sandbox.write_file("f", b"x"))
        arun(sandbox.write_file("filler.py", FILE_TABLE_FILLER.encode()))
        # the sandbox shows the interpreter itself (sys.base_prefix), not a virtualenv's link to it
        filled = run(sandbox, f"{os.path.realpath(sys.executable)} filler.py 4", 120)
    finally:
        cleanup(config)
    assert "hit its memory limit (64 MB" in filled.error, filled
    held = filled.output.splitlines()
    assert len(held) == 4 and "killed" in held, filled  # not all 4 x 65,000 objects: the memory limit stopped them


@pytest.mark.skipif(cgroups.problem() is not None, reason=f"no cgroups for sandboxes here: {cgroups.problem()}")
def test_a_group_a_killed_runner_left_frozen_is_still_emptied_and_removed():
    """A runner killed between freezing a sandbox's group and thawing it: the next one's sweep ends it."""
    run_id = uuid.uuid4().hex[:12]
    group = cgroups.create(run_id, "frozen", "p1", 64 << 20, 16)
    enter = "; ".join(f"echo $$ > {f}" for f in group.procs_files)
    held = subprocess.Popen(["sh", "-c", f"{enter}; exec sleep 600"])
    try:
        wait = time.monotonic() + 30
        while held.pid not in group.pids() and time.monotonic() < wait:
            time.sleep(0.01)
        freezers = [(d / name, value) for d in group.dirs for name, value, *_ in cgroups.FREEZERS
                    if (d / name).exists()]
        if not freezers:
            pytest.skip("no freezer here (cgroup v1 without the freezer controller)")
        [(state, frozen)] = freezers
        state.write_text(frozen)
        cgroups.remove(run_id)
        assert held.wait(timeout=30) == -9
        assert not any(d.exists() for d in group.dirs)
    finally:
        held.kill()
        held.wait()


def test_the_file_table_is_widened_only_as_root_and_the_run_is_told(tmp_path, monkeypatch):
    """The host's own fs.file-max stays as it is: a file in its place (lowering it back is no test's to do)."""
    table = tmp_path / "file-max"
    monkeypatch.setattr(shares, "FILE_MAX", table)
    table.write_text("2466116\n")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    [told] = prepare_host(SandboxConfig(backend="docker"))
    assert told.startswith("fs.file-max is 2,466,116, which one sandbox can fill within its memory; as root")
    assert table.read_text() == "2466116\n"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert prepare_host(SandboxConfig(backend="modal")) == []  # Modal's sandboxes are not on this machine
    assert prepare_host(SandboxConfig()) == [f"raised fs.file-max from 2,466,116 to {shares.UNBOUNDED} (as systemd "
                                             "does), so that each sandbox's memory limit bounds the kernel file "
                                             "objects it holds (docs/sandboxes.md)"]
    assert int(table.read_text()) == shares.UNBOUNDED == (1 << 63) - 1
    assert prepare_host(SandboxConfig()) == []  # said once: nothing is left to raise
    assert shares.open_files(32, 512) == shares.MAX_OPEN_FILES


def test_files_map_to_the_work_dir_and_escapes_are_refused(config):
    sandbox = open_sandbox(config, "p1", None, None)
    arun(sandbox.write_file("a/b/new.txt", b"made by the host"))
    assert arun(read_file(sandbox, "/workspace/a/b/new.txt", 1 << 20)) == b"made by the host"
    # a host-written file belongs to the command's user: commands can change it
    links = "ln -s /etc/passwd link && ln -s / root && ln -s new.txt a/b/alias"
    assert run(sandbox, f"echo appended >> a/b/new.txt && {links}").exit_code == 0
    assert arun(read_file(sandbox, "a/b/alias", 1 << 20)) == b"made by the host" + b"appended\n"
    for path in ("/etc/passwd", "../x", "a/../../x", "/workspace/../etc/passwd", "link", "root/etc/passwd", ""):
        with pytest.raises(SandboxError):
            arun(read_file(sandbox, path, 1 << 20))
        with pytest.raises(SandboxError):
            arun(sandbox.write_file(path, b"x"))
    assert open("/etc/passwd", "rb").read() != b"x"


def test_reading_a_fifo_is_refused_instead_of_hanging(config):
    sandbox = open_sandbox(config, "p1", None, None)
    run(sandbox, "mkfifo pipe")
    with pytest.raises(SandboxError, match="not a regular file"):
        arun(read_file(sandbox, "pipe", 1 << 20))


def test_work_dir_can_be_mounted_at_the_rows_cwd(config):
    sandbox = open_sandbox(config, "p1", None, "/home/user/project")
    assert sandbox.cwd == "/home/user/project"
    arun(sandbox.write_file("/home/user/project/main.py", b"print(1)\n"))
    assert run(sandbox, "pwd; cat main.py").output == "/home/user/project\nprint(1)\n"
    for bad in ("relative/dir", "/usr/src", "/", "/proc/x"):
        with pytest.raises(SandboxError):
            open_sandbox(config, "p2", None, bad)


def test_close_removes_the_work_dir_unless_kept(config, tmp_path):
    sandbox = open_sandbox(config, "p1", None, None)
    run(sandbox, "echo x > file")
    arun(sandbox.close())
    assert not os.path.exists(sandbox.host_dir)
    kept_config = SandboxConfig(root_dir=str(tmp_path / "kept"), keep=True)
    try:
        kept = open_sandbox(kept_config, "p1", None, None)
        run(kept, "echo x > file")
        arun(kept.close())
        assert os.path.exists(os.path.join(kept.host_dir, "file"))
    finally:
        cleanup(kept_config)  # its session's cgroups; the work dir stays, as the run's would


def test_cleanup_removes_leftovers_and_can_repeat(config):
    sandboxes = [open_sandbox(config, f"p{i}", None, None) for i in range(3)]
    for sandbox in sandboxes:
        run(sandbox, "echo left > behind")
    cleanup(config)
    assert not os.path.exists(config.root_dir)
    cleanup(config)
    assert run(open_sandbox(config, "p9", None, None), "echo fresh").output == "fresh\n"  # the run goes on


def test_unsafe_local_still_scrubs_env_and_kills_its_group(config, monkeypatch):
    """Without bubblewrap (here: forced), commands run directly in the work dir: no namespaces, same env and limits."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    host_dir = os.path.join(config.root_dir, "unsafe")
    os.makedirs(host_dir)
    sandbox = LocalSandbox(config, host_dir, host_dir, isolated=False)
    result = run(sandbox, "pwd; env")
    assert result.output.startswith(host_dir + "\n") and "sk-secret" not in result.output
    timed_out = run(sandbox, "sleep 4246 & sleep 4247", timeout=1)
    assert timed_out.exit_code is None and "timed out" in timed_out.error
    deadline = time.monotonic() + 30  # the group's kill is under way: poll, never a fixed wait
    while (left := survivors("sleep 424[67]")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == ""


def _runner_holding_a_root(*prefix: str) -> tuple[subprocess.Popen, str]:
    """A process that makes a sandbox root (holding its lock) and waits; returns it and the root."""
    code = "from trajgen.sandbox.roots import new_root_dir; print(new_root_dir(), flush=True); import time; time.sleep(600)"
    process = subprocess.Popen([*prefix, sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    return process, process.stdout.readline().strip()


@pytest.mark.skipif(os.geteuid() != 0, reason="a second pid namespace (unshare --pid) needs root")
def test_the_sweep_removes_only_roots_whose_runner_is_dead_in_any_pid_namespace():
    """A runner in another pid namespace sharing /tmp (a container, Ray) keeps its live root; a killed one's goes."""
    alive, alive_root = _runner_holding_a_root("unshare", "--pid", "--fork", "--kill-child")
    dead, dead_root = _runner_holding_a_root()
    try:
        dead.kill()
        dead.wait()
        assert os.path.isdir(alive_root) and os.path.isdir(dead_root)
        sweep_stale_roots()
        assert os.path.isdir(alive_root)
        assert not os.path.exists(dead_root) and not os.path.exists(dead_root + ".lock")
    finally:
        alive.kill()
        alive.wait()
    deadline = time.monotonic() + 30  # the runner inside dies a moment after unshare (--kill-child)
    while os.path.exists(alive_root) and time.monotonic() < deadline:
        sweep_stale_roots()
        time.sleep(0.05)
    assert not os.path.exists(alive_root)


def test_runners_starting_at_once_neither_fail_nor_remove_each_others_roots():
    """Every new root sweeps the stale ones: sweepers racing each other and a runner's fresh lock
    must neither fail on a lock file already gone nor remove a root whose runner lives."""
    code = """if True:
        import os
        from trajgen.sandbox import roots
        for _ in range(150):
            root = roots.new_root_dir()
            os.close(roots._held.pop(roots.new_root_dir()))  # a stale root, as a killed runner leaves
            roots.sweep_stale_roots()
            assert os.path.isdir(root) and os.path.exists(root + ".lock"), root
            roots.remove_root(root)
            roots.release_root(root)
    """
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    runners = [subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
               for _ in range(4)]
    errors = [runner.communicate()[1] for runner in runners]
    assert [runner.returncode for runner in runners] == [0] * 4, "\n".join(errors)


def test_a_bare_config_has_no_side_effects(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    tempfile.tempdir = None
    try:
        SandboxConfig()
        assert list(tmp_path.iterdir()) == []
        with pytest.raises(SandboxError, match="root_dir"):
            open_sandbox(SandboxConfig(), "p1")
    finally:
        tempfile.tempdir = None


def test_each_command_of_a_prompt_starts_as_in_a_fresh_sandbox(config):
    """One sandbox serves the prompt, but /tmp and the shell do not carry over; files do."""
    sandbox = open_sandbox(config, "p1", None, None)
    first, second = arun(_in_turn(
        sandbox, "echo kept > note; echo gone > /tmp/scratch; mkdir /tmp/dir; export X=1",
        "cat note; ls -A /tmp; echo X=$X",
    ))
    assert first.exit_code == 0
    assert (second.output, second.exit_code) == ("kept\nX=\n", 0)


async def _in_turn(sandbox, *commands):
    try:
        return [await sandbox.run(command, 30) for command in commands]
    finally:
        await sandbox.close()


def test_a_sandbox_whose_command_loop_dies_is_started_again(config):
    sandbox = open_sandbox(config, "p1", None, None)
    arun(sandbox.write_file("kept.txt", b"still here"))
    lost, after = arun(_in_turn(sandbox, "kill -9 $PPID; sleep 4271", "cat kept.txt"))
    assert lost.exit_code is None and "stopped unexpectedly" in lost.error
    assert (after.output, after.exit_code) == ("still here", 0)
    time.sleep(0.2)
    assert survivors("sleep 4271") == ""


def _zombie_children(pid: int) -> list[int]:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    zombies = []
    for child in children:
        try:
            if Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                zombies.append(int(child))
        except OSError:
            pass
    return zombies


def _children_named(name: str) -> list[int]:
    """This process's children (from any of its threads) running `name`."""
    pids = [int(p) for children in Path("/proc/self/task").glob("*/children") for p in children.read_text().split()]
    found = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                found.append(pid)
        except OSError:  # ended meanwhile
            pass
    return found


def test_a_prompts_sandbox_starts_while_its_first_call_runs(inline, scripted_server):
    """A sandbox's start-up (bubblewrap, its namespaces, the command loop) is off the prompt's path: it
    runs while the first model call is unanswered, and the first command finds it running."""
    server = scripted_server({"default": [{**call("terminal", command="echo hi"), "gate": "first"}, think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "p"}])
    started_ahead = lambda: len(server.requests()) == 1 and _children_named("bwrap")  # noqa: E731
    # without a start ahead the gate never opens: the run is stopped, and `when` fails, instead of waiting on the call
    with stopped_if_it_hangs(120), when(started_ahead, lambda: server.open_gate("first")):
        done = inline.run(*inline.args(server))
    assert done.returncode == 0, done.stderr
    [row] = read_jsonl(inline.run_dir() / "batch_0.jsonl")
    assert tool_outputs(row)[0]["output"] == "hi\n"


def test_a_runner_that_is_pid_1_is_left_no_zombie_per_sandbox(cli, scripted_server):
    """In a container without an init the runner is PID 1 and adopts every orphan: a sandbox's end must
    leave none (each was a zombie, and a PID namespace the kernel kept, for as long as the run lasted)."""
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no PID namespace for the runner here: {probe.stderr.strip() or probe.returncode}")
    server = scripted_server({"prompts": {"last": [{**call("terminal", command="echo hi"), "gate": "end"}, think()]},
                              "default": [call("terminal", command="echo hi"), think()]})
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": f"prompt {i}"} for i in range(12)] + [{"prompt": "last"}])
    process = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
                                *cli.command(*cli.args(server))], cwd=cli.cwd, env=cli.env, text=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        # all but the gated one; whole lines only, so a row being written is never parsed half-way
        while sum(p.read_bytes().count(b"\n") for p in cli.run_dir().glob("batch_*.jsonl")) < 12:
            assert process.poll() is None and time.monotonic() < deadline, "12 prompts did not finish"
            time.sleep(0.1)
        runner = int(Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()[0])
        assert _zombie_children(runner) == []  # 12 sandboxes ended, each before its row was written
    finally:
        server.open_gate("end")
        _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr


def test_a_command_loop_that_outlives_the_end_of_its_input_goes_with_its_group(tmp_path, monkeypatch):
    """bwrap may live on once its init is killed (seen under load): past REAP_SECONDS, its group is killed."""
    monkeypatch.setattr(supervisor, "REAP_SECONDS", 0.2)
    marker = f"sleep 600.{uuid.uuid4().int % 10**9}"  # ignores the end of its input, as such a bwrap does
    channel = arun(supervisor.process_channel(["sh", "-c", f"{marker} & exec {marker}"], [],
                                              {"PATH": os.environ["PATH"]}, str(tmp_path)))
    deadline = time.monotonic() + 30
    while len(survivors(marker).splitlines()) < 2:
        assert time.monotonic() < deadline, "the loop and its child never both ran"
        time.sleep(0.05)
    arun(channel.kill())
    assert arun(channel.reader.read()) == b"" and survivors(marker) == ""


def test_killing_pids_already_gone_is_no_error():
    kill_pids([int(Path("/proc/sys/kernel/pid_max").read_text()) + 1])  # above pid_max: no process has it


def test_a_worker_waits_for_its_sandboxes_processes_without_a_thread_each(tmp_path):
    """Python 3.11's asyncio would start a thread per child process, one per sandbox started (prepare_worker)."""
    code = f"""
import asyncio, threading
from trajgen.sandbox.backends import SandboxConfig, prepare_worker
prepare_worker(SandboxConfig(root_dir={str(tmp_path)!r}))
async def main():
    children = [await asyncio.create_subprocess_exec("sh", "-c", f"read go; exit {{i}}", stdin=asyncio.subprocess.PIPE)
                for i in range(3)]
    threads = threading.active_count()  # all three alive: each waits for its line
    for child in children:
        child.stdin.write(b"go\\n")
    print(threads, [await child.wait() for child in children])
asyncio.run(main())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split("\n")[0] == "1 [0, 1, 2]", done.stdout + done.stderr
