"""MCP servers as toolsets, with real servers from PyPI (mcp-server-git, mcp-server-time) in real
local sandboxes, and a streamable-HTTP server of our own on 127.0.0.1 for the `url` path.

In-process tests drive trajgen/tools/mcp.py as a worker does (faults, restarts, timeouts, results
that are not text); run tests run the CLI against the scripted model, in process (`inline`) unless a runner is killed.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import arun, call, read_jsonl, think, write_jsonl
from trajgen.errors import UsageError
from trajgen import verify
from trajgen.sandbox import SandboxConfig, SandboxError, cgroups, read_file, stdio
from trajgen.sandbox.backends import bwrap_problem, cleanup, open_sandbox
from trajgen.tools import ToolContext, ToolSettings
from trajgen import trajectory
from trajgen.tools import mcp, mcp_config

pytest.importorskip("mcp_server_git")
pytest.importorskip("mcp_server_time")
pytestmark = pytest.mark.skipif(bwrap_problem() is not None, reason=f"bubblewrap cannot run here: {bwrap_problem()}")

GIT = {"command": sys.executable, "args": ["-m", "mcp_server_git"]}
TIME = {"command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone=UTC"]}
HTTP_SERVER = Path(__file__).parent / "standins" / "mcp_http_server.py"
TOKEN = "tok-7f3e9a1c-secret"  # a header's value: a secret, which no file or output of a run may hold
SECRET = "env-5b0d2e7a-secret"  # a config env value: on no command line
# tests/standins/mcp_stdio_server.py, its source on the command line: a sandbox sees no file of the tests
STDIO_SERVER = Path(__file__).parent / "standins" / "mcp_stdio_server.py"
STDIO = {"command": sys.executable, "args": ["-c", STDIO_SERVER.read_text()], "env": {"SERVICE_KEY": SECRET}}


def descendants(pid: int) -> list[int]:
    """The process tree under `pid` (this test's own processes, never the machine's)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def peak_rss_mb() -> int:
    """This process's peak resident memory since the last reset_peak_rss()."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) >> 10


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def servers_under(pid: int, module: str) -> list[int]:
    """The python processes of `module` in the tree under `pid` (not bwrap, prlimit or the shell)."""
    return [p for p in descendants(pid) if cmdline(p).startswith(sys.executable) and f"-m {module}" in cmdline(p)]


def wait_for(condition, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


def settle(condition, what: str, timeout: float = 60) -> None:
    """wait_for with the event loop running, as it always runs in a worker."""
    async def poll() -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.05)
    arun(poll())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def sandbox_config(tmp_path) -> Iterator[SandboxConfig]:
    config = SandboxConfig(root_dir=str(tmp_path / "sandboxes"), command_timeout=30)
    yield config
    cleanup(config)  # the kept slots' uids, groups and PTY instances, as a run's end gives them up


def probe(config: SandboxConfig, tool_timeout: float = 60, allow_private: bool = False, **servers) -> dict:
    entries = tuple(mcp_config._server("test", name, entry) for name, entry in servers.items())
    return {t.name: t for t in arun(mcp.probe(entries, config, tool_timeout, allow_private))}


class Prompt:
    """One prompt's sandbox and tool context, as a worker holds them."""

    def __init__(self, config: SandboxConfig, key: str, tool_timeout: float = 60, allow_private: bool = False):
        self.box = None
        self.config, self.key = config, key
        self.ctx = ToolContext(sandbox=self.sandbox, settings=ToolSettings(tool_timeout=tool_timeout,
                                                                           allow_private_urls=allow_private))

    async def sandbox(self):
        if self.box is None:
            self.box = open_sandbox(self.config, self.key)
        return self.box

    def call(self, tool, **arguments) -> dict:
        return arun(tool.fn(self.ctx, **arguments))

    def close(self) -> None:
        async def close():
            for undo in self.ctx.cleanups:
                await undo()
            if self.box is not None:
                await self.box.close()
        arun(close())


