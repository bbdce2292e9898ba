"""--help, --list_distributions and --list_tools: generated, grouped, readable at 80 columns, no pager."""
from __future__ import annotations

import os
import re
import sys

import pytest

from tests.conftest import ROOT, in_terminal
from trajgen import help_text, options, tool_check
from trajgen.sandbox import apptainer
from trajgen.distributions import DISTRIBUTIONS, TOOLSETS
from trajgen.options import RunOptions
from trajgen.registry import REGISTRY

ENTRY = re.compile(r"^  --(\w+)", re.MULTILINE)


def test_every_flag_has_a_help_group():
    for field in options.FIELDS:
        group = field.metadata.get("group")
        assert group in options.GROUPS, (
            f"RunOptions.{field.name} has {'no --help group' if group is None else f'the unknown group {group!r}'}: "
            f"give its flag(...) group= one of {', '.join(options.GROUPS)} (trajgen/options.py GROUPS)")


def test_the_help_names_every_flag_once_first_run_flags_first(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    text = help_text.help_text("python batch_runner.py", "Summary.")
    names = ENTRY.findall(text)
    assert sorted(names) == sorted(f.name for f in options.FIELDS)
    first = [f.name for f in options.FIELDS if f.metadata["first_run"]]
    assert names[:len(first)] == first and "dataset_file" in first and "base_url" in first
    titles = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert titles == [help_text.FIRST_RUN_TITLE, *options.GROUPS.values()]
    assert "[default: anthropic/claude-sonnet-4.6]" in " ".join(text.split())  # in full, however it wraps


@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("listing", ["help", "distributions", "tools"])
def test_listings_fit_the_terminal_and_cut_no_name(monkeypatch, listing, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    text = {"help": lambda: help_text.help_text("python batch_runner.py", "Summary."),
            "distributions": help_text.distributions_text,
            "tools": lambda: tool_check.listing(RunOptions(unsafe_local=True))}[listing]()
    assert max(len(line) for line in text.splitlines()) <= columns
    assert "…" not in text and "..." not in text
    words = set(re.findall(r"[\w.-]+", text))
    names = {"help": [f"--{f.name}" for f in options.FIELDS], "distributions": [*DISTRIBUTIONS, *TOOLSETS],
             "tools": [*REGISTRY, *TOOLSETS]}[listing]
    for name in names:
        assert name in words, name


def test_list_tools_says_why_a_tool_is_unavailable_and_what_to_do(monkeypatch):
    for variable in ("TAVILY_API_KEY", "EXA_API_KEY", "FIRECRAWL_API_KEY", "SEARXNG_URL", "FAL_KEY"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("TAVILY_API_KEY", "k")
    available = tool_check.listing(RunOptions(unsafe_local=True, image_model="img"))
    assert re.search(r"web_search +available", available) and re.search(r"image_generate +available", available)
    monkeypatch.delenv("TAVILY_API_KEY")
    removed = " ".join(tool_check.listing(RunOptions(unsafe_local=True)).split())
    assert "web_search unavailable: no search provider configured: set one of TAVILY_API_KEY" in removed
    assert "image_generate unavailable: no image backend: set --image_model" in removed


def test_list_tools_honours_the_backend_and_private_urls(monkeypatch):
    monkeypatch.setattr(tool_check, "bwrap_problem", lambda: "bwrap (bubblewrap) is not installed")
    text = " ".join(tool_check.listing(RunOptions()).split())
    assert "terminal unavailable: its sandbox cannot run" in text and "apt-get install bubblewrap" in text
    assert "terminal available" in " ".join(tool_check.listing(RunOptions(unsafe_local=True)).split())
    monkeypatch.setenv("PATH", "/nonexistent")
    apptainer.runtime.cache_clear()  # asked once per process; found again with the real PATH after this test
    try:
        text = " ".join(tool_check.listing(RunOptions(terminal_backend="apptainer")).split())
    finally:
        apptainer.runtime.cache_clear()
    assert "read_file unavailable" in text and "neither apptainer nor singularity is on PATH" in text
    assert "any address: --allow_private_urls" in tool_check.listing(RunOptions(allow_private_urls=True))
    assert "public addresses only" in tool_check.listing(RunOptions())


def test_help_in_a_terminal_prints_at_once_with_no_pager_and_no_banner(tmp_path):
    """Under a pseudo-terminal Fire's help opened `less`, which waits for a key: here nothing may wait."""
    env = {k: v for k, v in os.environ.items() if k not in ("PAGER", "COLUMNS")}
    env.update(PYTHONPATH=str(ROOT), PAGER="less", HOME=str(tmp_path))
    code, text = in_terminal([sys.executable, str(ROOT / "batch_runner.py"), "--help"], tmp_path, env, deadline=60)
    assert code == 0, f"--help still running after 60 s (waiting for input?): {text[-300:]!r}"
    assert "INFO:" not in text and "Showing help" not in text
    assert sorted(ENTRY.findall(text)) == sorted(f.name for f in options.FIELDS)
