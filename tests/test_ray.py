"""The Ray executor. Its end-to-end tests (tests/ray_inner_tests.py) run in a fresh network namespace.

Ray takes the machine's non-loopback address as its node address and listens on every interface;
it must never do so here. So the test below re-runs pytest on the inner tests inside
`unshare --net` with only loopback up (and a PID namespace, so that every Ray process ends with
it), and shows their output. The inner tests refuse to start Ray anywhere else.

They spend most of their two minutes waiting on Ray, so conftest.py starts them in the background
as soon as the tests are collected, and the other tests run meanwhile; their sandbox roots are in
a /run/trajgen of their own, which the tests that look at the machine's do not see.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from tests.conftest import ROOT
from trajgen import ray_executor
from trajgen.errors import UsageError

NAMESPACE = ["unshare", "--net", "--pid", "--fork", "--mount-proc"]
# sh stays the namespace's PID 1, which reaps the orphans it adopts (Python there would not)
INNER = ('ip link set lo up && mkdir -p -m 700 /run/trajgen && mount -t tmpfs -o mode=700 tmpfs /run/trajgen && '
         '"$0" -m pytest tests/ray_inner_tests.py -q -p no:cacheprovider')
END_TO_END = "tests/test_ray.py::test_ray_executor_end_to_end_in_a_private_network_namespace"


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


class InnerRun:
    """The inner tests' pytest in its namespace, its output in a temporary file (no pipe to fill)."""

    def __init__(self):
        self.output = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen([*NAMESPACE, "sh", "-c", INNER, sys.executable], cwd=ROOT, stdout=self.output,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def result(self, timeout: float) -> tuple[int, str]:
        """(its exit status, what it printed), once it has ended."""
        code = self.process.wait(timeout=timeout)
        self.output.seek(0)
        return code, self.output.read()

    def stop(self) -> None:
        """End it with its namespace, if the session ends before the test has waited for it."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.output.close()


_started: dict[str, InnerRun | str] = {}  # END_TO_END -> its run, or why it cannot run here


def start_inner_run() -> InnerRun | str:
    """The inner tests' run, started at the first call; or why it cannot run here."""
    if END_TO_END not in _started:
        problem = _namespace_problem()
        _started[END_TO_END] = problem if problem else InnerRun()
    return _started[END_TO_END]


def stop_inner_run() -> None:
    if isinstance(run := _started.pop(END_TO_END, None), InnerRun):
        run.stop()


def test_ray_executor_end_to_end_in_a_private_network_namespace():
    run = start_inner_run()
    if isinstance(run, str):
        pytest.skip(run)
    code, output = run.result(timeout=1200)
    print(output[-35000:])
    assert code == 0, "the Ray tests failed inside their network namespace: see the output above"
