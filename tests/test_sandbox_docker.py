"""The docker sandbox against a real engine (see tests/dockerd.py) and a busybox image."""
from __future__ import annotations

import asyncio
import http.client
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import arun, mount_points
from trajgen.sandbox import SandboxError, read_file
from trajgen.sandbox.backends import SandboxConfig, check_images, cleanup, open_sandbox
from trajgen.sandbox.docker_client import call, engine
from trajgen.sandbox.roots import UID_LOCKS

pytest_plugins = ["tests.dockerd"]

MISSING = "127.0.0.1:1/trajgen-missing:latest"  # a pull of it only ever tries the loopback


@pytest.fixture
def config(tmp_path, docker_engine):
    config = SandboxConfig(backend="docker", root_dir=str(tmp_path / "sb"), command_timeout=30, memory_mb=256, max_processes=64)
    yield config
    cleanup(config)


def run(sandbox, command: str, timeout: float = 30):
    return asyncio.run(sandbox.run(command, timeout))


def containers(label: str) -> list[str]:
    listed = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=trajgen.session={label}"], capture_output=True, text=True)
    return listed.stdout.split()


def inspect(container: str, template: str) -> str:
    return subprocess.run(["docker", "inspect", "-f", template, container], capture_output=True, text=True).stdout.strip()


async def _session(sandbox, *commands: str):
    """Several commands and a close in one event loop, as a worker would do them."""
    results = [await sandbox.run(command, 30) for command in commands]
    await sandbox.close()
    return results


