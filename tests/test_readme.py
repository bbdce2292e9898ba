"""The README documents every flag the CLI has, with its default."""
from __future__ import annotations

import inspect
from pathlib import Path

import batch_runner

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_every_flag_is_in_the_readme_with_its_default():
    for name, parameter in inspect.signature(batch_runner.main).parameters.items():
        default = parameter.default
        shown = batch_runner.DEFAULT_BASE_URL if name == "base_url" else repr(default)
        assert f"| `--{name}` | `{shown}` |" in README, name
