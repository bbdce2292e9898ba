"""The README documents every flag the CLI has, with its default, from one source: RunOptions."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import batch_runner
from trajgen import flags, options
from trajgen.errors import UsageError

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
TABLE_FLAGS = re.findall(r"^\| `--(\w+)` \|", README, re.MULTILINE)
GUARD_RAILS = ("max_cost", "max_total_tokens", "concurrency", "resume", "dry_run", "max_samples")


def test_every_flag_is_in_the_readme_with_its_default():
    for name, parameter in inspect.signature(batch_runner.main).parameters.items():
        default = parameter.default
        shown = batch_runner.DEFAULT_BASE_URL if name == "base_url" else repr(default)
        assert f"| `--{name}` | `{shown}` |" in README, name


def test_the_flag_table_is_generated_from_run_options():
    assert options.flag_table() in README, "regenerate it: python -m trajgen.options"


def test_every_flag_in_the_table_is_accepted():
    assert TABLE_FLAGS == [f.name for f in options.FIELDS]
    for field in options.FIELDS:
        value = str(field.default)
        assert flags.parse([f"--{field.name}={value}"]) == {field.name: flags.convert(field.name, value)}


@pytest.mark.parametrize("name", GUARD_RAILS)
def test_a_misspelled_guard_rail_is_refused_with_the_right_name(name):
    typos = {name[:-1], name.replace("_", ""), name[:2] + name[3] + name[2] + name[4:], name + "s"} - {name}
    for typo in typos:
        with pytest.raises(UsageError, match=f"did you mean --{name}\\?"):
            flags.parse([f"--{typo}=1"])
