"""MCP servers start as configured, wherever they live: a venv under /tmp, a script in a home
directory, a `cwd`, a `uvx` server from its cache with the network off; each in a real local
sandbox, in-process. A server that cannot start is named with its cause and the fix.

The home directory is a temporary one ($HOME set for the test): the real one is never touched.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.test_mcp import Prompt, probe, sandbox_config  # noqa: F401 (a fixture)
from trajgen.errors import UsageError
from trajgen.sandbox import SandboxError, visible
from trajgen.tools import mcp_config

PLAIN = Path(__file__).parent / "standins" / "mcp_plain_server.py"
PLAIN_JS = Path(__file__).parent / "standins" / "mcp_plain_server.js"


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A home directory of the test's own, with a secret in it."""
    home = tmp_path / "home" / "me"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("PRIVATE KEY")
    monkeypatch.setenv("HOME", str(home))
    for variable in ("XDG_CACHE_HOME", "XDG_DATA_HOME", "UV_CACHE_DIR", "UV_TOOL_DIR", "UV_PYTHON_INSTALL_DIR"):
        monkeypatch.delenv(variable, raising=False)
    visible._uv_places.cache_clear()
    yield home
    visible._uv_places.cache_clear()


def where(config, **server) -> dict:
    """The server's answer to `where`, called in a prompt's sandbox after the probe."""
    tools = probe(config, **server)
    prompt = Prompt(config, "where")
    try:
        result = prompt.call(tools["where"])
    finally:
        prompt.close()
    assert result["success"], result
    return json.loads(result["output"])


def test_a_server_in_a_venv_under_tmp_starts(sandbox_config, tmp_path):
    assert str(tmp_path).startswith("/tmp/")  # hidden by the sandbox's own /tmp, but for the binds after it
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    packages = sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})
    shutil.copy(PLAIN, Path(packages) / "plain_mcp.py")
    answer = where(sandbox_config, plain={"command": str(venv / "bin" / "python"), "args": ["-m", "plain_mcp"]})
    assert answer == {"executable": str(venv / "bin" / "python"), "prefix": str(venv), "cwd": "/workspace"}


def test_a_script_in_a_home_directory_starts_in_its_cwd(sandbox_config, home):
    project = home / "project"
    project.mkdir()
    shutil.copy(PLAIN, project / "server.py")
    answer = where(sandbox_config, mine={"command": "python3", "args": ["server.py"], "cwd": str(project)})
    assert answer["cwd"] == str(project)
    answer = where(sandbox_config, mine={"command": "python3", "args": [str(project / "server.py")]})
    assert answer["cwd"] == "/workspace"


def test_only_what_the_config_names_is_shown(home, tmp_path):
    (home / "project").mkdir()
    (home / "project" / "server.py").write_text("")
    run_dir = home / "project" / "data" / "run"
    run_dir.mkdir(parents=True)
    shown = visible.plan("python3", ("server.py",), str(home / "project"), False, (str(run_dir),))
    assert str(home / "project") in shown.binds and str(run_dir) in shown.masks
    assert not any(str(home) == b or str(home / ".ssh") == b for b in shown.binds)
    assert shown.argv[1] == "server.py" and shown.cwd == str(home / "project")
    tilde = visible.plan("python3", ("--script=~/project/server.py",), None, False, ())
    assert tilde.argv[1] == f"--script={home / 'project' / 'server.py'}"
    assert str(home / "project" / "server.py") in tilde.binds
    for args, cwd, why in [((str(home / ".ssh" / "id_ed25519"),), None, "holds secrets"),
                           ((str(home),), None, "the whole of"),
                           ((), "/", "the whole of"),
                           ((str(run_dir / "x"),), None, "the run's own files")]:
        if args:
            Path(args[0]).touch()
        with pytest.raises(SandboxError, match=why):
            visible.plan("python3", args, cwd, False, (str(run_dir),))


