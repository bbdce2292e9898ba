"""Which turns of a conversation one summary replaces, so that it fits a token target: the plan shared
by --compress (a finished row's ShareGPT turns) and --context_budget (the messages of a request).

The first system, human, gpt and tool turns stay verbatim, and so do the last four; of the turns
between, the fewest from their start are replaced by one summary turn. A tool call and its results
are one group: never parted, each side of a cut keeps whole groups. A pure function of the turns'
kinds, call ids and token counts.
"""
from __future__ import annotations

from dataclasses import dataclass

KEEP_LAST = 4  # turns at the end kept verbatim
KINDS = ("system", "human", "gpt", "tool")  # the first turn of each kind is kept verbatim
CHARS_PER_TOKEN = 4  # the estimate without --tokenizer: English text and JSON average about four characters a token


@dataclass(frozen=True)
class Turn:
    kind: str  # system, human, gpt or tool
    calls: tuple[str, ...] = ()  # a gpt turn's tool call ids
    answers: str | None = None  # a tool turn's call id


@dataclass(frozen=True)
class Fits:
    """At or under the target already: nothing to do."""


@dataclass(frozen=True)
class Cut:
    """Replace turns[start:end] with one summary turn of at most `budget` tokens."""

    start: int
    end: int
    budget: int

    @property
    def turns(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Unreachable:
    """Even with every middle turn summarized, the kept turns and the summary exceed the target."""

    kept_tokens: int


@dataclass(frozen=True)
class Orphan:
    """A tool call without its result, or a result without its call, at turn `turn`: kept as it is."""

    turn: int


Plan = Fits | Cut | Unreachable | Orphan


def summary_budget(target: int) -> int:
    """The summary's stated length: a tenth of the target, at most 1,000 tokens."""
    return min(1000, target // 10)


def estimate(text: str) -> int:
    """Tokens of `text` without a tokenizer (CHARS_PER_TOKEN)."""
    return -(-len(text) // CHARS_PER_TOKEN)


def groups(turns: list[Turn]) -> list[tuple[int, int]] | Orphan:
    """The turns as [start, end) groups: a gpt turn with its calls' results, or one turn alone."""
    found: list[tuple[int, int]] = []
    pending: set[str] = set()
    for i, turn in enumerate(turns):
        if turn.kind == "tool":
            if turn.answers not in pending:
                return Orphan(i)
            pending.discard(turn.answers)
            found[-1] = (found[-1][0], i + 1)
            continue
        if pending:
            return Orphan(found[-1][0])
        found.append((i, i + 1))
        pending = set(turn.calls)
    return Orphan(found[-1][0]) if pending else found


def plan(turns: list[Turn], tokens: list[int], total: int, target: int) -> Plan:
    """The cut that brings `total` tokens (the turns' own `tokens`, or a request's whole prompt) to
    `target` or under, summarizing the fewest middle turns from the middle's start. A tool call
    without its result makes the conversation one to keep as it is, whatever its length."""
    found = groups(turns)
    if isinstance(found, Orphan):
        return found
    if total <= target:
        return Fits()
    budget = summary_budget(target)
    firsts = [next(i for i, t in enumerate(turns) if t.kind == kind) for kind in KINDS
              if any(t.kind == kind for t in turns)]
    head = next(end for start, end in found if start <= max(firsts) < end)
    tail = next(start for start, end in found if start <= max(len(turns) - KEEP_LAST, 0) < end)
    need, removed = total - target + budget, 0
    for start, end in found:
        if head <= start and end <= tail:
            removed += sum(tokens[start:end])
            if removed >= need:
                return Cut(head, end, budget)
    return Unreachable(total - removed + budget)


def summary_messages(texts: list[tuple[str, str]], budget: int) -> list[dict]:
    """The request for a summary of `texts` ((kind, text) per turn), in at most `budget` tokens."""
    transcript = "\n\n".join(f"[{kind}]\n{text}" for kind, text in texts)
    return [{"role": "system", "content": (
                "You summarize the middle of an AI agent's conversation so that the agent can go on without it. "
                "Keep what it still needs: the task's facts, what it tried, what the tools returned that matters, "
                "file names, values, errors, and what is left to do. Write plain prose, no preamble.")},
            {"role": "user", "content": f"Summarize these {len(texts)} turns in at most {budget} tokens "
                                        f"(about {budget * 3 // 4} words):\n\n{transcript}"}]


def summary_turn_text(turns: int, summary: str) -> str:
    """The text of the turn that stands for `turns` earlier turns."""
    return f"[A summary of {turns} earlier turns, which were removed to fit the context]\n{summary.strip()}"
