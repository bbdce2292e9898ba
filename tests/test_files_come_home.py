"""Files a tool makes for the user travel home in the prompt's outcome and the parent writes them.

The workers run with the run directory mounted read-only in their own mount namespace (the fork
server they fork from is started through a wrapper that makes one), so a worker that wrote there
would fail the prompt. The run goes through `trajgen.run.run` in a Python of its own, whose
multiprocessing executable is the wrapper, so that the wrapper applies to its workers only.
The Ray executor's test of the same is in tests/ray_inner_tests.py.
"""
from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, call, read_jsonl, think, write_jsonl
from tests.test_vision_image_tools import PNG
from tests.test_web_tools import fake_api, no_provider_env  # noqa: F401  (fixtures)

RO_WRAPPER = """#!/bin/sh
# a worker whose view of the run directory ($RUN_DIR) is read-only
exec unshare --mount sh -c 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"' "{run_dir}" "{python}" "$@"
"""
RUN = """import multiprocessing, sys
from trajgen import run
from trajgen.options import RunOptions
multiprocessing.set_executable(sys.argv[1])
sys.exit(run.run(RunOptions(dataset_file="prompts.jsonl", run_name="run", base_url=sys.argv[2], api_key="dummy",
                            model="test-model", num_workers=2, distribution="default", max_retries=1)))
"""


def read_only_problem(tmp_path: Path) -> str | None:
    if shutil.which("unshare") is None:
        return "`unshare` is not available"
    probe = subprocess.run(["unshare", "--mount", "sh", "-c", f"mount --bind {tmp_path} {tmp_path}"],
                           capture_output=True, text=True)
    return f"cannot make a mount namespace (needs root): {probe.stderr.strip()}" if probe.returncode else None


def test_image_files_are_written_by_the_parent_only(scripted_server, fake_api, tmp_path, monkeypatch):  # noqa: F811
    if problem := read_only_problem(tmp_path):
        pytest.skip(problem)
    fal = fake_api({"/fal-ai/flux/schnell": (200, {"images": [
        {"url": "data:image/png;base64," + base64.b64encode(PNG).decode()}]})})
    monkeypatch.setenv("FAL_KEY", "fal-key")
    monkeypatch.setenv("FAL_BASE_URL", fal.url)
    server = scripted_server({"default": [call("image_generate", prompt="a cat"), think("Here is the cat.")]})
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"draw cat {i}"} for i in range(3)])
    run_dir = tmp_path / "data" / "run"
    run_dir.mkdir(parents=True)
    wrapper = tmp_path / "python-ro"
    wrapper.write_text(RO_WRAPPER.format(run_dir=run_dir, python=sys.executable))
    wrapper.chmod(0o755)

    done = subprocess.run([sys.executable, "-c", RUN, str(wrapper), server.url], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)

    assert done.returncode == 0, done.stderr
    assert read_jsonl(run_dir / "failures.jsonl") == []
    rows = read_jsonl(run_dir / "trajectories.jsonl")
    paths = [path for r in rows for m in r["conversations"] if m["from"] == "tool"
             for path in re.findall(r"files/image-[0-9a-f]+\.png", m["value"])]
    assert len(paths) == 3 and len(set(paths)) == 3
    for path in paths:  # relative to the run directory, and there
        assert path.startswith("files/") and (run_dir / path).read_bytes() == PNG
    assert sorted(p.name for p in (run_dir / "files").iterdir()) == sorted(Path(p).name for p in paths)


SECOND_RUN = """import os, sys
from multiprocessing import forkserver
from trajgen import run
from trajgen.options import RunOptions
forkserver.ensure_running()  # started before the key below existed
os.environ.update(FAL_KEY="fal-key", FAL_BASE_URL=sys.argv[2])
sys.exit(run.run(RunOptions(dataset_file="prompts.jsonl", run_name="run", base_url=sys.argv[1], api_key="dummy",
                            model="test-model", num_workers=1, distribution="default", max_retries=1)))
"""


def test_workers_get_the_environment_of_their_run(scripted_server, fake_api, tmp_path):  # noqa: F811
    """A fork server already running (a library user's own, say) keeps the environment it started
    with; a key set since still reaches the run's workers."""
    fal = fake_api({"/fal-ai/flux/schnell": (200, {"images": [
        {"url": "data:image/png;base64," + base64.b64encode(PNG).decode()}]})})
    server = scripted_server({"default": [call("image_generate", prompt="a cat"), think("Here is the cat.")]})
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "draw a cat"}])
    env = {name: value for name, value in os.environ.items() if not name.startswith("FAL_")}

    done = subprocess.run([sys.executable, "-c", SECOND_RUN, server.url, fal.url], cwd=tmp_path,
                          env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)

    assert done.returncode == 0, done.stderr
    files = list((tmp_path / "data" / "run" / "files").iterdir())
    assert [f.read_bytes() for f in files] == [PNG]
