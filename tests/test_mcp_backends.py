"""MCP stdio servers from PyPI (mcp-server-git, mcp-server-time) in the apptainer and modal
backends, against their stand-ins (tests/standins/: Apptainer and Modal cannot run here), with the
servers' image of tests/support/mcp_image.py. In-process, as a worker drives a prompt's tools: the
runner's CLI adds nothing backend-specific (tests/test_mcp.py runs it with the local backend)."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.conftest import arun
from tests.standins import live_instances
from tests.test_mcp import (CHECK, GIT, SECRET, STDIO, TIME, Prompt, probe, servers_under, settle,
                            start_a_daemon_through_git)
from trajgen import verify
from trajgen.sandbox import apptainer, read_file
from trajgen.tools import mcp
from trajgen.sandbox.backends import SandboxConfig, cleanup

pytest_plugins = ["tests.dockerd", "tests.support.mcp_image", "tests.standins.fixtures", "tests.standins.modal_fixture"]

# in the sandbox's container only (busybox has no pkill); the brackets spare this shell, whose command line holds them
KILL = "for p in /proc/[0-9]*; do grep -q 'm[c]p_server_time' $p/cmdline 2>/dev/null && kill -9 ${p#/proc/}; done; true"


@pytest.fixture(scope="module")
def sif_cache(tmp_path_factory) -> str:
    """One SIF build of the image for the module's apptainer tests."""
    return str(tmp_path_factory.mktemp("sif"))


@pytest.fixture(params=["apptainer", "modal"])
def config(request, tmp_path, mcp_image, sif_cache):
    request.getfixturevalue(f"{request.param}_standin")
    config = SandboxConfig(backend=request.param, root_dir=str(tmp_path / "sandboxes"), command_timeout=60,
                           docker_image=mcp_image, run_id="mcprun", sif_cache=sif_cache)
    yield config
    cleanup(config)


def left(config: SandboxConfig) -> list[str]:
    """This session's instances or Modal sandboxes (containers) still running."""
    if config.backend == "apptainer":
        return [name for name in live_instances() if f"-{config.label}-" in name]
    return subprocess.run(["docker", "ps", "-q", "--filter", f"label=modal-standin.tag.trajgen.session={config.label}"],
                          capture_output=True, text=True, check=True).stdout.split()


def container(config: SandboxConfig, key: str) -> str:
    [found] = subprocess.run(["docker", "ps", "-q", "--filter", f"label=modal-standin.tag.trajgen.key={key}"],
                             capture_output=True, text=True, check=True).stdout.split()
    return found


def test_each_prompt_has_its_own_git_server_and_sees_only_its_own_repository(config):
    tools = probe(config, git=GIT)  # the probe builds the image first: sandboxes never do
    assert {"git_log", "git_status", "git_commit"} <= set(tools)
    prompts = [Prompt(config, f"repo-{i}") for i in range(2)]
    try:
        for prompt in prompts:
            made = arun(arun(prompt.sandbox()).run(
                f"git init -q . && git -c user.name=t -c user.email=t@t commit -q --allow-empty -m {prompt.key}; id -u", 60))
            assert made.exit_code == 0, made.output
            prompt.uid = int(made.output.split()[-1])
        for prompt in prompts:
            log = prompt.call(tools["git_log"], repo_path="/workspace")
            assert log["success"], log
            assert [p.key for p in prompts if f"Message: {p.key}\n" in log["output"]] == [prompt.key]
        if config.backend == "apptainer":  # the stand-in's processes are ours to inspect: uid and limits
            servers = servers_under(os.getpid(), "mcp_server_git")
            assert len(servers) == 2
            for pid, prompt in zip(sorted(servers), prompts):
                with open(f"/proc/{pid}/status") as f:
                    uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
                assert uid == prompt.uid != os.getuid()  # the uid of the prompt's commands
                with open(f"/proc/{pid}/limits") as f:
                    cpu = next(line for line in f if line.startswith("Max cpu time"))
                assert cpu.split()[3] == str(config.cpu_seconds)
    finally:
        for prompt in prompts:
            prompt.close()
    assert left(config) == []


def test_a_killed_server_restarts_at_the_next_call_and_none_outlives_the_prompt(config):
    tools = probe(config, time=TIME)
    prompt = Prompt(config, "killed")
    try:
        first = prompt.call(tools["get_current_time"], timezone="UTC")
        assert first["success"], first
        if config.backend == "apptainer":
            [server] = servers_under(os.getpid(), "mcp_server_time")
            os.kill(server, signal.SIGKILL)
        else:
            subprocess.run(["docker", "exec", container(config, "killed"), "sh", "-c", KILL], check=True)
        settle(lambda: prompt.ctx.state["mcp"]["time"].ended(), "the session to see its server gone")
        again = prompt.call(tools["get_current_time"], timezone="Europe/Paris")
        assert again["success"] and again["structured_content"]["timezone"] == "Europe/Paris", again
        if config.backend == "apptainer":
            assert servers_under(os.getpid(), "mcp_server_time") not in ([], [server])
    finally:
        prompt.close()
    assert left(config) == []
    assert servers_under(os.getpid(), "mcp_server_time") == []


def test_a_message_past_the_cap_fails_its_call_and_the_config_env_reaches_the_restarted_server(config):
    """Modal's own reader would hold a line whole: its bytes are split here, within the cap, as on this machine."""
    tools = probe(config, io=STDIO)
    prompt = Prompt(config, "deluge")
    try:
        cut = prompt.call(tools["deluge"], megabytes=12)
        assert not cut["success"] and f"more than {mcp.MESSAGE_CAP >> 20} MB" in cut["error"], cut
        assert prompt.call(tools["variable"], name="SERVICE_KEY")["output"] == SECRET
    finally:
        prompt.close()
    assert left(config) == []


def test_no_process_an_mcp_server_started_is_alive_at_the_check(config, capfd):
    tools = probe(config, git=GIT)
    prompt = Prompt(config, "daemon")
    try:
        start_a_daemon_through_git(prompt, tools)
        if config.backend == "apptainer":  # the stand-in's /tmp is root's: a check as the prompt's uid cannot
            # mktemp there, so the test does what the check would
            box = arun(prompt.sandbox())
            arun(box.end_processes())
            arun(box.write_file("result.txt", b"clean\n"))
            time.sleep(1)  # what the check would wait
            assert arun(read_file(box, "result.txt", 100)) == b"clean\n"
        else:
            check = arun(verify.run(CHECK, "done", prompt.sandbox, 60))
            assert check.verdict == verify.Verdict.PASSED, check
    finally:
        capfd.readouterr()
        prompt.close()
    assert capfd.readouterr() == ("", "")  # the dead session closes quietly
