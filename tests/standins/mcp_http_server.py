"""A small MCP server over streamable HTTP on 127.0.0.1:<port> (argv[1]), for the `url` path's
tests: a text tool and a tool whose result is an image, built with the official SDK."""
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


if __name__ == "__main__":
    server.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
