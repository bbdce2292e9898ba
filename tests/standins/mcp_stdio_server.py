"""A small MCP stdio server, built with the official SDK, for the stdio path's bounds (tests/test_mcp.py):
a tool answering a variable of its environment, one whose result is as many megabytes as asked, and
one that writes as many to its stderr, then exits with a last line. Run as `python -c SOURCE`: a
local sandbox sees no file of the tests."""
import os
import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("test-stdio")


@server.tool(description="The value of a variable of the server's environment.")
def variable(name: str) -> str:
    return os.environ.get(name, "")


@server.tool(description="A result of that many megabytes.")
def deluge(megabytes: int) -> str:
    return "x" * (megabytes << 20)


@server.tool(description="That many megabytes of stderr, then the end.")
def babble(megabytes: int) -> str:
    line = "babble " * 146 + "\n"
    for _ in range((megabytes << 20) // len(line)):
        sys.stderr.write(line)
    sys.stderr.write("the last words\n")
    sys.stderr.flush()
    os._exit(3)


server.run("stdio")
