"""The local Modal stand-in (tests/standins/modal_server.py) as a session fixture.

Test modules load this as a plugin (`pytest_plugins = ["tests.dockerd", "tests.standins.modal_fixture"]`).
Every test that uses it runs against a stand-in, not Modal: the SDK is the real `modal` package,
the server and its sandboxes (containers on the private Docker engine) are local.
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.standins.modal_server import LABEL

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class ModalStandIn:
    env: dict[str, str]  # what points the SDK at the stand-in: its URL and a dummy token
    process: subprocess.Popen

    def containers(self, *labels: str) -> list[str]:
        """Ids of the running containers (sandboxes) this stand-in started, optionally with more labels."""
        filters = [arg for label in (LABEL, *labels) for arg in ("--filter", f"label={label}")]
        return subprocess.run(["docker", "ps", "-q", *filters], capture_output=True, text=True, check=True).stdout.split()


@pytest.fixture(scope="session")
def modal_standin(docker_engine: str, busybox_image: str, tmp_path_factory) -> Iterator[ModalStandIn]:
    pytest.importorskip("modal", reason="the modal SDK is not installed (pip install 'trajgen-batch-runner[modal]')")
    log = tmp_path_factory.mktemp("modal-standin") / "server.log"  # the calls it does not serve are named there
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "tests.standins.modal_server"], cwd=ROOT,
                                   env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE, stderr=stderr,
                                   text=True, start_new_session=True)
    line = process.stdout.readline()  # blocks until it listens or dies
    if not line.startswith("PORT "):
        process.wait(timeout=30)
        pytest.fail(f"the Modal stand-in did not start: {log.read_text()}")
    env = {"MODAL_SERVER_URL": f"http://127.0.0.1:{line.split()[1]}", "MODAL_TOKEN_ID": "ak-standin",
           "MODAL_TOKEN_SECRET": "as-standin"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # for the in-process sandbox tests; CLI tests pass env to the subprocess
    try:
        yield ModalStandIn(env, process)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        process.terminate()  # it removes every container it started
        process.wait(timeout=60)
