"""The `file` toolset: read, write, patch and search files in the prompt's sandbox.

Reads and writes go through the sandbox (host-side and path-checked for the local backend);
the search runs inside it. Files are streamed, never loaded whole: read_file keeps only the
window of lines it shows, patch refuses files over MAX_PATCH_BYTES, so no file a model makes can
fill the worker's memory. A model's bad arguments (their types and bounds checked against each
tool's schema by trajgen/registry.py's dispatch) or a refused path come back as success=False
with a message, never as an exception.
"""
from __future__ import annotations

import re
import shlex
from contextlib import aclosing
from dataclasses import dataclass, field

from trajgen.sandbox import Sandbox, SandboxError, read_file as read_whole
from trajgen.tools import ToolContext, ToolSpec

MAX_READ_CHARS = 100_000
MAX_LINE_CHARS = 2_000  # a minified file's one line must not eat the whole read
MAX_PATCH_BYTES = 8 * 1024 * 1024
BINARY_PROBE = 8192
DEFAULT_LIMIT = 500
MAX_MATCHES = 200
MATCH_LINE = re.compile(r"^.+?:\d+:")


def _fail(error: str) -> dict:
    return {"success": False, "error": error}


def _empty(**strings: str) -> str | None:
    """The first of `strings` that is empty, as an error (their types were checked against the schema)."""
    for name, value in strings.items():
        if not value:
            return f"`{name}` must be a non-empty string"
    return None


@dataclass
class _Window:
    """Lines offset..offset+limit-1 of a stream, each cut at MAX_LINE_CHARS, within MAX_READ_CHARS in all."""

    offset: int
    limit: int
    shown: list[str] = field(default_factory=list)
    size: int = 0
    full: bool = False  # MAX_READ_CHARS reached: later lines are counted, not kept
    lines: int = 0  # complete lines seen
    line: bytearray = field(default_factory=bytearray)  # the current line's first bytes
    line_bytes: int = 0

    def feed(self, chunk: bytes) -> None:
        while chunk:
            if not self._showing():  # lines outside the window are only counted, at C speed
                chunk = self._skip(chunk)
                continue
            end = chunk.find(b"\n")
            if end == -1:
                self._take(chunk)
                return
            self._take(chunk[:end])
            self._finish()
            chunk = chunk[end + 1:]

    def _showing(self) -> bool:
        return self.offset <= self.lines + 1 < self.offset + self.limit and not self.full

    def _skip(self, chunk: bytes) -> bytes:
        """Count the lines of `chunk` up to the window's first line; the rest of the chunk is returned."""
        before = self.offset - 1 - self.lines
        if before <= 0 or chunk.count(b"\n") < before:
            newlines = chunk.count(b"\n")
            self.lines += newlines
            self.line_bytes = len(chunk) - chunk.rfind(b"\n") - 1 if newlines else self.line_bytes + len(chunk)
            return b""
        end = -1
        for _ in range(before):
            end = chunk.find(b"\n", end + 1)
        self.lines += before
        self.line_bytes = 0
        return chunk[end + 1:]

    def _take(self, piece: bytes) -> None:
        self.line_bytes += len(piece)
        if len(self.line) <= MAX_LINE_CHARS * 4:  # up to 4 bytes a character
            self.line += piece[: MAX_LINE_CHARS * 4 + 1 - len(self.line)]

    def _finish(self) -> None:
        if self._showing():
            line = self.line.decode("utf-8", "replace")
            if len(line) > MAX_LINE_CHARS or self.line_bytes > len(self.line):
                line = line[:MAX_LINE_CHARS] + f" [... line cut, {self.line_bytes} bytes]"
            text = f"{self.lines + 1:6d}|{line}\n"
            if self.size + len(text) > MAX_READ_CHARS:
                self.full = True
            else:
                self.shown.append(text)
                self.size += len(text)
        self.lines += 1
        self.line.clear()
        self.line_bytes = 0

    def end(self) -> None:
        if self.line_bytes:  # a last line without a newline
            self._finish()


async def _read_window(sandbox: Sandbox, path: str, window: _Window) -> bool:
    """Stream the file through `window`; False if it looks binary (a NUL in its first bytes)."""
    first = True
    async with aclosing(sandbox.read_chunks(path)) as chunks:
        async for chunk in chunks:
            if first and b"\0" in chunk[:BINARY_PROBE]:
                return False
            first = False
            window.feed(chunk)
    window.end()
    return True


async def read_file(ctx: ToolContext, path: str, offset: int = 1, limit: int = DEFAULT_LIMIT) -> dict:
    if error := _empty(path=path):
        return _fail(error)
    window = _Window(offset, limit)
    try:
        if not await _read_window(await ctx.sandbox(), path, window):
            return _fail(f"{path} looks binary; not shown")
    except SandboxError as e:
        return _fail(str(e))
    if offset > max(window.lines, 1):
        return _fail(f"offset {offset} is past the end of {path} ({window.lines} lines)")
    end = offset + len(window.shown) - 1
    truncated = end < window.lines
    return {
        "success": True, "error": None, "content": "".join(window.shown), "total_lines": window.lines,
        "truncated": truncated, "next_offset": end + 1 if truncated else None,
    }


