"""An MCP stdio server in the docker backend: an image holding the server's command (the host's
Python with mcp-server-time, imported into the private dockerd of tests/dockerd.py; no network)."""
from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import call, read_jsonl, think, tool_outputs, write_jsonl
from tests.dockerd import _busybox_rootfs, _import_image

pytest_plugins = ["tests.dockerd"]
pytest.importorskip("mcp_server_time")

IMAGE = "trajgen-test-mcp-time:latest"
SKIPPED_STDLIB = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "site-packages", "lib2to3"}


def _distributions(*names: str) -> list[importlib.metadata.Distribution]:
    """`names` and what they require, transitively (extras left out)."""
    found, todo = {}, list(names)
    while todo:
        wanted = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if wanted in found:
            continue
        try:
            found[wanted] = dist = importlib.metadata.distribution(wanted)
        except importlib.metadata.PackageNotFoundError:  # a platform's own requirement (pywin32...)
            continue
        todo += [re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0] for r in dist.requires or [] if "extra ==" not in r]
    return list(found.values())


def _copy_with_libraries(binary: Path, root: Path) -> None:
    """`binary` and the shared libraries it links, at their host paths under `root`."""
    linked = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
    for path in [str(binary), *(w for w in linked.split() if w.startswith("/"))]:
        target = root / path.lstrip("/")
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


def _python_with_time_server(root: Path) -> None:
    """The host's Python at its host path (its stdlib, its dynamic modules' libraries) and the
    distributions mcp-server-time needs, in its site-packages."""
    prefix, site = Path(sys.base_prefix), Path(sysconfig.get_paths()["purelib"])
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for parent in [*reversed(prefix.parents)][1:]:
        (root / str(parent).lstrip("/")).mkdir(mode=0o755, exist_ok=True)
        (root / str(parent).lstrip("/")).chmod(0o755)
    _copy_with_libraries(Path(sys.executable).resolve(), root)
    executable = root / sys.executable.lstrip("/")
    if not executable.exists():  # `python`, a link to python3.11
        executable.symlink_to(Path(sys.executable).readlink())
    shutil.copytree(stdlib, root / str(stdlib).lstrip("/"), symlinks=True,
                    ignore=lambda d, names: [n for n in names if Path(d) == stdlib and n in SKIPPED_STDLIB])
    for module in (root / str(stdlib).lstrip("/") / "lib-dynload").glob("*.so"):
        _copy_with_libraries(module, root)
    for dist in _distributions("mcp-server-time", "cryptography"):  # mcp asks for pyjwt[crypto]
        for file in dist.files or []:
            source = Path(dist.locate_file(file)).resolve()
            if source.is_file() and source.is_relative_to(site):
                target = root / str(source).lstrip("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
                if source.suffix == ".so":
                    _copy_with_libraries(source, root)


@pytest.fixture(scope="session")
def mcp_image(docker_engine: str) -> str:
    return _import_image(IMAGE, _busybox_rootfs, _python_with_time_server)


def test_docker_backend_runs_the_server_in_the_prompts_container(cli, scripted_server, mcp_image):
    (cli.cwd / "mcp.json").write_text(json.dumps({"mcpServers": {"time": {
        "command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone=UTC"]}}}))
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": "what time is it"}])
    with scripted_server({"default": [call("get_current_time", timezone="Asia/Tokyo"), think("late")]}) as server:
        done = cli.run(*cli.args(server, mcp_config="mcp.json", toolsets="time", terminal_backend="docker",
                                 docker_image=mcp_image))
    assert done.returncode == 0, done.stderr
    [row] = read_jsonl(cli.run_dir() / "trajectories.jsonl")
    [result] = tool_outputs(row)
    assert result["success"] and result["structured_content"]["timezone"] == "Asia/Tokyo"
    probes = subprocess.run(["docker", "ps", "-aq", "--filter", "label=trajgen.key=mcp-probe-time"],
                            capture_output=True, text=True, check=True)
    assert probes.stdout.strip() == ""  # the probe's container went with its sandbox
