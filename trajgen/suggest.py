"""Did-you-mean for a word a user typed: a flag's name or one of a flag's values.

What people mean is looked up first (`meant`: the known confusions, such as `--samples` for
`--samples_per_prompt`), then the spelling, with or without underscores and hyphens.
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping


def closest(word: str, choices: Iterable[str], meant: Mapping[str, str] | None = None) -> str | None:
    """The choice `word` most likely stands for, or None."""
    choices = list(choices)
    typed = word.strip().lower().replace("-", "_")
    if meant and (found := meant.get(typed) or meant.get(typed.replace("_", ""))) in choices:
        return found
    close = difflib.get_close_matches(typed, choices, n=1, cutoff=0.6)
    if close:
        return close[0]
    squashed = {c.replace("_", ""): c for c in choices}
    close = difflib.get_close_matches(typed.replace("_", ""), squashed, n=1, cutoff=0.6)
    return squashed[close[0]] if close else None


def did_you_mean(word: str, choices: Iterable[str], meant: Mapping[str, str] | None = None, prefix: str = "") -> str:
    """`; did you mean <prefix><choice>?`, or nothing when no choice is close."""
    found = closest(word, choices, meant)
    return f"; did you mean {prefix}{found}?" if found else ""
