"""The `terminal` tool: one shell command in the prompt's sandbox.

A non-zero exit code is an ordinary result (success=True); success=False means the command
did not finish (timeout) or the sandbox failed, or the arguments were unusable.
"""
from __future__ import annotations

from trajgen.sandbox import SandboxError
from trajgen.tools import ToolContext, ToolSpec


def _failure(error: str) -> dict:
    return {"output": "", "exit_code": None, "error": error, "success": False}


async def terminal(ctx: ToolContext, command: str, timeout: int | None = None) -> dict:
    """Its arguments' types and bounds were checked against its schema (trajgen/registry.py)."""
    if not command.strip():
        return _failure("`command` must be a non-empty string")
    limit = min(timeout, ctx.command_timeout) if timeout else ctx.command_timeout
    try:
        result = await (await ctx.sandbox()).run(command, limit)
    except SandboxError as e:
        return _failure(f"sandbox error: {e}")
    return {"output": result.output, "exit_code": result.exit_code, "error": result.error, "success": result.error is None}


TOOLS = [
    ToolSpec(
        name="terminal",
        toolset="terminal",
        description=(
            "Run a shell command (bash when available) in your sandbox and return its combined stdout and "
            "stderr and exit code. Each call starts a new shell in the working directory: files persist "
            "between calls, `cd` and variables do not. Stdin is empty (no interactive input); long output is "
            "cut in the middle."
        ),
        parameters={
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The shell command to run."},
                "timeout": {
                    "type": "integer",
                    "minimum": 1,
                    "description": "Seconds before the command and its children are killed (capped at the run's limit).",
                },
            },
            "required": ["command"],
            "additionalProperties": False,
        },
        fn=terminal,
    )
]
