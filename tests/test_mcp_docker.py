"""An MCP stdio server in the docker backend: an image holding the server's command (the host's
Python with the servers, tests/support/mcp_image.py; no network)."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import call, read_jsonl, think, tool_outputs, write_jsonl

pytest_plugins = ["tests.dockerd", "tests.support.mcp_image"]


def test_docker_backend_runs_the_server_in_the_prompts_container(cli, scripted_server, mcp_image):
    (cli.cwd / "mcp.json").write_text(json.dumps({"mcpServers": {"time": {
        "command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone=UTC"]}}}))
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": "what time is it"}])
    with scripted_server({"default": [call("get_current_time", timezone="Asia/Tokyo"), think("late")]}) as server:
        done = cli.run(*cli.args(server, mcp_config="mcp.json", toolsets="time", terminal_backend="docker",
                                 docker_image=mcp_image))
    assert done.returncode == 0, done.stderr
    [row] = read_jsonl(cli.run_dir() / "trajectories.jsonl")
    [result] = tool_outputs(row)
    assert result["success"] and result["structured_content"]["timezone"] == "Asia/Tokyo"
    probes = subprocess.run(["docker", "ps", "-aq", "--filter", "label=trajgen.key=mcp-probe-time"],
                            capture_output=True, text=True, check=True)
    assert probes.stdout.strip() == ""  # the probe's container went with its sandbox