def wheel(directory: Path) -> Path:
    """tests/standins/mcp_plain_server.py as the wheel plain-mcp 1.0, with the console script plain-mcp."""
    info = "plain_mcp-1.0.dist-info"
    files = {"plain_mcp.py": PLAIN.read_bytes(),
             f"{info}/METADATA": b"Metadata-Version: 2.1\nName: plain-mcp\nVersion: 1.0\n",
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
             f"{info}/entry_points.txt": b"[console_scripts]\nplain-mcp = plain_mcp:main\n"}

    def digest(data: bytes) -> str:
        return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    directory.mkdir()
    with zipfile.ZipFile(directory / "plain_mcp-1.0-py3-none-any.whl", "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", "".join(f"{n},{digest(d)},{len(d)}\n" for n, d in files.items())
                   + f"{info}/RECORD,,\n")
    return directory


@pytest.mark.skipif(shutil.which("uvx") is None, reason="uv is not installed (pip install uv)")
def test_a_uvx_server_runs_from_its_cache_with_the_network_off(sandbox_config, home, tmp_path):
    wheels = wheel(tmp_path / "wheels")
    args = ["--find-links", str(wheels), "plain-mcp"]
    filled = subprocess.run(["uvx", "--offline", *args], input="", capture_output=True, text=True, timeout=120,
                            env={**os.environ, "UV_PYTHON_DOWNLOADS": "never"})
    assert filled.returncode == 0, filled.stderr  # the user's first run on the host fills ~/.cache/uv
    cache = home / ".cache" / "uv"

    def files() -> list[str]:  # but uv's records of interpreters, which the host's `uv python find` writes
        return sorted(str(f) for f in cache.rglob("*") if "interpreter-v" not in str(f))
    before = files()
    answer = where(sandbox_config, plain={"command": "uvx", "args": args})
    assert answer["prefix"].startswith(f"{cache}/") and answer["cwd"] == "/workspace"
    assert files() == before  # read-only: the sandbox wrote nothing of the host's


@pytest.mark.skipif(shutil.which("npm") is None, reason="Node.js is not installed (npm)")
def test_an_npm_package_runs_by_its_script(sandbox_config, home, tmp_path):
    """What docs/mcp.md says to do for an npx server when the sandbox has no network (npx writes its cache)."""
    package = tmp_path / "package"
    package.mkdir()
    (package / "package.json").write_text(json.dumps({"name": "plain-mcp-node", "version": "1.0.0",
                                                      "bin": {"plain-mcp-node": "server.js"}}))
    shutil.copy(PLAIN_JS, package / "server.js")
    subprocess.run(["npm", "pack", "--pack-destination", str(tmp_path)], cwd=package, check=True,
                   capture_output=True, timeout=120)
    subprocess.run(["npm", "install", "--offline", "--prefix", str(home / "mcp"),
                    str(tmp_path / "plain-mcp-node-1.0.0.tgz")], check=True, capture_output=True, timeout=120)
    script = home / "mcp" / "node_modules" / "plain-mcp-node" / "server.js"
    answer = where(sandbox_config, plain={"command": "node", "args": [str(script)]})
    assert answer == {"executable": str(script), "prefix": str(script.parent), "cwd": "/workspace"}


@pytest.mark.parametrize("server, message", [
    ({"command": "trajgen-no-such-server"}, r"\"command\" trajgen-no-such-server is not on the PATH \(.*\); "
                                            "install it, or give its absolute path"),
    ({"command": sys.executable, "args": ["-m", "trajgen_no_such_module"]},
     r".*No module named trajgen_no_such_module; install the package of trajgen_no_such_module into the Python "
     r"that \"command\" names"),
    ({"command": sys.executable, "args": ["/nonexistent/server.py"]},
     r".*can't open file .*/nonexistent/server.py.*; check that the path exists on this machine"),
])
def test_a_server_that_cannot_start_is_named_with_its_cause_and_fix(sandbox_config, server, message):
    with pytest.raises(mcp_config.ServerFailed, match=f"MCP server bad cannot start or list its tools: {message}"):
        probe(sandbox_config, tool_timeout=30, bad=server)


@pytest.mark.parametrize("entry, message", [
    ({"comand": "x"}, "server 'a': unknown key 'comand'; did you mean command?"),
    ({"command": "x", "arg": []}, "unknown key 'arg'; did you mean args?"),
    ({"command": "docker", "args": ["run", "-i", "--rm", "mcp/time"]},
     '"docker" starts a container of its own, which a sandbox cannot'),
])
def test_config_mistakes_are_named(tmp_path, entry, message):
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"a": entry}}))
    with pytest.raises(UsageError, match=message.replace("?", r"\?")):
        mcp_config.load_config(str(path))
