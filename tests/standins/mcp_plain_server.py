"""A stdio MCP server of the standard library only, as a user writes one (`python3 ~/server.py`) or
packages one for uvx: no SDK to install, so it runs from a bare venv, a home directory or a wheel of
its own (tests/test_mcp_start.py). Its one tool, `where`, answers the server's Python and working
directory."""
import json
import os
import sys


def answer(request: dict) -> dict | None:
    method, ident = request.get("method"), request.get("id")
    if ident is None:
        return None  # a notification
    if method == "initialize":
        result = {"protocolVersion": request["params"]["protocolVersion"], "capabilities": {"tools": {}},
                  "serverInfo": {"name": "plain", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": [{"name": "where", "description": "The server's Python and working directory.",
                             "inputSchema": {"type": "object", "properties": {}}}]}
    elif method == "tools/call":
        text = json.dumps({"executable": sys.executable, "prefix": sys.prefix, "cwd": os.getcwd()})
        result = {"content": [{"type": "text", "text": text}], "isError": False}
    else:
        return {"jsonrpc": "2.0", "id": ident, "error": {"code": -32601, "message": f"no method {method}"}}
    return {"jsonrpc": "2.0", "id": ident, "result": result}


def main() -> None:
    for line in sys.stdin:
        if line.strip() and (reply := answer(json.loads(line))) is not None:
            print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
