"""An MCP stdio server in the docker backend: an image holding the server's command (the host's
Python with the servers, tests/support/mcp_image.py; no network)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import arun, call, read_jsonl, think, tool_outputs, write_jsonl
from tests.test_mcp import CHECK, GIT, SECRET, STDIO, Prompt, cmdline, descendants, probe, start_a_daemon_through_git
from trajgen import verify
from trajgen.sandbox.backends import SandboxConfig, cleanup

pytest_plugins = ["tests.dockerd", "tests.support.mcp_image"]


def test_docker_backend_runs_the_server_in_the_prompts_container(inline, scripted_server, mcp_image):
    (inline.cwd / "mcp.json").write_text(json.dumps({"mcpServers": {"time": {
        "command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone=UTC"]}}}))
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "what time is it"}])
    with scripted_server({"default": [call("get_current_time", timezone="Asia/Tokyo"), think("late")]}) as server:
        done = inline.run(*inline.args(server, mcp_config="mcp.json", toolsets="time", terminal_backend="docker",
                                       docker_image=mcp_image))
    assert done.returncode == 0, done.stderr
    [row] = read_jsonl(inline.run_dir() / "trajectories.jsonl")
    [result] = tool_outputs(row)
    assert result["success"] and result["structured_content"]["timezone"] == "Asia/Tokyo"
    probes = subprocess.run(["docker", "ps", "-aq", "--filter", "label=trajgen.key=mcp-probe-time",
                             "--filter", f"label=trajgen.run={inline.run_id()}"],
                            capture_output=True, text=True, check=True)
    assert probes.stdout.strip() == ""  # the probe's container went with its sandbox


def test_a_config_env_value_reaches_the_server_on_no_command_line(tmp_path, mcp_image):
    """The value crosses in the exec's API request: no process here, nor in the container, shows it."""
    config = SandboxConfig(backend="docker", root_dir=str(tmp_path / "sandboxes"), command_timeout=60,
                           docker_image=mcp_image)
    tools = probe(config, io=STDIO)
    prompt = Prompt(config, "env")
    try:
        assert prompt.call(tools["variable"], name="SERVICE_KEY")["output"] == SECRET
        [cid] = subprocess.run(["docker", "ps", "-q", "--filter", f"label=trajgen.session={config.label}"],
                               capture_output=True, text=True, check=True).stdout.split()
        inside = subprocess.run(["docker", "exec", cid, "sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"],
                                capture_output=True, text=True, check=True).stdout
        assert "mcp.server.mcpserver" in inside and SECRET not in inside  # the server runs; its command line is clean
        assert [cmdline(p) for p in descendants(os.getpid()) if SECRET in cmdline(p)] == []
    finally:
        prompt.close()
        cleanup(config)


def test_no_process_an_mcp_server_started_is_alive_at_the_check(tmp_path, mcp_bash_image, capfd):
    """Started while no command loop runs (the last command timed out), the server's exec is killed all the same."""
    config = SandboxConfig(backend="docker", root_dir=str(tmp_path / "sandboxes"), command_timeout=60,
                           docker_image=mcp_bash_image, run_id="mcpdaemon")
    try:
        tools = probe(config, git=GIT)
        prompt = Prompt(config, "daemon")
        try:
            start_a_daemon_through_git(prompt, tools)
            check = arun(verify.run(CHECK, "done", prompt.sandbox, 60))
        finally:
            capfd.readouterr()
            prompt.close()
            assert capfd.readouterr() == ("", "")  # the dead session closes quietly
    finally:
        cleanup(config)
    assert check.verdict == verify.Verdict.PASSED, check
