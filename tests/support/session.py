"""What every process of one pytest session shares, pytest-xdist's workers included: a directory,
and a lock in it, so that one dockerd and one Ray run serve the whole session.

The controller (or the only process) makes the directory at its start; the workers it then spawns
inherit its path in the environment. The controller stops what the workers started, at its end.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

VARIABLE = "TRAJGEN_TEST_SESSION"
_path: Path | None = None


def begin(config) -> None:
    """At pytest_configure: the controller makes the directory, a worker finds it."""
    global _path
    if is_controller(config):
        os.environ[VARIABLE] = tempfile.mkdtemp(prefix="trajgen-tests-")
    _path = Path(os.environ[VARIABLE])


def is_controller(config) -> bool:
    """pytest-xdist's controller, or the only process: not one of its workers."""
    return not hasattr(config, "workerinput")


def directory() -> Path:
    assert _path is not None, "tests/conftest.py's pytest_configure has not run"
    return _path


def record(name: str, pid: int, stop: signal.Signals) -> None:
    """A process group some process of the session started (`pid` leads it), to be ended with
    `stop` at the session's end if it is still running then."""
    (directory() / f"{name}.pid").write_text(f"{pid} {int(stop)}")


def end() -> None:
    """At the controller's pytest_unconfigure, once every worker has ended: end the recorded
    process groups, then remove the directory."""
    if _path is None:
        return
    for pidfile in _path.glob("*.pid"):
        pid, stop = map(int, pidfile.read_text().split())
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, stop)
            _wait_gone(pid)
    shutil.rmtree(_path, ignore_errors=True)


def _wait_gone(pid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):  # started by this process: reap it, or it stays a zombie
            os.waitpid(pid, os.WNOHANG)
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(pid, signal.SIGKILL)


@contextlib.contextmanager
def locked(name: str) -> Iterator[Path]:
    """Hold the session-wide lock `name`: one process at a time starts what all of them share."""
    with open(directory() / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield directory()
