#!/usr/bin/env python
"""What a flood of output from a stdio MCP server costs the worker reading it: the wall time of a
call whose result is --megabytes large, and the reading process's peak RSS over its RSS before
the call (VmHWM, reset through /proc/self/clear_refs), in process, as a worker calls it, with the
server (tests/standins/mcp_stdio_server.py) in the prompt's local sandbox.

    python bench/mcp_flood.py --megabytes=60

The call fails either way (past the runner's caps): what counts is how long it takes and what it holds.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

from trajgen.sandbox import SandboxConfig
from trajgen.sandbox.backends import open_sandbox
from trajgen.tools import ToolContext, ToolSettings, mcp
from trajgen.tools.mcp_config import Server

SOURCE = (Path(__file__).parent.parent / "tests" / "standins" / "mcp_stdio_server.py").read_text()


def peak_mb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) >> 10


async def main(megabytes: int) -> None:
    config = SandboxConfig(root_dir=tempfile.mkdtemp(prefix="mcp-flood-"))
    [tool] = [t for t in await mcp.probe((Server("io", sys.executable, ("-c", SOURCE)),), config, 600, False)
              if t.name == "deluge"]
    box = open_sandbox(config, "flood")

    async def sandbox():
        return box

    ctx = ToolContext(sandbox=sandbox, settings=ToolSettings(tool_timeout=600))
    assert (await tool.fn(ctx, megabytes=0))["success"]  # the server started: only the flood is timed
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = peak_mb()
    started = time.perf_counter()
    result = await tool.fn(ctx, megabytes=megabytes)
    print(f"{megabytes} MB result: {time.perf_counter() - started:.1f} s, peak RSS {peak_mb()} MB "
          f"({peak_mb() - before} MB over {before} MB); {result['error']}")
    for cleanup in ctx.cleanups:
        await cleanup()
    await box.close()
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=60)
    asyncio.run(main(parser.parse_args().megabytes))
