"""--context_budget=N: before a request would hold more than N tokens, the middle of the conversation is
replaced by one summary (the plan of trajgen/compaction.py, the summary model of trajgen/roles.py), and
the shorter request is sent. The transcript, and so the row, keeps every turn; the row records each
compaction under `metadata.compactions` (a new training sample starts there: trajgen/samples.py).

Tokens are counted with --tokenizer (the request rendered by its chat template), or, without one,
as the previous reply's reported prompt tokens plus an estimate of the messages since
(compaction.estimate), with a margin of a tenth of the budget for what the estimate misses.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import orjson

from trajgen import compaction, tokenizer, trajectory
from trajgen.model import ModelClient

KIND = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}
MARGIN = 10  # without --tokenizer, compact once the estimate is within budget / MARGIN of the budget
ATTEMPTS = 3  # compactions of one request before it is sent as it is (its kept turns alone are too long)


def text(message: dict) -> str:
    """What of a message the model reads: its content and its tool calls."""
    content = message.get("content")
    parts = [content if isinstance(content, str) else orjson.dumps(content).decode() if content else ""]
    parts += [f"{c['function']['name']} {c['function']['arguments']}" for c in message.get("tool_calls") or ()]
    return "\n".join(p for p in parts if p)


def turn(message: dict) -> compaction.Turn:
    return compaction.Turn(KIND.get(message["role"], "human"), tuple(c["id"] for c in message.get("tool_calls") or ()),
                           message.get("tool_call_id"))


@dataclass
class Window:
    """One conversation's requests under the budget: messages[:head] + [summary] + messages[start:]
    once compacted (each compaction summarizes from `head` on, an earlier summary included)."""

    budget: int
    tokenizer_name: str | None
    summarizer: Callable[[], ModelClient]  # the prompt's summary model, made on its first use
    head: int = 0
    summary: dict | None = None
    start: int = 0
    sent: int = 0  # messages in the last request: the prompt tokens the endpoint reported were theirs
    compactions: list[dict] = field(default_factory=list)
    over_budget: int = 0  # requests sent over the budget: their kept turns alone exceed it

    def view(self, messages: list[dict]) -> list[dict]:
        return messages if self.summary is None else [*messages[:self.head], self.summary, *messages[self.start:]]

    def tokens(self, view: list[dict]) -> list[int]:
        if self.tokenizer_name:
            tok = tokenizer.load(self.tokenizer_name)
            return [tokenizer.count(tok, text(m)) for m in view]
        return [compaction.estimate(text(m)) for m in view]

    def total(self, view: list[dict], schemas: list[dict], prompt_tokens: int | None) -> int:
        """The request's tokens: rendered by --tokenizer's chat template, else the previous request's
        reported prompt tokens and the estimate of the messages since."""
        if self.tokenizer_name:
            return len(tokenizer.render(tokenizer.load(self.tokenizer_name), view, schemas))
        if prompt_tokens and self.sent:
            return prompt_tokens + sum(self.tokens(view[self.sent:]))
        return sum(self.tokens(view))

    async def fit(self, messages: list[dict], schemas: list[dict], prompt_tokens: int | None,
                  gpt_turn: int) -> list[dict]:
        """The messages to send for the request of gpt turn `gpt_turn` (0-based); `prompt_tokens`: what
        the endpoint reported for the previous request."""
        target = self.budget if self.tokenizer_name else self.budget - self.budget // MARGIN
        view = self.view(messages)
        total = self.total(view, schemas, prompt_tokens)
        for _ in range(ATTEMPTS):
            tokens = self.tokens(view)
            cut = compaction.plan([turn(m) for m in view], tokens, total, target)
            if not isinstance(cut, compaction.Cut) or (self.summary is not None and cut.start != self.head):
                break
            await self._compact(messages, view, cut, gpt_turn)
            view = self.view(messages)
            total = (self.total(view, schemas, None) if self.tokenizer_name else
                     total - sum(tokens[cut.start:cut.end]) + compaction.estimate(self.summary["content"]))
        self.over_budget += total > self.budget
        self.sent = len(view)
        return view

    async def _compact(self, messages: list[dict], view: list[dict], cut: compaction.Cut, gpt_turn: int) -> None:
        texts = [(KIND.get(m["role"], "human"), text(m)) for m in view[cut.start:cut.end]]
        reply = await self.summarizer().complete(compaction.summary_messages(texts, cut.budget), [], False)
        summary = trajectory.split_reasoning(reply.message)[1]
        first_kept = cut.end if self.summary is None else self.start + cut.end - self.head - 1
        self.head, self.start = cut.start, first_kept
        self.summary = {"role": "user", "content": compaction.summary_turn_text(cut.turns, summary)}
        self.compactions.append({"before_turn": gpt_turn, "turns": cut.turns, "summary": summary})
