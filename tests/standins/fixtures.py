"""The apptainer stand-in (tests/standins/apptainer) set up for a test session.

A plugin (`pytest_plugins = ["tests.dockerd", "tests.standins.fixtures"]`): the stand-in exports its
images from the private Docker engine, so it needs the engine and the busybox image first.
"""
from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from tests.standins import STANDINS, live_instances
from trajgen.sandbox import apptainer


@pytest.fixture(scope="session")
def apptainer_standin(docker_engine: str, busybox_image: str, tmp_path_factory) -> Iterator[dict[str, str]]:
    """The variables that put the stand-in first on PATH with its own state dir (also set in
    os.environ for the session, for in-process tests); every instance left is stopped at the end."""
    env = {"PATH": f"{STANDINS}:{os.environ['PATH']}",
           "APPTAINER_STANDIN_STATE": str(tmp_path_factory.mktemp("apptainer-standin")),
           "APPTAINER_STANDIN_DOCKER_HOST": docker_engine}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    apptainer.runtime.cache_clear()
    try:
        yield env
    finally:
        for name in live_instances():
            subprocess.run(["apptainer", "instance", "stop", name], capture_output=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        apptainer.runtime.cache_clear()
