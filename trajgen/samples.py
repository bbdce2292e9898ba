"""A row's model calls as training samples: token-exact sequences an RL trainer takes whole.

A conversation stays one sample while each call's prompt ids begin exactly with the previous call's
prompt ids + completion ids (the extension property): every earlier completion is then inside the
last sequence, token for token, where the model produced it. A call that breaks the property starts a
new sample, and so does the first call after a compaction (issue 50), whatever its ids.

The cause of a break is read from the first position where the new prompt differs from the sample's
sequence so far:
- it falls in an earlier completion, or just before it, and the prompt then resumes with that
  completion's remaining tokens: a leading part (or the empty think block the template had put just
  before it) was dropped (`reasoning_dropped`, e.g. Qwen3's template leaving out the `<think>`
  block of earlier turns);
- it falls in an earlier completion and nothing of it resumes: the message was parsed and rendered
  again differently (`call_rerendered`, e.g. tool-call arguments with other spacing);
- anywhere else (the system prompt, a user turn, a tool result), or the prompt is the sequence cut
  short (a trimmed context): `context_changed`.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Collection, Sequence


class Cause(str, Enum):
    REASONING_DROPPED = "reasoning_dropped"
    CALL_RERENDERED = "call_rerendered"
    CONTEXT_CHANGED = "context_changed"
    COMPACTED = "compacted"


@dataclass(frozen=True)
class Sample:
    first_turn: int  # indices into the row's gpt turns, inclusive
    last_turn: int

    def as_row(self) -> dict:
        return {"first_turn": self.first_turn, "last_turn": self.last_turn}


@dataclass(frozen=True)
class Break:
    turn: int  # the gpt turn that starts a new sample
    cause: Cause

    def as_row(self) -> dict:
        return {"turn": self.turn, "cause": self.cause.value}


def split(turns: Sequence[dict], compactions: Collection[int] = ()) -> tuple[list[Sample], list[Break]]:
    """The samples of a row's gpt turns (each turn's `tokens`: prompt_ids, completion_ids) and the
    breaks between them; `compactions`: the turns that came first after a compaction."""
    samples: list[Sample] = []
    breaks: list[Break] = []
    sequence: list[int] = []  # the current sample's ids: its last prompt and completion
    spans: list[tuple[int, int]] = []  # where each of its completions lies in `sequence`
    first = 0
    for j, turn in enumerate(turns):
        prompt, completion = turn["prompt_ids"], turn["completion_ids"]
        if j:
            cause = Cause.COMPACTED if j in compactions else _cause(sequence, spans, prompt)
            if cause is not None:
                samples.append(Sample(first, j - 1))
                breaks.append(Break(j, cause))
                first, spans = j, []
        spans.append((len(prompt), len(prompt) + len(completion)))
        sequence = [*prompt, *completion]
    if turns:
        samples.append(Sample(first, len(turns) - 1))
    return samples, breaks


def fields(turns: Sequence[dict], compactions: Collection[int] = ()) -> dict:
    """`samples` and `breaks` of the row's `metadata.token_ids`."""
    found, breaks = split(turns, compactions)
    return {"samples": [s.as_row() for s in found], "breaks": [b.as_row() for b in breaks]}


def _cause(sequence: list[int], spans: list[tuple[int, int]], prompt: list[int]) -> Cause | None:
    """None when `prompt` extends `sequence`; else why it does not (the module's docstring)."""
    if prompt[:len(sequence)] == sequence:
        return None
    differs = next((i for i, (a, b) in enumerate(zip(sequence, prompt)) if a != b), min(len(sequence), len(prompt)))
    if differs == len(prompt):  # the sequence cut short
        return Cause.CONTEXT_CHANGED
    start, end = next(((a, b) for a, b in spans if b > differs), (len(sequence), len(sequence)))
    resumed = prompt[differs]
    if any(sequence[k] == resumed and prompt[differs:differs + end - k] == sequence[k:end]
           for k in range(max(start, differs + 1), end)):
        return Cause.REASONING_DROPPED
    return Cause.CALL_RERENDERED if start <= differs else Cause.CONTEXT_CHANGED
