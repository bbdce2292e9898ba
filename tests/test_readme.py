"""The documentation: docs/flags.md lists every flag the CLI has, with its default, from one source
(RunOptions); the README stays short and its links, like the docs', lead somewhere."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import batch_runner
from trajgen import command_line, options
from trajgen.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
FLAGS_DOC = (ROOT / "docs" / "flags.md").read_text()
TABLE_FLAGS = re.findall(r"^\| `--(\w+)` \|", FLAGS_DOC, re.MULTILINE)
GUARD_RAILS = ("max_cost", "max_total_tokens", "concurrency", "resume", "dry_run", "max_samples")


def test_every_flag_is_in_the_flags_doc_with_its_default():
    for name, parameter in inspect.signature(batch_runner.main).parameters.items():
        default = parameter.default
        shown = batch_runner.DEFAULT_BASE_URL if name == "base_url" else repr(default)
        assert f"| `--{name}` | `{shown}` |" in FLAGS_DOC, name


def test_the_flag_table_is_generated_from_run_options():
    assert options.flag_table() in FLAGS_DOC, "regenerate it: python -m trajgen.options --write"


def test_every_flag_in_the_table_is_accepted():
    assert TABLE_FLAGS == [f.name for f in options.FIELDS]
    for field in options.FIELDS:
        value = str(field.default)
        assert command_line.parse([f"--{field.name}={value}"]) == {field.name: command_line.convert(field.name, value)}


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings."""
    headings = re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_the_readme_is_short_and_every_link_of_the_docs_leads_somewhere():
    assert len(README.splitlines()) <= 400
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in re.findall(r"\]\(([^)#]*)(?:#([^)]*))?\)", page.read_text()):
            if "://" in target:
                continue
            linked = (page.parent / target) if target else page
            assert linked.exists(), f"{page.name}: {target}"
            assert not anchor or anchor in anchors(linked), f"{page.name}: {target}#{anchor}"


@pytest.mark.parametrize("name", GUARD_RAILS)
def test_a_misspelled_guard_rail_is_refused_with_the_right_name(name):
    typos = {name[:-1], name.replace("_", ""), name[:2] + name[3] + name[2] + name[4:], name + "s"} - {name}
    for typo in typos:
        with pytest.raises(UsageError, match=f"did you mean --{name}\\?"):
            command_line.parse([f"--{typo}=1"])
