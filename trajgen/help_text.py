"""`--help`, `--list_distributions` and `--list_tools` as plain text wrapped to the terminal's width.

Printed straight to stdout: no pager (a pager waits for input a script never sends) and nothing
cut. The help is generated from `RunOptions`: one entry per flag, grouped by what a user is doing,
the flags a first run needs first; the full reference is docs/flags.md.
"""
from __future__ import annotations

import dataclasses
import shutil
import textwrap

from trajgen.distributions import DISTRIBUTIONS, TOOLSETS
from trajgen.options import FIELDS, GROUPS

MIN_WIDTH = 40
FIRST_RUN_TITLE = "First run"
OTHER_TITLE = "Other"  # flags without a group: tests/test_help.py fails on any


def fill(text: str, columns: int, first: str = "", rest: str = "") -> str:
    """`text` wrapped to `columns`, never inside a word, a flag or a path."""
    return textwrap.fill(text, columns, initial_indent=first, subsequent_indent=rest, break_long_words=False,
                         break_on_hyphens=False)


def width() -> int:
    """The terminal's columns ($COLUMNS first), 80 when there is no terminal."""
    return max(MIN_WIDTH, shutil.get_terminal_size((80, 24)).columns)


def short_help(text: str) -> str:
    """The first sentence of a flag's help (a period followed by a space, outside parentheses)."""
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "." and depth == 0 and text[i + 1:i + 2] == " ":
            return text[:i + 1]
    return text


def shown_default(field: dataclasses.Field) -> str:
    """The default as typed on the command line; empty when unset (None, false, "")."""
    value = field.default
    if value is None or value is False or value == "":
        return ""
    return "true" if value is True else str(value)


def entry(field: dataclasses.Field, columns: int, column: int) -> str:
    """One flag: its name, the first sentence of its help, its full default, wrapped under the help."""
    default = shown_default(field)
    text = short_help(field.metadata["help"]) + (f" [default: {default}]" if default else "")
    name, indent = f"  --{field.name}", " " * column
    if len(name) + 2 > column:  # a long name, or a narrow terminal: the help starts on the next line
        return f"{name}\n{fill(text, columns, indent, indent)}"
    return fill(text, columns, name.ljust(column), indent)


def sections() -> list[tuple[str, list[dataclasses.Field]]]:
    """(title, flags): the first-run flags, then every group in GROUPS order; each flag once."""
    first = [f for f in FIELDS if f.metadata.get("first_run")]
    rest = [f for f in FIELDS if not f.metadata.get("first_run")]
    found = [(GROUPS[g], [f for f in rest if f.metadata.get("group") == g]) for g in GROUPS]
    other = [f for f in rest if f.metadata.get("group") not in GROUPS]
    return [(FIRST_RUN_TITLE, first), *found, *([(OTHER_TITLE, other)] if other else [])]


def help_text(prog: str, summary: str) -> str:
    columns = width()
    column = min(max(len(f.name) for f in FIELDS) + 6, max(columns // 3, 20))
    parts = [fill(f"usage: {prog} --dataset_file=FILE --run_name=NAME [more --flag=value]", columns), "",
             fill(summary, columns)]
    for title, fields in sections():
        if fields:
            parts += ["", f"{title}:", *(entry(f, columns, column) for f in fields)]
    parts += ["", fill("Booleans take --flag, --noflag or --flag=false. Try a first run with --dry_run, which checks "
                       "everything and sends one tiny request. Every flag in full is in docs/flags.md.", columns)]
    return "\n".join(parts)


def distributions_text(mcp_toolsets: tuple[str, ...] = ()) -> str:
    """One block per distribution: its name and description, then each toolset's chance; then the
    MCP toolsets of a --mcp_config, which --toolsets or a distribution file can offer."""
    columns = width()
    parts = [fill("Toolset distributions (--distribution=NAME): the percent chance that each toolset is offered "
                  "to a prompt, drawn per prompt.", columns)]
    for d in DISTRIBUTIONS.values():
        chances = ", ".join(f"{t} {d.chances[t]}%" for t in TOOLSETS if t in d.chances)
        parts += ["", fill(f"{d.name}: {d.description}", columns), fill(chances, columns, "  ", "  ")]
    if mcp_toolsets:
        example = f'{{"terminal": 100, "{mcp_toolsets[0]}": 80}}'
        parts += ["", fill(f"MCP toolsets (--mcp_config): {', '.join(mcp_toolsets)}. Offer them with --toolsets or a "
                           f"--distribution JSON file, e.g. {example}", columns)]
    return "\n".join(parts)


def tools_text(backend: str, toolsets: dict[str, list[tuple[str, str | None, str]]], sandbox: str | None) -> str:
    """Each toolset and its tools (name, why it is unavailable or None, a note when available), as
    `available` or `unavailable: why and what to do`. `sandbox`: why the terminal and file tools
    cannot run under `backend`, or None."""
    columns = width()
    column = min(max(len(name) for tools in toolsets.values() for name, _, _ in tools) + 6, columns // 3)
    lines = [fill(f"Tools under --terminal_backend={backend} (the terminal and file tools run in its sandbox):",
                  columns)]
    for toolset, tools in toolsets.items():
        lines += ["", f"{toolset}:"]
        for name, reason, note in tools:
            status = f"available{note}" if reason is None else f"unavailable: {reason}"
            head = f"  {name}".ljust(column)
            lines.append(fill(status, columns, head, " " * column))
    if sandbox:
        lines += ["", fill(f"sandbox: {sandbox}", columns)]
    return "\n".join(lines)

