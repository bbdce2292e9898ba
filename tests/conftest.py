"""Shared test helpers: run the real CLI as a subprocess (`cli`), or in this process (`inline`:
tests/support/inline.py), against the loopback scripted server.

Nothing here is mocked: the model is `tests/support/scripted_server.py` on 127.0.0.1, the sandboxes
are real. Every run's output and HOME live under the test's tmp_path.
"""
from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import session as shared
from tests.support.inline import ROOT, Runs, inline  # noqa: F401  (ROOT: public name; inline: fixture)
from tests.support.scripted_server import scripted_server  # noqa: F401  (fixture)
from trajgen.sandbox.roots import MNT_DETACH


# One event loop for the whole session, as a worker has one: a sandbox's command loop lives across
# calls, and its pipes must not outlive the loop they belong to (asyncio.run per call closes it).
_runner = asyncio.Runner()
libc = ctypes.CDLL(None, use_errno=True)


def arun(coro):
    """Run a coroutine on the session's event loop."""
    return _runner.run(coro)


@pytest.fixture(scope="session", autouse=True)
def _one_loop():
    yield
    gc.collect()  # sandboxes the tests dropped release their pipes while the loop is still open
    _runner.close()


def mount_points(pid: int | str, under: tuple[str, ...]) -> set[str]:
    """The mount points under any of the dirs `under` (each ending in /) in process `pid`'s mount table."""
    try:
        table = Path(f"/proc/{pid}/mountinfo").read_text()
    except OSError:
        return set()
    return {point for line in table.splitlines() if (point := line.split()[4]).startswith(under)}


@pytest.fixture(autouse=True)
def _nothing_left_mounted(request):
    """Unmount what a test's sandboxes left mounted under its tmp_path (work dirs and PTY instances of
    sandboxes opened without their run's cleanup): bubblewrap reads the whole mount table at every
    bind, so mounts left over from past sessions made every later sandbox on the machine slower."""
    yield
    tmp = request.node.funcargs.get("tmp_path")
    if tmp is None:
        return
    for point in sorted(mount_points("self", (os.path.realpath(tmp) + "/",)), reverse=True):  # the deepest first
        libc.umount2(point.encode(), MNT_DETACH)


def pytest_configure(config) -> None:
    shared.begin(config)


def pytest_collection_finish(session) -> None:
    """Start the Ray end-to-end tests as soon as they are collected: they mostly wait on Ray, and the
    other tests run meanwhile (tests/test_ray.py)."""
    ray_tests = sys.modules.get("tests.test_ray")  # imported if collected
    if ray_tests and any(item.nodeid == ray_tests.END_TO_END for item in session.items):
        ray_tests.start_inner_run()


def pytest_unconfigure(config) -> None:
    if shared.is_controller(config):  # every pytest-xdist worker has ended
        shared.end()


def think(text: str = "thinking") -> dict:
    """A final reply with reasoning, so the sample is kept under the default --require_reasoning."""
    return {"content": text, "reasoning": "let me think"}


def call(name: str, reasoning: str = "I need a tool", **arguments) -> dict:
    return {"tool_calls": [{"name": name, "arguments": arguments}], "reasoning": reasoning}


# The CLI under test must get Ctrl-C as a terminal gives it. A pytest started in the background by a
# shell without job control starts with SIGINT ignored, and an ignored signal stays ignored across
# exec; a handler does not, so with one here every child starts with the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def tool_outputs(row: dict) -> list[dict]:
    """Each tool result of a row, in order (the content inside its <tool_response> envelope)."""
    return [json.loads(t["value"].removeprefix("<tool_response>\n").removesuffix("\n</tool_response>"))["content"]
            for t in row["conversations"] if t["from"] == "tool"]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class CLI(Runs):
    """`python batch_runner.py ...` in tmp_path, with a clean environment."""

    def command(self, *args: str) -> list[str]:
        return [sys.executable, str(ROOT / "batch_runner.py"), *args]

    def run(self, *args: str, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*args), cwd=self.cwd, env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout)

    def start(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(self.command(*args), cwd=self.cwd, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.fixture
def cli(tmp_path) -> CLI:
    return CLI(tmp_path)


def kill_group(process: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    os.killpg(process.pid, sig)
    process.wait(timeout=60)


def in_terminal(argv: list[str], cwd: Path, env: dict, deadline: float = 120) -> tuple[int | None, str]:
    """Run `argv` on a pseudo-terminal, as a user at a terminal would (a pager, a live progress bar);
    (its exit status, None if still running after `deadline` seconds, and everything it printed)."""
    main, child = pty.openpty()
    os.set_blocking(main, False)
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdin=child, stdout=child, stderr=child, start_new_session=True)
    os.close(child)
    output, until = b"", time.monotonic() + deadline
    try:
        while process.poll() is None and time.monotonic() < until:
            select.select([main], [], [], 0.2)
            output += _drain(main)
        code = process.poll()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        output += _drain(main)
        os.close(main)
    return code, output.decode(errors="replace").replace("\r\n", "\n")


def _drain(fd: int) -> bytes:
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # nothing now (EAGAIN), or the child side is closed (EIO)
            return data
        if not chunk:
            return data
        data += chunk