def test_probe_reads_the_tools_and_their_schemas_verbatim(sandbox_config):
    tools = probe(sandbox_config, git=GIT, time=TIME)
    assert {"git_log", "git_status", "get_current_time", "convert_time"} <= set(tools)
    assert tools["git_log"].toolset == "git" and tools["get_current_time"].toolset == "time"
    assert "repo_path" in tools["git_log"].parameters["required"]
    assert tools["git_log"].schema()["function"]["parameters"] == tools["git_log"].parameters


def test_killed_server_fails_nothing_and_restarts_at_the_next_call(sandbox_config):
    tools = probe(sandbox_config, time=TIME)
    prompt = Prompt(sandbox_config, "killed")
    try:
        first = prompt.call(tools["get_current_time"], timezone="UTC")
        assert first["success"] and first["structured_content"]["timezone"] == "UTC"
        [server] = servers_under(os.getpid(), "mcp_server_time")
        os.kill(server, signal.SIGKILL)
        settle(lambda: prompt.ctx.state["mcp"]["time"].ended(), "the session to see its server gone")
        again = prompt.call(tools["get_current_time"], timezone="Europe/Paris")
        assert again["success"] and again["structured_content"]["timezone"] == "Europe/Paris"
        [restarted] = servers_under(os.getpid(), "mcp_server_time")
        assert restarted != server
    finally:
        prompt.close()
    assert servers_under(os.getpid(), "mcp_server_time") == []


def test_hanging_server_hits_the_tool_timeout_then_restarts(sandbox_config):
    tools = probe(sandbox_config, time=TIME)
    prompt = Prompt(sandbox_config, "hung")
    started = prompt.ctx.settings
    try:
        assert prompt.call(tools["get_current_time"], timezone="UTC")["success"]  # a start may take long here
        [server] = servers_under(os.getpid(), "mcp_server_time")
        os.kill(server, signal.SIGSTOP)
        prompt.ctx.settings = dataclasses.replace(started, tool_timeout=3)
        hung = prompt.call(tools["get_current_time"], timezone="UTC")
        assert not hung["success"] and "no answer within 3 s" in hung["error"]
        wait_for(lambda: not os.path.exists(f"/proc/{server}"), "the stopped server to be killed")
        prompt.ctx.settings = started
        assert prompt.call(tools["get_current_time"], timezone="UTC")["success"]
    finally:
        prompt.close()


def test_tool_errors_are_failed_results(sandbox_config):
    tools = probe(sandbox_config, time=TIME)
    prompt = Prompt(sandbox_config, "errors")
    try:
        bad = prompt.call(tools["get_current_time"], timezone="Not/AZone")
        assert not bad["success"] and "Not/AZone" in bad["error"]
        [server] = servers_under(os.getpid(), "mcp_server_time")
        assert not prompt.call(tools["get_current_time"], zone="UTC")["success"]
        server_spec = tools["get_current_time"].fn.args[0]  # a protocol error answers a tool it does not have
        unknown = arun(mcp.call_tool(server_spec, "no_such_tool", prompt.ctx))
        assert not unknown["success"] and unknown["error"].startswith("MCP server time: ")
        assert "starts again" not in unknown["error"]
        assert prompt.call(tools["get_current_time"], timezone="UTC")["success"]
        assert servers_under(os.getpid(), "mcp_server_time") == [server]  # the same server throughout
    finally:
        prompt.close()


def test_server_that_cannot_start_is_named_with_its_reason(sandbox_config):
    broken = {"command": sys.executable, "args": ["-c", "import sys; sys.exit('no database at /data/x.db')"]}
    with pytest.raises(mcp_config.ServerFailed, match=r"MCP server db cannot start.*no database at /data/x.db"):
        probe(sandbox_config, tool_timeout=30, db=broken)


