"""The terminal and file tools over real sandboxes: what the model gets back, and what it cannot reach."""
from __future__ import annotations

import orjson
import pytest

from trajgen.registry import REGISTRY, dispatch
from trajgen.sandbox.backends import SandboxConfig, bwrap_problem, cleanup, open_sandbox
from trajgen.tools import ToolContext
from trajgen.tools.files import MAX_MATCHES, patch, read_file, search_files, write_file
from trajgen.tools.terminal import terminal
from tests.conftest import arun

pytest_plugins = ["tests.dockerd"]

needs_bwrap = pytest.mark.skipif(bwrap_problem() is not None, reason=f"bubblewrap cannot run here: {bwrap_problem()}")


def context(sandbox, command_timeout: float = 30) -> ToolContext:
    async def get():
        return sandbox

    return ToolContext(sandbox=get, command_timeout=command_timeout)


def call(fn, ctx, **arguments) -> dict:
    """As the model calls it: the arguments checked against the tool's schema first."""
    return arun(dispatch(fn.__name__, orjson.dumps(arguments).decode(), REGISTRY, ctx))


@pytest.fixture
def ctx(tmp_path):
    config = SandboxConfig(root_dir=str(tmp_path / "sb"))
    yield context(open_sandbox(config, "p1", None, None))
    cleanup(config)


pytestmark = needs_bwrap


def test_terminal_reports_exit_codes_timeouts_and_bad_arguments(ctx):
    failed = call(terminal, ctx, command="echo out; echo err >&2; exit 3")
    assert failed == {"output": "out\nerr\n", "exit_code": 3, "error": None, "success": True}
    slow = call(terminal, ctx, command="sleep 30", timeout=1)
    assert slow["success"] is False and slow["exit_code"] is None
    assert slow["error"] == "timed out after 1 s; the command and its children were killed"
    strict = ToolContext(sandbox=ctx.sandbox, command_timeout=1)
    capped = call(terminal, strict, command="sleep 3", timeout=3600)  # a model cannot raise the run's limit
    assert capped["error"] == "timed out after 1 s; the command and its children were killed"
    for bad in ({"command": ""}, {"command": 5}, {}, {"command": "ls", "timeout": 0},
                {"command": "ls", "timeout": "10"}, {"command": "ls", "timeout": True}):
        result = call(terminal, ctx, **bad)
        assert result["success"] is False and result["error"]


def test_read_file_numbers_lines_and_pages(ctx):
    call(write_file, ctx, path="notes.txt", content="".join(f"line {i}\n" for i in range(1, 11)))
    first = call(read_file, ctx, path="notes.txt", limit=3)
    assert first["content"] == "     1|line 1\n     2|line 2\n     3|line 3\n"
    assert (first["total_lines"], first["truncated"], first["next_offset"]) == (10, True, 4)
    rest = call(read_file, ctx, path="/workspace/notes.txt", offset=9)
    assert rest["content"] == "     9|line 9\n    10|line 10\n" and rest["truncated"] is False
    assert call(read_file, ctx, path="notes.txt", offset=11)["success"] is False
    assert "No such file" in call(read_file, ctx, path="absent.txt")["error"]
    for bad in ({"path": ""}, {"path": 3}, {"path": "notes.txt", "offset": 0}, {"path": "notes.txt", "limit": "5"}):
        assert call(read_file, ctx, **bad)["success"] is False


def test_read_file_caps_its_content(ctx):
    call(terminal, ctx, command="for i in $(seq 3000); do printf '%0100d\\n' $i; done > wide.txt")
    call(terminal, ctx, command="head -c 50000 /dev/zero | tr '\\0' y > one-line.txt")
    wide = call(read_file, ctx, path="wide.txt", limit=3000)
    assert len(wide["content"]) <= 100_000 and wide["truncated"] and wide["next_offset"] < 3000
    one = call(read_file, ctx, path="one-line.txt")
    assert "line cut, 50000 bytes" in one["content"]