async def write_file(ctx: ToolContext, path: str, content: str) -> dict:
    if error := _empty(path=path):
        return _fail(error)
    data = content.encode("utf-8")
    try:
        await (await ctx.sandbox()).write_file(path, data)
    except SandboxError as e:
        return _fail(str(e))
    return {"success": True, "error": None, "bytes_written": len(data)}


async def patch(
    ctx: ToolContext, path: str, old_string: str, new_string: str, replace_all: bool = False
) -> dict:
    if error := _empty(path=path, old_string=old_string):
        return _fail(error)
    try:
        sandbox = await ctx.sandbox()
        text = (await read_whole(sandbox, path, MAX_PATCH_BYTES)).decode("utf-8")
        count = text.count(old_string)
        if count == 0:
            return _fail(f"old_string not found in {path}; nothing changed")
        if count > 1 and not replace_all:
            return _fail(
                f"old_string occurs {count} times in {path}; include more surrounding text to make it "
                "unique, or set replace_all to replace every occurrence"
            )
        await sandbox.write_file(path, text.replace(old_string, new_string).encode("utf-8"))
    except SandboxError as e:
        return _fail(str(e))
    except UnicodeDecodeError:
        return _fail(f"{path} is not UTF-8 text; patch cannot edit it")
    return {"success": True, "error": None, "replacements": count}


def _search_command(pattern: str, path: str, file_glob: str | None) -> str:
    """ripgrep when the sandbox has it, else find + grep -E (busybox has no --include)."""
    q = shlex.quote
    path = "./" + path if path.startswith("-") else path  # never let find read it as an expression
    rg_glob = f" --glob {q(file_glob)}" if file_glob else ""
    find_glob = f" -name {q(file_glob)}" if file_glob else ""
    rg = f"rg --line-number --with-filename --no-heading --color never{rg_glob} -e {q(pattern)} -- {q(path)}"
    grep = f"find {q(path)} -type f{find_glob} -exec grep -nHIE -e {q(pattern)} -- {{}} +"
    return f"if command -v rg >/dev/null 2>&1; then {rg}; else {grep}; fi 2>&1 | head -n {MAX_MATCHES + 1}"


async def search_files(ctx: ToolContext, pattern: str, path: str = ".", file_glob: str | None = None) -> dict:
    if error := _empty(pattern=pattern, path=path):
        return _fail(error)
    if file_glob == "":
        return _fail("`file_glob` must be a non-empty string such as '*.py'")
    try:
        sandbox = await ctx.sandbox()
        check_path = getattr(sandbox, "check_path", None)  # backends whose boundary is the work dir
        if check_path:
            check_path(path)
        result = await sandbox.run(_search_command(pattern, path, file_glob), ctx.command_timeout)
    except SandboxError as e:
        return _fail(str(e))
    if result.error:
        return _fail(f"search failed: {result.error}")
    lines = result.output.splitlines()
    matches = [line for line in lines if MATCH_LINE.match(line)][:MAX_MATCHES]
    other = [line for line in lines if not MATCH_LINE.match(line)]
    if other and not matches:
        return _fail("search failed: " + "\n".join(other[:10]))
    return {
        "success": True, "error": None, "matches": "\n".join(line[:MAX_LINE_CHARS] for line in matches),
        "count": len(matches), "truncated": len(lines) > MAX_MATCHES, "warnings": "\n".join(other[:10]) or None,
    }


def _schema(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


PATH = {"type": "string", "description": "File path, relative to the working directory or absolute inside it."}

TOOLS = [
    ToolSpec(
        name="read_file",
        toolset="file",
        description="Read a text file with line numbers (`     1|text`), a window of lines at a time.",
        parameters=_schema(
            {
                "path": PATH,
                "offset": {"type": "integer", "minimum": 1, "description": "First line to show, 1-based (default 1)."},
                "limit": {"type": "integer", "minimum": 1, "description": f"How many lines to show (default {DEFAULT_LIMIT})."},
            },
            ["path"],
        ),
        fn=read_file,
    ),
    ToolSpec(
        name="write_file",
        toolset="file",
        description="Create or overwrite a file with the given content; missing parent directories are created.",
        parameters=_schema(
            {"path": PATH, "content": {"type": "string", "description": "The complete new content of the file."}},
            ["path", "content"],
        ),
        fn=write_file,
    ),
    ToolSpec(
        name="patch",
        toolset="file",
        description="Replace an exact piece of text in a file; it must occur exactly once unless replace_all is set.",
        parameters=_schema(
            {
                "path": PATH,
                "old_string": {"type": "string", "description": "The exact text to replace, whitespace included."},
                "new_string": {"type": "string", "description": "The text to put in its place."},
                "replace_all": {"type": "boolean", "description": "Replace every occurrence (default false)."},
            },
            ["path", "old_string", "new_string"],
        ),
        fn=patch,
    ),
    ToolSpec(
        name="search_files",
        toolset="file",
        description=f"Search file contents with a regular expression; returns up to {MAX_MATCHES} `path:line:text` matches.",
        parameters=_schema(
            {
                "pattern": {"type": "string", "description": "Regular expression (extended syntax) to look for."},
                "path": {"type": "string", "description": "File or directory to search (default: the working directory)."},
                "file_glob": {"type": "string", "description": "Only search files whose name matches this glob, e.g. '*.py'."},
            },
            ["pattern"],
        ),
        fn=search_files,
    ),
]
