"""A container image holding MCP servers from PyPI, for the container backends' MCP tests: the
host's Python (at its host path) with mcp-server-git and mcp-server-time, and git, over busybox;
imported into the private dockerd of tests/dockerd.py (no registry, no network). The apptainer
stand-in builds its instances from it, the Modal stand-in its sandboxes.

A plugin: `pytest_plugins = ["tests.dockerd", "tests.support.mcp_image"]`.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.dockerd import _busybox_rootfs, _host_tools, _import_image

PYTHON = sys.executable  # the servers' command inside the image: `PYTHON -m mcp_server_git`
# one image per Python that runs the tests (a venv's, the machine's), each at its own host path
IMAGE = f"trajgen-test-mcp:{hashlib.sha256(PYTHON.encode()).hexdigest()[:12]}"
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


def _copy_links(path: Path, root: Path) -> None:
    """The chain of symbolic links from `path` to the binary, as on the host (`venv/bin/python` ->
    `.../bin/python` -> `python3.11`)."""
    while path.is_symlink():
        target = root / str(path).lstrip("/")
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        if not target.is_symlink():
            target.symlink_to(os.readlink(path))
        path = path.parent / os.readlink(path)


def _python_with_servers(root: Path) -> None:
    """The host's Python at its host path (its stdlib, its dynamic modules' libraries), the
    distributions the two servers need in its site-packages, and git (mcp-server-git runs it)."""
    prefix, site = Path(sys.base_prefix), Path(sysconfig.get_paths()["purelib"])
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for parent in [*reversed(prefix.parents)][1:]:
        (root / str(parent).lstrip("/")).mkdir(mode=0o755, exist_ok=True)
        (root / str(parent).lstrip("/")).chmod(0o755)
    _copy_with_libraries(Path(PYTHON).resolve(), root)
    _copy_links(Path(PYTHON), root)
    if sys.prefix != sys.base_prefix:  # a venv: its pyvenv.cfg makes the Python inside use its site-packages
        shutil.copy2(Path(sys.prefix) / "pyvenv.cfg", root / sys.prefix.lstrip("/") / "pyvenv.cfg")
    shutil.copytree(stdlib, root / str(stdlib).lstrip("/"), symlinks=True,
                    ignore=lambda d, names: [n for n in names if Path(d) == stdlib and n in SKIPPED_STDLIB])
    for module in (root / str(stdlib).lstrip("/") / "lib-dynload").glob("*.so"):
        _copy_with_libraries(module, root)
    for dist in _distributions("mcp-server-git", "mcp-server-time", "cryptography"):  # mcp asks for pyjwt[crypto]
        for file in dist.files or []:
            source = Path(dist.locate_file(file)).resolve()
            if source.is_file() and source.is_relative_to(site):
                target = root / str(source).lstrip("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
                if source.suffix == ".so":
                    _copy_with_libraries(source, root)
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    _copy_with_libraries(Path(git), root)
    if Path(git).parent != Path("/usr/bin"):
        (root / "usr" / "bin").mkdir(parents=True, exist_ok=True)
        (root / "usr" / "bin" / "git").symlink_to(git)


@pytest.fixture(scope="session")
def mcp_image(docker_engine: str) -> str:
    if Path(sys.prefix).is_relative_to("/tmp"):  # where the image would hold it, the container mounts its own /tmp
        pytest.skip(f"the tests' Python is a virtualenv under /tmp ({sys.prefix}), which a container's private "
                    "/tmp hides: make the venv elsewhere to run these")
    pytest.importorskip("mcp_server_git")
    pytest.importorskip("mcp_server_time")
    return _import_image(IMAGE, _busybox_rootfs, _python_with_servers)


@pytest.fixture(scope="session")
def mcp_bash_image(mcp_image: str) -> str:
    """The same with bash: prompts' commands run through the command loop."""
    return _import_image(IMAGE.replace(":", "-bash:"), _busybox_rootfs, _python_with_servers, _host_tools)
