"""A small MCP server on 127.0.0.1:<port> (argv[1]) over streamable HTTP at /mcp, or SSE at /sse
when argv[2] is `sse`, for the `url` path's tests: a text tool, a tool whose result is an image
and one whose result is larger than the runner's cap, built with the official SDK. With
MCP_TEST_TOKEN set, a request without `Authorization: Bearer <that token>` gets a 401."""
from __future__ import annotations

import base64
import os
import sys

import uvicorn
from mcp.server.mcpserver import Image, MCPServer
from starlette.responses import PlainTextResponse

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


def bearer_only(app, token: str):
    """`app` answering 401 to an HTTP request that lacks the token."""
    async def guarded(scope, receive, send) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != f"Bearer {token}".encode():
            await PlainTextResponse("a bearer token is needed", status_code=401)(scope, receive, send)
        else:
            await app(scope, receive, send)
    return guarded


if __name__ == "__main__":
    app = server.sse_app() if sys.argv[2:] == ["sse"] else server.streamable_http_app()
    token = os.environ.get("MCP_TEST_TOKEN")
    uvicorn.run(bearer_only(app, token) if token else app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
