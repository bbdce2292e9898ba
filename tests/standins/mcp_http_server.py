"""A small MCP server on 127.0.0.1:<port> (argv[1]) over streamable HTTP at /mcp, or SSE at /sse
when argv[2] is `sse`, for the `url` path's tests: a text tool, a tool whose result is an image
and one whose result is larger than the runner's cap, built with the official SDK."""
from __future__ import annotations

import base64
import sys

from mcp.server.mcpserver import Image, MCPServer

# a 1x1 red PNG
RED_PIXEL = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg==")

server = MCPServer("test-docs")


@server.tool(description="Look a word up.")
def lookup(word: str) -> str:
    return f"{word}: model context protocol"


@server.tool(description="A picture of one red pixel.")
def red_pixel() -> Image:
    return Image(data=RED_PIXEL, format="png")


@server.tool(description="Far too much text.")
def flood() -> str:
    return "x" * 60_000


if __name__ == "__main__":
    transport = "sse" if sys.argv[2:] == ["sse"] else "streamable-http"
    server.run(transport=transport, host="127.0.0.1", port=int(sys.argv[1]))