def test_a_message_past_the_cap_is_cut_before_it_is_parsed_and_the_server_restarts(sandbox_config):
    """60 MB in one result: read no further than MESSAGE_CAP, in linear time, so the worker stays small."""
    tools = probe(sandbox_config, io=STDIO)
    prompt = Prompt(sandbox_config, "deluge")
    try:
        assert prompt.call(tools["deluge"], megabytes=0)["success"]
        first = prompt.ctx.state["mcp"]["io"]
        reset_peak_rss()
        before = peak_rss_mb()
        cut = prompt.call(tools["deluge"], megabytes=60)
        peak = peak_rss_mb()
        print(f"worker peak RSS {peak} MB ({peak - before} MB over its {before} MB) reading a 60 MB result")
        assert not cut["success"]
        assert cut["error"] == (f"MCP server io: the server sent a message of more than {mcp.MESSAGE_CAP >> 20} MB, "
                                "the cap on one message; it starts again at the next call")
        assert peak - before < 100  # the SDK's own reader: 331 MB for 40 MB
        again = prompt.call(tools["variable"], name="SERVICE_KEY")
        assert again["success"] and prompt.ctx.state["mcp"]["io"] is not first
    finally:
        prompt.close()


def test_lines_are_split_in_one_pass_and_none_held_past_the_cap():
    lines = mcp._Lines()
    assert lines.feed(b'{"a": 1}\n{"b"') == [b'{"a": 1}']
    assert lines.feed(b': 2}\n\n{"c": 3}\n') == [b'{"b": 2}', b"", b'{"c": 3}']
    for _ in range(mcp.MESSAGE_CAP // 65536):
        assert lines.feed(b"x" * 65536) == []
    with pytest.raises(mcp._TooLarge):
        lines.feed(b"x")
    with pytest.raises(mcp._TooLarge):  # whole in one chunk, newline and all
        mcp._Lines().feed(b"y" * (mcp.MESSAGE_CAP + 1) + b"\n")


def test_a_servers_stderr_is_kept_as_a_few_kb_whatever_it_writes(sandbox_config):
    tools = probe(sandbox_config, io=STDIO)
    prompt = Prompt(sandbox_config, "babble")
    try:
        assert prompt.call(tools["variable"], name="HOME")["success"]
        session = prompt.ctx.state["mcp"]["io"]
        ended = prompt.call(tools["babble"], megabytes=20)
        assert not ended["success"] and "the last words" in ended["error"]
        assert len(session.stderr._data) <= stdio.STDERR_TAIL
    finally:
        prompt.close()
    tail = stdio.Tail()
    for _ in range(1000):
        tail.add(b"noise " * 100 + b"\n")
    tail.add(b"why it failed\n\n")
    assert len(tail._data) == stdio.STDERR_TAIL and tail.line() == "why it failed"


def test_a_config_env_value_reaches_the_server_on_no_command_line(sandbox_config):
    """`ps` shows every command line to every local user: the value crosses in bubblewrap's options memfd."""
    tools = probe(sandbox_config, io=STDIO)
    prompt = Prompt(sandbox_config, "env")
    try:
        assert prompt.call(tools["variable"], name="SERVICE_KEY")["output"] == SECRET
        tree = descendants(os.getpid())
        assert any("bwrap" in cmdline(p) for p in tree)  # the server's sandbox, while it runs
        assert [cmdline(p) for p in tree if SECRET in cmdline(p)] == []
        assert prompt.call(tools["variable"], name="PWD")["output"] == "/workspace"  # not the work dir's host path
    finally:
        prompt.close()


# the red team's attack: git's fsmonitor hook, run by the git server's `git status`, starts a daemon (in the
# server's process tree, not the commands') that rewrites the checked file
DAEMON = "while :; do echo rewritten > result.txt; sleep 0.05; done\n"
HOOK = "setsid sh d.sh >/dev/null 2>&1 </dev/null &"
# the check: the file stays as it writes it, and no process it can see runs the daemon
CHECK = ("echo clean > result.txt && sleep 1 && grep -qx clean result.txt && "
         "! cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -q '[d][.]sh'")


def start_a_daemon_through_git(prompt: Prompt, tools: dict) -> None:
    """Start the daemon through the git server and see it rewrite the file."""
    box = arun(prompt.sandbox())
    made = arun(box.run(f"printf %s {shlex.quote(DAEMON)} > d.sh && git init -q . && "
                        f"git config core.fsmonitor {shlex.quote(HOOK)}", 60))
    assert made.exit_code == 0, made.output
    assert arun(box.run("sleep 60", 1)).exit_code is None  # a timeout ends the command loop: none runs at the check
    status = prompt.call(tools["git_status"], repo_path=box.cwd)
    assert status["success"], status

    async def rewritten() -> None:
        while True:
            try:
                if b"rewritten" in await read_file(box, "result.txt", 1000):
                    return
            except SandboxError:  # not written yet
                pass
            await asyncio.sleep(0.05)
    arun(asyncio.wait_for(rewritten(), 60))


@pytest.mark.skipif(cgroups.problem() is not None, reason=f"no cgroups for sandboxes here: {cgroups.problem()}")
def test_no_process_an_mcp_server_started_is_alive_at_the_check(sandbox_config, capfd):
    tools = probe(sandbox_config, git=GIT)
    prompt = Prompt(sandbox_config, "daemon")
    try:
        start_a_daemon_through_git(prompt, tools)
        check = arun(verify.run(CHECK, "done", prompt.sandbox, 60))
        assert check.verdict == verify.Verdict.PASSED, check
        assert [p for p in descendants(os.getpid()) if "d.sh" in cmdline(p)] == []
        settle(lambda: prompt.ctx.state["mcp"]["git"].ended(), "the session to see its server gone with the cgroup")
    finally:
        capfd.readouterr()
        prompt.close()
    assert capfd.readouterr() == ("", "")  # the dead session closes quietly


@pytest.mark.parametrize("config, message", [
    ("{", "--mcp_config"),
    ('{"servers": {}}', '"mcpServers"'),
    ('{"mcpServers": {"terminal": {"command": "x"}}}', "built-in toolset terminal"),
    ('{"mcpServers": {"a b": {"command": "x"}}}', "letters, digits"),
    ('{"mcpServers": {"git": {"command": "x", "url": "http://127.0.0.1:1/mcp"}}}', 'exactly one of'),
    ('{"mcpServers": {"git": {"command": "x", "args": "-m"}}}', '"args"'),
    ('{"mcpServers": {"git": {"command": "x", "cwd": 1}}}', '"cwd" must be'),
    ('{"mcpServers": {"git": {"command": "x", "headers": {}}}}', '"headers" go with "url"'),
    ('{"mcpServers": {"docs": {"url": "ftp://x"}}}', "http"),
    ('{"mcpServers": {"docs": {"url": "http://127.0.0.1:1/mcp", "headers": {"X-Key": 1}}}}', "names to strings"),
    ('{"mcpServers": {"docs": {"url": "http://127.0.0.1:1/mcp", "headers": {"X-Key": "${env:TRAJGEN_UNSET_9}"}}}}',
     r"header X-Key names \$\{env:TRAJGEN_UNSET_9\}, which is not set"),
    ('{"mcpServers": {"docs": {"url": "http://127.0.0.1:1/mcp", "auth": {"CLIENT_ID": "x"}}}}',
     'OAuth .* pass a token through "headers"'),
])
def test_bad_configs_are_usage_errors(tmp_path, config, message):
    path = tmp_path / "mcp.json"
    path.write_text(config)
    with pytest.raises(UsageError, match=message):
        mcp_config.load_config(str(path))


def serve_mcp(*transport: str, token: str | None = None):
    """The URL of the stand-in MCP server, listening on 127.0.0.1 for the length of the test;
    with `token`, it answers only requests that carry it as a bearer token."""
    port = free_port()
    process = subprocess.Popen([sys.executable, str(HTTP_SERVER), str(port), *transport],
                               env={**os.environ, **({"MCP_TEST_TOKEN": token} if token else {})},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False
    try:
        wait_for(listening, "the MCP HTTP server to listen")
        yield f"http://127.0.0.1:{port}/{transport[0] if transport else 'mcp'}"
    finally:
        process.kill()
        process.wait()


@pytest.fixture
def http_server():
    yield from serve_mcp()


@pytest.fixture
def sse_server():
    yield from serve_mcp("sse")


def test_url_server_over_streamable_http_with_an_image_result(sandbox_config, http_server):
    with pytest.raises(mcp_config.ServerFailed, match="loopback"):  # the network guard applies to its address
        probe(sandbox_config, docs={"url": http_server})
    tools = probe(sandbox_config, allow_private=True, docs={"url": http_server})
    assert set(tools) == {"lookup", "red_pixel", "flood"}
    prompt = Prompt(sandbox_config, "url", allow_private=True)
    try:
        assert prompt.call(tools["lookup"], word="mcp") == {
            "output": "mcp: model context protocol", "success": True, "error": None,
            "structured_content": {"result": "mcp: model context protocol"}}
        image = prompt.call(tools["red_pixel"])
        assert image["success"] and image["output"] == "[image (image/png)]"
        assert image["content_blocks"][0]["type"] == "image" and image["content_blocks"][0]["data"]
        assert "content_blocks" not in trajectory.sent_result(image)
        flood = prompt.call(tools["flood"])
        assert not flood["success"] and "more than the cap of 50000" in flood["error"]
        assert prompt.box is None  # a url server needs no sandbox
    finally:
        prompt.close()


def test_url_server_that_speaks_only_sse_is_found_by_the_probe(sandbox_config, sse_server):
    tools = probe(sandbox_config, allow_private=True, docs={"url": sse_server})
    assert tools["lookup"].fn.args[0].sse
    prompt = Prompt(sandbox_config, "sse", allow_private=True)
    try:
        assert prompt.call(tools["lookup"], word="sse")["output"] == "sse: model context protocol"
    finally:
        prompt.close()


@pytest.mark.parametrize("transport", ["mcp", "sse"])
def test_url_server_gets_the_configs_headers_with_env_references_filled(sandbox_config, monkeypatch, transport):
    for url in serve_mcp(*([transport] if transport == "sse" else []), token=TOKEN):
        docs = {"url": url, **({"type": "sse"} if transport == "sse" else {})}
        with pytest.raises(mcp_config.ServerFailed, match="401") as refused:
            probe(sandbox_config, allow_private=True, docs=docs)
        assert 'pass its token through "headers"' in str(refused.value) and "\n" not in str(refused.value)
        monkeypatch.setenv("TRAJGEN_TEST_TOKEN", TOKEN)
        tools = probe(sandbox_config, allow_private=True,
                      docs={**docs, "headers": {"Authorization": "Bearer ${env:TRAJGEN_TEST_TOKEN}"}})
        assert TOKEN not in repr(tools["lookup"])  # a server's repr (logs, tracebacks) leaves its headers out
        prompt = Prompt(sandbox_config, "headers", allow_private=True)
        try:
            assert prompt.call(tools["lookup"], word="token")["output"] == "token: model context protocol"
        finally:
            prompt.close()


def git_script(prompts: list[str]) -> dict:
    """Each prompt commits its own message in its work dir, then asks the git server for the log."""
    return {"prompts": {p: [
        call("terminal", command=f"git init -q . && git -c user.name=t -c user.email=t@t commit -q --allow-empty -m '{p}'"),
        call("git_log", repo_path="/workspace"),
        think("done"),
    ] for p in prompts}}


def test_each_prompt_has_its_own_git_server_and_sees_only_its_own_commits(inline, scripted_server, tmp_path):
    prompts = [f"commit-{i}" for i in range(3)]
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in prompts])
    (tmp_path / "mcp.json").write_text(json.dumps({"mcpServers": {"git": GIT}}))
    with scripted_server(git_script(prompts)) as server:
        done = inline.run(*inline.args(server, mcp_config="mcp.json", toolsets="terminal,git"))
        assert done.returncode == 0, done.stderr
        rows = read_jsonl(inline.run_dir() / "trajectories.jsonl")
        sent_tools = {t["function"]["name"]: t for t in server.requests()[0]["body"]["tools"]}
    assert len(rows) == 3
    for row in rows:
        prompt = next(t["value"] for t in row["conversations"] if t["from"] == "human")
        log = json.loads(row["conversations"][-2]["value"].removeprefix("<tool_response>\n")
                         .removesuffix("\n</tool_response>"))["content"]
        assert log["success"] and f"Message: {prompt}" in log["output"]
        assert [p for p in prompts if f"Message: {p}\n" in log["output"]] == [prompt]
        assert row["tool_stats"]["git_log"] == {"count": 1, "success": 1, "failure": 0}
        assert row["metadata"]["toolsets_offered"] == ["terminal", "git"]
        assert {t["function"]["name"]: t for t in row["tools"]} == sent_tools
    assert sent_tools["git_log"]["function"]["parameters"]["required"] == ["repo_path"]
    # every MCP tool is zero-filled in every row, as the built-in ones are: the rows share their keys
    assert len({tuple(row["tool_stats"]) for row in rows}) == 1
    assert rows[0]["tool_stats"]["git_branch"] == {"count": 0, "success": 0, "failure": 0}


