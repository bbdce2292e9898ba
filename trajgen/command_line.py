"""Every command-line argument accounted for before anything starts.

Fire hands `main` the flags it recognises and complains about the rest only after `main`
returns, by which time a run has spent money at the default settings. So the arguments are
read here, against `RunOptions`: an unknown flag, a stray positional argument, a missing value
or a value of the wrong type is a one-line usage error that names the flag and, for a
misspelling or a name other tools use, the flag meant (trajgen/suggest.py). Fire still renders --help.
"""
from __future__ import annotations

import math
import types
import typing

from trajgen.errors import UsageError
from trajgen.options import FIELDS, TYPES
from trajgen.suggest import did_you_mean

HELP = ("--help", "-h")
TRUE, FALSE = ("true", "yes", "1", "on"), ("false", "no", "0", "off")
_NAMES = tuple(f.name for f in FIELDS)
MEANT = {  # flags other tools name otherwise, which a spelling match would miss or get wrong
    "samples": "samples_per_prompt", "num_samples": "samples_per_prompt", "n": "samples_per_prompt",
    "workers": "num_workers", "prompts": "dataset_file", "input": "dataset_file", "temp": "temperature",
    "endpoint": "base_url", "api_base": "base_url", "budget": "max_cost", "limit": "max_samples",
    "format": "export",
}


def wants_help(argv: list[str]) -> bool:
    return any(a in HELP for a in argv) or argv[:2] == ["--", "--help"]


def parse(argv: list[str]) -> dict[str, object]:
    """The flags as typed keyword arguments for `batch_runner.main`; UsageError on anything else.
    Accepts `--name=value`, `--name value`, `--name` and `--noname` for booleans, `-` for `_`."""
    parsed: dict[str, object] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("-") or arg in ("-", "--"):
            raise UsageError(f"{arg!r}: unexpected argument; every argument is a --flag=value{_positional_hint(arg)}")
        written, has_value, value = arg.lstrip("-").partition("=")
        name = written.replace("-", "_")
        if name not in TYPES and not has_value and name.startswith("no") and _kind(name[2:]) is bool:
            name, value, has_value = name[2:], "false", True
        if name not in TYPES:
            raise UsageError(f"--{written}: no such flag{_suggestion(name)}")
        if not has_value and _kind(name) is bool:
            has_value, value = i < len(argv) and argv[i].lower() in TRUE + FALSE, "true"
            if has_value:
                value, i = argv[i], i + 1
        elif not has_value:
            if i == len(argv) or argv[i].startswith("--"):
                raise UsageError(f"--{name} needs a value ({_describe(name)})")
            value, i = argv[i], i + 1
        if name in parsed:
            raise UsageError(f"--{name} is given twice")
        parsed[name] = convert(name, value)
    return parsed


def convert(name: str, text: str):
    """`text` as the flag's type; UsageError naming the flag and the type expected."""
    kind = _kind(name)
    if text == "None" and _optional(name):
        return None
    try:
        if kind is bool:
            if text.lower() not in TRUE + FALSE:
                raise ValueError
            return text.lower() in TRUE
        if kind is int:
            return int(text)
        if int in typing.get_args(TYPES[name]) and text.strip().lstrip("+-").isdigit():  # an integer, or a word
            return int(text)  # (--num_workers=auto)
        if kind is float:
            value = float(text)
            if math.isnan(value):
                raise ValueError
            return value
    except ValueError:
        raise UsageError(f"--{name}={text}: expected {_describe(name)}") from None
    return text


def _kind(name: str) -> type | None:
    """bool, int, float or str: the flag's type without `| None`."""
    hint = TYPES.get(name)
    args = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(hint, types.UnionType) else [hint]
    return args[0] if len(args) == 1 and args[0] in (bool, int, float, str) else str if hint is not None else None


def _optional(name: str) -> bool:
    return type(None) in typing.get_args(TYPES[name])


def _describe(name: str) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[_kind(name)]


def _suggestion(name: str) -> str:
    return did_you_mean(name, _NAMES, MEANT, "--") or "; python batch_runner.py --help lists every flag"


def _positional_hint(arg: str) -> str:
    return f" (did you mean --dataset_file={arg}?)" if arg.endswith(".jsonl") else " (see --help)"