def test_write_file_creates_directories_and_reports_bytes(ctx):
    result = call(write_file, ctx, path="deep/er/file.txt", content="héllo\n")
    assert result == {"success": True, "error": None, "bytes_written": 7}
    assert call(terminal, ctx, command="cat deep/er/file.txt")["output"] == "héllo\n"
    assert call(write_file, ctx, path="x.txt", content=None)["success"] is False


def test_patch_replaces_unique_text_and_explains_failures(ctx):
    call(write_file, ctx, path="code.py", content="a = 1\nb = 1\nc = 1\nprint(a)\n")
    missing = call(patch, ctx, path="code.py", old_string="zzz", new_string="y")
    assert missing["success"] is False and "not found" in missing["error"]
    ambiguous = call(patch, ctx, path="code.py", old_string="= 1", new_string="= 2")
    assert ambiguous["success"] is False and "occurs 3 times" in ambiguous["error"]
    assert call(patch, ctx, path="code.py", old_string="print(a)", new_string="print(b)")["replacements"] == 1
    assert call(patch, ctx, path="code.py", old_string="= 1", new_string="= 2", replace_all=True)["replacements"] == 3
    assert call(terminal, ctx, command="cat code.py")["output"] == "a = 2\nb = 2\nc = 2\nprint(b)\n"
    assert call(patch, ctx, path="code.py", old_string="", new_string="x")["success"] is False


def test_search_files_finds_filters_and_caps(ctx):
    call(write_file, ctx, path="src/app.py", content="def main():\n    return 42\n")
    call(write_file, ctx, path="src/notes.txt", content="main idea\n")
    call(write_file, ctx, path="-dash/x.py", content="def main(): pass\n")
    found = call(search_files, ctx, pattern=r"def\s+main")
    assert found["success"] and found["count"] == 2
    assert "src/app.py:1:def main():" in found["matches"]
    only_txt = call(search_files, ctx, pattern="main", path="src", file_glob="*.txt")
    assert only_txt["matches"] == "src/notes.txt:1:main idea"
    assert call(search_files, ctx, pattern="main", path="-dash")["count"] == 1
    assert call(search_files, ctx, pattern="nowhere-to-be-found") | {"matches": ""} == {
        "success": True, "error": None, "matches": "", "count": 0, "truncated": False, "warnings": None}
    assert call(search_files, ctx, pattern="(unclosed")["success"] is False
    call(terminal, ctx, command="seq 1000 > many.txt")
    many = call(search_files, ctx, pattern="[0-9]", path="many.txt")
    assert many["count"] == MAX_MATCHES and many["truncated"] is True


def test_every_escaping_path_is_refused(ctx):
    call(terminal, ctx, command="ln -s /etc/passwd link && ln -s /etc etc-link")
    for path in ("/etc/passwd", "../x", "sub/../../x", "link", "etc-link/passwd", "/workspace/../etc/hosts"):
        results = [
            call(read_file, ctx, path=path),
            call(write_file, ctx, path=path, content="x"),
            call(patch, ctx, path=path, old_string="root", new_string="toor"),
        ]
        assert all(r["success"] is False and r["error"] for r in results), (path, results)
    for path in ("/etc", "..", "etc-link"):
        refused = call(search_files, ctx, pattern="root", path=path)
        assert refused["success"] is False and "outside the work dir" in refused["error"]


def test_search_falls_back_to_grep_without_ripgrep(tmp_path, docker_engine, busybox_image):
    config = SandboxConfig(backend="docker", root_dir=str(tmp_path / "sb"))
    sandbox = open_sandbox(config, "p1", busybox_image, None)
    ctx = context(sandbox)
    try:
        call(write_file, ctx, path="src/app.py", content="def main():\n    return 42\n")
        call(write_file, ctx, path="src/notes.txt", content="main idea\n")
        found = call(search_files, ctx, pattern="main", file_glob="*.py")
        bad = call(search_files, ctx, pattern="(unclosed")
    finally:
        cleanup(config)
    assert found["matches"] == "./src/app.py:1:def main():"
    assert bad["success"] is False