@pytest.mark.parametrize("servers, flags, code, message", [
    ({"git": {"command": sys.executable, "args": "-m mcp_server_git"}}, {}, 2, '"args" must be a list'),
    ({"git": GIT, "git2": GIT}, {"toolsets": "git,git2"}, 2,
     "tool git_status of MCP server git2 clashes with MCP server git's"),
    ({"db": {"command": "/nonexistent/server"}}, {"toolsets": "db"}, 1, "MCP server db cannot start or list its tools"),
    ({"git": GIT}, {"distribution": "dist.json"}, 2, "distribution dist.json: unknown toolset 'gti'; did you mean git?"),
    ({"git": GIT}, {"toolsets": "terminal,gti"}, 2, "--toolsets: unknown toolset 'gti'; did you mean git?"),
])
def test_bad_setups_stop_the_run_before_any_request(inline, scripted_server, tmp_path, servers, flags, code, message):
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "hello"}])
    (tmp_path / "mcp.json").write_text(json.dumps({"mcpServers": servers}))
    (tmp_path / "dist.json").write_text(json.dumps({"terminal": 100, "gti": 50}))
    with scripted_server({"default": [think()]}) as server:
        done = inline.run(*inline.args(server, mcp_config="mcp.json", **flags))
        assert server.stats()["requests"] == 0
    assert done.returncode == code, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert not (inline.run_dir() / "trajectories.jsonl").exists()


