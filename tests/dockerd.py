"""A Docker engine and a busybox test image for the docker sandbox tests.

Use the engine DOCKER_HOST points at if it answers; otherwise start a private dockerd that
never touches the host network (no bridge, no iptables) and stop it at the end. No registry is
reachable here, so the test image is imported from the busybox-static package, not pulled.
Test modules load this as a plugin (`pytest_plugins = ["tests.dockerd"]`); the engine is started,
and each image imported, once per session however many modules and pytest-xdist workers use them.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import session

IMAGE = "trajgen-test-busybox:latest"
BASH_IMAGE = "trajgen-test-bash:latest"
BUSYBOX = "/usr/bin/busybox"  # from busybox-static: no shared libraries needed inside the image
LOOP_TOOLS = ("bash",)  # what a prompt's command loop needs beyond busybox


def _answers(host: str) -> bool:
    try:
        return subprocess.run(["docker", "-H", host, "info"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _start_dockerd(tmp: Path) -> str:
    """Start a private dockerd with its data under `tmp` and return its DOCKER_HOST, or skip saying
    why it could not start. tests/support/session.py stops it at the session's end."""
    if shutil.which("dockerd") is None or shutil.which("docker") is None:
        pytest.skip("no Docker engine: dockerd/docker are not installed")
    if os.geteuid() != 0:
        pytest.skip("no Docker engine: starting dockerd needs root")
    host = f"unix://{tmp}/docker.sock"
    with open(tmp / "dockerd.log", "wb") as log:
        proc = subprocess.Popen(
            ["dockerd", "--bridge=none", "--iptables=false", "--ip6tables=false", "--data-root", f"{tmp}/data",
             "--exec-root", f"{tmp}/exec", "--pidfile", f"{tmp}/pid", "--host", host],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    session.record("dockerd", proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if _answers(host):
            return host
        time.sleep(0.5)
    lines = (tmp / "dockerd.log").read_text(errors="replace").strip().splitlines()
    pytest.skip("no Docker engine: dockerd did not start: " + (lines[-1] if lines else "no log output"))


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[str]:
    """The DOCKER_HOST of a working engine (also set in os.environ for the session), or a skip: the
    one DOCKER_HOST points at if it answers, else one private dockerd for every process of the session."""
    existing = os.environ.get("DOCKER_HOST")
    if existing and _answers(existing):
        yield existing
        return
    with session.locked("dockerd") as shared:
        tmp = shared / "dockerd"  # short: socket paths are limited
        host = f"unix://{tmp}/docker.sock"
        if not tmp.exists():
            tmp.mkdir()
            host = _start_dockerd(tmp)
        elif not _answers(host):
            pytest.skip("no Docker engine: the session's dockerd did not start (see the first skip)")
    os.environ["DOCKER_HOST"] = host
    try:
        yield host
    finally:
        if existing is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = existing


def _busybox_rootfs(root: Path) -> None:
    """bin/ with busybox and a symlink per applet (what `busybox --install -s` makes), plus /tmp and /etc."""
    (root / "bin").mkdir()
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    applets = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, check=True).stdout.split()
    for applet in applets:
        if applet != "busybox":
            (root / "bin" / applet).symlink_to("busybox")
    (root / "tmp").mkdir()
    (root / "tmp").chmod(0o1777)
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")


def _host_tools(root: Path) -> None:
    """The host's bash under usr/bin (ahead of busybox on PATH), with its libraries."""
    for tool in LOOP_TOOLS:
        binary = shutil.which(tool)
        if binary is None:
            pytest.skip(f"{tool} is not installed")
        linked = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
        libraries = [word for word in linked.split() if word.startswith("/")]
        for path in (f"/usr/bin/{tool}", *libraries):
            target = root / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(binary if path.startswith("/usr/bin/") else path, target)


def _import_image(tag: str, *layouts) -> str:
    """`tag`, imported once from a rootfs that each of `layouts` fills in turn."""
    with session.locked(f"image-{tag.replace(':', '-')}"):
        if subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode != 0:
            _import(tag, layouts)
    return tag


def _import(tag: str, layouts) -> None:
    if not os.path.exists(BUSYBOX):
        pytest.skip(f"{BUSYBOX} is missing (install busybox-static)")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "rootfs"
        root.mkdir()
        for layout in layouts:
            layout(root)
        with tarfile.open(Path(tmp) / "rootfs.tar", "w") as tar:
            tar.add(root, arcname=".")
        subprocess.run(["docker", "import", str(Path(tmp) / "rootfs.tar"), tag], capture_output=True, check=True)


@pytest.fixture(scope="session")
def busybox_image(docker_engine: str) -> str:
    """The tag of a tiny busybox image (sh, no bash, no python), imported into the engine once."""
    return _import_image(IMAGE, _busybox_rootfs)


@pytest.fixture(scope="session")
def bash_image(docker_engine: str) -> str:
    """The busybox image plus bash: an image the command loop can run in."""
    return _import_image(BASH_IMAGE, _busybox_rootfs, _host_tools)
