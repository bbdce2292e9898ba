#!/usr/bin/env python
"""What a per-prompt MCP server costs: the first call of a prompt (the server's start inside the
prompt's local sandbox, the handshake, the call) against the calls after it, for mcp-server-time
and mcp-server-git, in process, the way a worker makes them. Also the probe of both at a run's start.

    python bench/mcp_start.py --prompts=10

Prints medians (wall time; the machine is shared, so also the load average at the end).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

from trajgen.sandbox import SandboxConfig
from trajgen.sandbox.backends import open_sandbox
from trajgen.tools import ToolContext, ToolSettings, mcp
from trajgen.tools.mcp_config import Server

SERVERS = (Server("time", sys.executable, ("-m", "mcp_server_time", "--local-timezone=UTC")),
           Server("git", sys.executable, ("-m", "mcp_server_git")))
CALLS = {"get_current_time": {"timezone": "UTC"}, "git_status": {"repo_path": "/workspace"}}


async def prompt(config: SandboxConfig, key: str, tool, arguments: dict, warm_calls: int) -> tuple[float, list[float]]:
    """(the first call's seconds, each later call's seconds) of one prompt."""
    box = open_sandbox(config, key)

    async def sandbox():
        return box

    ctx = ToolContext(sandbox=sandbox, settings=ToolSettings(tool_timeout=120))
    if tool.toolset == "git":
        await box.run("git init -q .", 30)
    times = []
    for _ in range(1 + warm_calls):
        started = time.perf_counter()
        result = await tool.fn(ctx, **arguments)
        times.append(time.perf_counter() - started)
        assert result["success"], result
    for cleanup in ctx.cleanups:
        await cleanup()
    await box.close()
    return times[0], times[1:]


async def main(prompts: int, warm_calls: int) -> None:
    config = SandboxConfig(root_dir=tempfile.mkdtemp(prefix="mcp-bench-"))
    started = time.perf_counter()
    tools = {t.name: t for t in await mcp.probe(SERVERS, config, 120, False)}
    print(f"probe of {len(SERVERS)} servers: {time.perf_counter() - started:.2f} s, {len(tools)} tools")
    print("| server | tool | prompts | first call (start + handshake + call), median | later calls, median |")
    print("|---|---|---|---|---|")
    for name, arguments in CALLS.items():
        firsts, warms = [], []
        for i in range(prompts):
            first, later = await prompt(config, f"{name}-{i}", tools[name], arguments, warm_calls)
            firsts.append(first)
            warms += later
        print(f"| {tools[name].toolset} | {name} | {prompts} | {statistics.median(firsts) * 1000:.0f} ms | "
              f"{statistics.median(warms) * 1000:.1f} ms |")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--warm-calls", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.prompts, args.warm_calls))