def test_list_distributions_shows_the_configs_toolsets(inline, tmp_path):
    (tmp_path / "mcp.json").write_text(json.dumps({"mcpServers": {"git": GIT, "time": TIME}}))
    done = inline.run("--list_distributions", "--mcp_config=mcp.json")
    assert done.returncode == 0, done.stderr
    assert "MCP toolsets (--mcp_config): git, time." in " ".join(done.stdout.split())


def test_no_server_outlives_a_killed_run_and_resume_finishes_it(cli, scripted_server, tmp_path):
    """kill -9 of the runner mid-prompt: the server inside the sandbox dies with it; --resume then
    runs the prompt again, and no server is left after it either."""
    (tmp_path / "mcp.json").write_text(json.dumps({"mcpServers": {"time": TIME}}))
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "what time is it"}])
    held = [call("get_current_time", timezone="UTC"), {**think("it is now"), "gate": "hold"}]
    with scripted_server({"default": held}) as server:
        runner = cli.start(*cli.args(server, mcp_config="mcp.json", toolsets="time", num_workers=1))
        servers = wait_for(lambda: servers_under(runner.pid, "mcp_server_time"), "the server to start")
        wait_for(lambda: server.stats()["requests"] >= 2, "the reply after the tool call to be asked for")
        os.killpg(runner.pid, signal.SIGKILL)
        runner.wait(timeout=60)
        wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for p in servers), "the killed run's server to end")
        server.open_gate("hold")
        resumed = cli.start(*cli.args(server, mcp_config="mcp.json", toolsets="time", num_workers=1, resume=True))
        seen = set()
        while resumed.poll() is None:
            seen.update(servers_under(resumed.pid, "mcp_server_time"))
            time.sleep(0.05)
        assert resumed.returncode == 0, resumed.stderr.read()
    assert seen and not any(os.path.exists(f"/proc/{p}") for p in seen)
    [row] = read_jsonl(cli.run_dir() / "trajectories.jsonl")
    assert row["tool_stats"]["get_current_time"]["success"] == 1


