"""Per-prompt sandboxes: where the model's commands and file edits happen.

A backend builds one sandbox per prompt, lazily, at the prompt's first tool call; the
conversation closes it when the prompt ends. Every backend returns plain data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class ExecResult:
    output: str  # stdout and stderr interleaved, already capped (head and tail kept)
    exit_code: int | None  # None when the command did not finish (timeout, sandbox fault)
    error: str | None = None  # why the command did not finish; None for a normal exit


class SandboxError(Exception):
    """The sandbox itself failed (could not start, image missing, path refused)."""


class Sandbox(Protocol):
    cwd: str  # the working directory as the model sees it

    async def run(self, command: str, timeout: float) -> ExecResult: ...

    async def read_file(self, path: str) -> bytes: ...

    async def write_file(self, path: str, data: bytes) -> None: ...

    async def close(self) -> None: ...
