"""The Ray executor. Its end-to-end tests (tests/ray_inner_tests.py) run in a fresh network namespace.

Ray takes the machine's non-loopback address as its node address and listens on every interface;
it must never do so here. So the test below re-runs pytest on the inner tests inside
`unshare --net` with only loopback up (and a PID namespace, so that every Ray process ends with
it), and shows their output. The inner tests refuse to start Ray anywhere else.
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from trajgen import ray_executor
from trajgen.errors import UsageError

NAMESPACE = ["unshare", "--net", "--pid", "--fork", "--mount-proc"]


def test_executor_ray_without_ray_is_a_usage_error(monkeypatch):
    monkeypatch.setattr(ray_executor, "ray", None)
    with pytest.raises(UsageError, match=r"--executor=ray needs Ray: pip install -e '\.\[ray\]'"):
        ray_executor.make_executor("ray", 2, config=None)


def test_executor_flags_are_checked():
    with pytest.raises(UsageError, match="--executor must be processes or ray"):
        ray_executor.check_executor("threads", None, 1.0, None)
    if ray_executor.ray is not None:
        with pytest.raises(UsageError, match="--worker_cpus must be a number > 0"):
            ray_executor.check_executor("ray", None, 0, None)
        with pytest.raises(UsageError, match="--worker_memory must be a number of MB > 0"):
            ray_executor.check_executor("ray", "auto", 1.0, -5)


def _namespace_problem() -> str | None:
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed (pip install -e '.[ray]')"
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not available to make a loopback-only network namespace"
    probe = subprocess.run([*NAMESPACE, "true"], capture_output=True, text=True)
    if probe.returncode:
        return f"cannot create a network namespace (needs root): {probe.stderr.strip()}"
    return None


def test_ray_executor_end_to_end_in_a_private_network_namespace():
    if problem := _namespace_problem():
        pytest.skip(problem)
    # sh stays the namespace's PID 1, which reaps the orphans it adopts (Python there would not)
    inner = 'ip link set lo up && "$0" -m pytest tests/ray_inner_tests.py -q -p no:cacheprovider'
    done = subprocess.run([*NAMESPACE, "sh", "-c", inner, sys.executable], cwd=ROOT, capture_output=True,
                          text=True, timeout=1200)
    print(done.stdout[-30000:], done.stderr[-5000:], sep="\n")
    assert done.returncode == 0, "the Ray tests failed inside their network namespace: see the output above"
