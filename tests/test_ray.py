"""The Ray executor. Its end-to-end tests (tests/ray_inner_tests.py) run in a fresh network namespace.

Ray takes the machine's non-loopback address as its node address and listens on every interface;
it must never do so here. So the test below re-runs pytest on the inner tests inside
`unshare --net` with only loopback up (and a PID namespace, so that every Ray process ends with
it), and shows their output. The inner tests refuse to start Ray anywhere else.

They spend most of their two minutes waiting on Ray, so conftest.py starts them in the background
as soon as the tests are collected, once per session (tests/support/session.py), and the other tests
run meanwhile; their sandbox roots are in a /run/trajgen of their own, which the tests that look at the
machine's do not see.
"""
from __future__ import annotations

import importlib.util
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from tests.support import session
from trajgen import ray_executor
from trajgen.errors import UsageError

NAMESPACE = ["unshare", "--net", "--pid", "--fork", "--mount-proc"]
# sh stays the namespace's PID 1, which reaps the orphans it adopts (Python there would not)
INNER = ('ip link set lo up && mkdir -p -m 700 /run/trajgen && mount -t tmpfs -o mode=700 tmpfs /run/trajgen && '
         '"$0" -m pytest tests/ray_inner_tests.py -q -n 0 -p no:cacheprovider')  # one module: one process
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


# the inner run's exit status, written when it ends, for whichever process of the session waits for it
RECORD_STATUS = 'status=$1; shift; "$@"; echo $? > "$status.part" && mv "$status.part" "$status"'


def start_inner_run() -> str | None:
    """Start the inner tests once per session, whichever process asks first (conftest.py asks as
    soon as they are collected); why they cannot run here, or None."""
    with session.locked("ray") as shared:
        if (problem := shared / "ray.problem").exists():
            return problem.read_text()
        if not (shared / "ray.out").exists():
            if why := _namespace_problem():
                problem.write_text(why)
                return why
            with open(shared / "ray.out", "w") as output:
                process = subprocess.Popen(["sh", "-c", RECORD_STATUS, "sh", shared / "ray.status", *NAMESPACE,
                                            "sh", "-c", INNER, sys.executable],
                                           cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
            session.record("ray", process.pid, signal.SIGKILL)  # its namespace ends with it
    return None


def inner_result(timeout: float) -> tuple[int, str]:
    """(the inner run's exit status, what it printed), once it has ended."""
    shared, deadline = session.directory(), time.monotonic() + timeout
    while not (shared / "ray.status").exists():
        assert time.monotonic() < deadline, f"the Ray tests did not end within {timeout} s"
        time.sleep(1)
    return int((shared / "ray.status").read_text()), (shared / "ray.out").read_text()


def test_ray_executor_end_to_end_in_a_private_network_namespace():
    if problem := start_inner_run():
        pytest.skip(problem)
    code, output = inner_result(timeout=1200)
    print(output[-35000:])
    assert code == 0, "the Ray tests failed inside their network namespace: see the output above"