def test_image_result_reaches_the_row_but_not_the_model(inline, scripted_server, tmp_path, http_server):
    (tmp_path / "mcp.json").write_text(json.dumps({"mcpServers": {"docs": {"url": http_server}}}))
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "show me red"}])
    with scripted_server({"default": [call("red_pixel"), think("a red pixel")]}) as server:
        done = inline.run(*inline.args(server, mcp_config="mcp.json", toolsets="docs", allow_private_urls=True))
        assert done.returncode == 0, done.stderr
        sent = server.requests()[1]["body"]["messages"][-1]
    [row] = read_jsonl(inline.run_dir() / "trajectories.jsonl")
    [turn] = [t for t in row["conversations"] if t["from"] == "tool"]
    [block] = turn["content_blocks"]
    assert block["type"] == "image" and block["mimeType"] == "image/png" and block["data"]
    assert sent["role"] == "tool" and "[image (image/png)]" in sent["content"] and block["data"] not in sent["content"]
    assert block["data"] not in turn["value"] and turn["message"] == sent
    assert row["tool_stats"]["red_pixel"]["success"] == 1


def test_a_header_value_never_reaches_the_runs_files_or_output(inline, scripted_server, tmp_path):
    """The token reaches the server (the calls succeed) and nothing of the run: not its rows, journal,
    manifest, statistics or logs, not the terminal, not the error of a call that fails."""
    for url in serve_mcp(token=TOKEN):
        (tmp_path / "mcp.json").write_text(json.dumps({"mcpServers": {"docs": {
            "url": url, "headers": {"Authorization": "Bearer ${env:DOCS_TOKEN}"}}}}))
        write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "look it up"}])
        script = {"default": [call("lookup", word="mcp"), call("flood"), call("lookup"), think("done")]}
        with scripted_server(script) as server:
            done = inline.run(*inline.args(server, mcp_config="mcp.json", toolsets="docs", allow_private_urls=True,
                                           verbose=True), env={"DOCS_TOKEN": TOKEN})
            sent = json.dumps(server.requests())
    assert done.returncode == 0, done.stderr
    [row] = read_jsonl(inline.run_dir() / "trajectories.jsonl")
    assert row["tool_stats"]["lookup"] == {"count": 2, "success": 1, "failure": 1}
    assert row["tool_stats"]["flood"] == {"count": 1, "success": 0, "failure": 1}
    leaks = [str(f) for f in tmp_path.rglob("*") if f.is_file() and TOKEN.encode() in f.read_bytes()]
    assert leaks == [] and TOKEN not in done.stdout + done.stderr and TOKEN not in sent