def test_runs_in_the_image_at_the_cwd_without_network(config, busybox_image, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    sandbox = open_sandbox(config, "p1", busybox_image, "/srv/app")
    result = run(sandbox, "pwd; command -v bash || echo no-bash; env; cat /proc/net/dev")
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert lines[:2] == ["/srv/app", "no-bash"]
    assert "sk-secret" not in result.output and "OPENAI_API_KEY" not in result.output
    interfaces = [line.split(":")[0].strip() for line in lines if ":" in line and "|" not in line and "=" not in line]
    assert interfaces == ["lo"]
    [container] = containers(config.label)
    settings = inspect(container, "{{.Config.Image}} {{.HostConfig.NetworkMode}} {{.HostConfig.PidsLimit}}")
    assert settings == f"{busybox_image} none 64"
    asyncio.run(sandbox.close())


def test_output_that_comes_with_the_execs_answer_is_not_lost(config, busybox_image, monkeypatch):
    """The SDK reads an exec's output from the raw socket, past the buffer its HTTP client read the
    answer into (docker/docker-py#3332): the command must not start before that answer is read."""
    begin = http.client.HTTPResponse.begin

    def late(response):  # the command has long printed when its exec's answer is read
        time.sleep(0.5)
        return begin(response)

    sandbox = open_sandbox(config, "p1", busybox_image, None)
    assert run(sandbox, "true").exit_code == 0  # the container, started at the normal pace
    monkeypatch.setattr(http.client.HTTPResponse, "begin", late)
    assert run(sandbox, "echo hi").output == "hi\n"
    monkeypatch.undo()
    asyncio.run(sandbox.close())


def test_a_process_forked_after_engine_calls_makes_its_own(docker_engine, busybox_image):
    """Workers may be forked from a process that has called the engine: they get threads and connections of their own."""
    asyncio.run(call("inspect_image", busybox_image))
    parents = engine()
    pid = os.fork()
    if pid == 0:
        try:
            asyncio.run(asyncio.wait_for(call("inspect_image", busybox_image), 30))
            os._exit(0 if engine() is not parents else 1)  # not the parent's client and its pooled connections
        except BaseException:
            os._exit(1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0


def test_timeout_kills_the_command_and_its_children(config, busybox_image):
    sandbox = open_sandbox(config, "p1", busybox_image, None)
    started = time.monotonic()
    timed_out, after = asyncio.run(_session_timeout(sandbox))
    assert time.monotonic() - started < 20
    assert timed_out.exit_code is None and timed_out.error.startswith("timed out after 2 s")
    assert "begun" in timed_out.output
    assert "sleep 425" not in after.output  # nothing survived, and the container still works
    assert after.exit_code == 0


async def _session_timeout(sandbox):
    timed_out = await sandbox.run("setsid sleep 4251 & (sleep 4252 &); echo begun; sleep 4253", 2)
    after = await sandbox.run("ps", 30)
    await sandbox.close()
    return timed_out, after


def test_files_go_through_the_container(config, busybox_image):
    sandbox = open_sandbox(config, "p1", busybox_image, None)

    async def session():
        await sandbox.write_file("sub/dir/x.txt", b"line\n")
        shown = await sandbox.run("cat /workspace/sub/dir/x.txt; echo more >> sub/dir/x.txt", 30)
        content = await read_file(sandbox, "/workspace/sub/dir/x.txt", 1 << 20)
        with pytest.raises(SandboxError, match="No such file"):
            await read_file(sandbox, "absent.txt", 1 << 20)
        await sandbox.close()
        return shown, content

    shown, content = asyncio.run(session())
    assert shown.output == "line\n"
    assert content == b"line\nmore\n"


def _uids_held() -> list[str]:
    """The uid locks this process holds open (roots.take_uid)."""
    fds = Path("/proc/self/fd")
    return sorted(target for fd in fds.iterdir() if (target := os.path.realpath(fd)).startswith(str(UID_LOCKS)))


def test_missing_image_fails_clearly_and_check_images_says_why(config, busybox_image):
    held_before = _uids_held()
    sandbox = open_sandbox(config, "p1", MISSING, None)
    started = time.monotonic()
    with pytest.raises(SandboxError, match="cannot start a container from image 127.0.0.1:1/trajgen-missing"):
        arun(sandbox.start())  # as a prompt starts it ahead
    with pytest.raises(SandboxError, match="cannot start a container from image 127.0.0.1:1/trajgen-missing"):
        run(sandbox, "true")  # its first command tries again
    arun(sandbox.close())
    assert _uids_held() == held_before  # each try took the same uid, given back at the close
    assert mount_points("self", (os.path.realpath(config.root_dir) + "/",)) == set()  # no PTY instance left
    report = asyncio.run(check_images([busybox_image, MISSING, busybox_image], config))
    assert time.monotonic() - started < 30
    assert list(report) == [busybox_image, MISSING]
    assert report[busybox_image] is None
    assert "not available locally and pulling it failed" in report[MISSING]


def test_close_removes_the_container_unless_kept(config, busybox_image):
    sandbox = open_sandbox(config, "p1", busybox_image, None)
    asyncio.run(_session(sandbox, "true"))
    assert containers(config.label) == []
    kept_config = SandboxConfig(backend="docker", root_dir=config.root_dir, label=config.label, keep=True)
    asyncio.run(_session(open_sandbox(kept_config, "p2", busybox_image, None), "true"))
    assert len(containers(config.label)) == 1
    cleanup(kept_config)  # keep: cleanup leaves it too (the fixture's cleanup removes it)
    assert len(containers(config.label)) == 1


def test_cleanup_removes_only_this_sessions_containers(config, busybox_image, tmp_path):
    other = SandboxConfig(backend="docker", root_dir=str(tmp_path / "other"))
    for key in ("a", "b"):
        run(open_sandbox(config, key, busybox_image, None), "true")  # never closed, like after a crash
    run(open_sandbox(other, "c", busybox_image, None), "true")
    assert len(containers(config.label)) == 2
    cleanup(config)
    cleanup(config)
    assert containers(config.label) == []
    assert len(containers(other.label)) == 1
    cleanup(other)
    assert containers(other.label) == []


def test_an_image_with_bash_runs_a_prompts_commands_through_one_exec(config, bash_image):
    """One command loop per prompt: later commands start no exec of their own, and find /tmp empty as local does."""
    sandbox = open_sandbox(config, "p1", bash_image, None)

    async def session():
        await sandbox.write_file("note.txt", b"from the host\n")
        first = await sandbox.run("touch /tmp/left; cat note.txt; echo loop=$PPID", 30)
        execs = inspect(sandbox._id, "{{len .ExecIDs}}")
        later = [await sandbox.run(f"ls -A /tmp; echo {i} >> note.txt; echo loop=$PPID", 30) for i in range(3)]
        users = await sandbox.run("ps -o user", 30)
        return first, execs, later, inspect(sandbox._id, "{{len .ExecIDs}}"), await read_file(sandbox, "note.txt", 1 << 20), users

    try:
        first, execs, later, execs_after, note, users = arun(session())
    finally:
        arun(sandbox.close())
    assert first.output.startswith("from the host\nloop=") and first.exit_code == 0
    assert [r.output for r in later] == [first.output.split("\n", 1)[1]] * 3  # /tmp empty, the same loop each time
    assert execs == execs_after == "1"  # between commands, the loop is the container's one exec
    assert note == b"from the host\n0\n1\n2\n"
    # PID 1 is the one process of another user: with a second, `kill -9 -1` would report success
    # forever and the loop would spin on its wait for every killed process to be gone
    assert users.output.split()[1:].count("root") == 1


def test_a_timed_out_or_killed_loop_takes_every_process_along_and_the_next_command_works(config, bash_image):
    sandbox = open_sandbox(config, "p1", bash_image, None)

    async def session():
        timed_out = await sandbox.run("setsid sleep 4251 & (sleep 4252 &); echo begun; sleep 4253", 2)
        after = await sandbox.run("ps -o args", 30)
        lost = await sandbox.run("setsid sleep 4254 & kill -9 $PPID; sleep 4255", 30)
        return timed_out, after, lost, await sandbox.run("ps -o args", 30)

    try:
        timed_out, after, lost, after_lost = arun(session())
    finally:
        arun(sandbox.close())
    assert timed_out.exit_code is None and timed_out.error.startswith("timed out after 2 s")
    assert timed_out.output == "begun\n"
    assert lost.exit_code is None and "stopped unexpectedly" in lost.error
    for ps in (after, after_lost):
        assert "sleep 425" not in ps.output and ps.exit_code == 0


def test_an_engine_behind_a_docker_context_is_reached(config, busybox_image, docker_engine, tmp_path, monkeypatch):
    """Without DOCKER_HOST, the engine is the one of DOCKER_CONTEXT, else of the CLI's current context."""
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker-config"))
    for name in ("trajgen-test", "trajgen-current"):
        subprocess.run(["docker", "context", "create", name, "--docker", f"host={docker_engine}"],
                       check=True, capture_output=True)
    monkeypatch.delenv("DOCKER_HOST")
    subprocess.run(["docker", "context", "use", "trajgen-current"], check=True, capture_output=True)
    assert engine().shown == "docker context trajgen-current"
    monkeypatch.setenv("DOCKER_CONTEXT", "trajgen-test")
    assert engine().shown == "docker context trajgen-test"
    sandbox = open_sandbox(config, "p1", busybox_image, None)

    async def session():
        await sandbox.write_file("x.txt", b"through the context\n")
        shown = await sandbox.run("cat x.txt; echo to-stderr >&2; exit 3", 30)
        await sandbox.close()
        return shown

    shown = arun(session())
    assert (shown.output, shown.exit_code) == ("through the context\nto-stderr\n", 3)
    monkeypatch.setenv("DOCKER_CONTEXT", "trajgen-absent")
    with pytest.raises(SandboxError, match="^cannot reach the Docker engine: there is no docker context trajgen-absent$"):
        engine()
