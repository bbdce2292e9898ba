"""The model as the agent loop sees it: `complete(messages, tools, forbid_tools) -> Reply`.

`OpenAIModel` is the real endpoint (one retry policy, in trajgen/llm.py); `ScriptedModel` replays
replies in process, so the loop can be tested without HTTP (mini-swe-agent's DeterministicModel).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import openai

from trajgen import llm
from trajgen.work import ModelSettings


@dataclass(frozen=True)
class Reply:
    message: dict  # the assistant message as the endpoint returned it: content, tool_calls, reasoning fields
    usage: dict = field(default_factory=dict)  # prompt_tokens, completion_tokens, reasoning_tokens, cost (any missing)
    served_by: dict = field(default_factory=dict)  # the response's `model`, and `provider` when OpenRouter names one


class ModelClient(Protocol):
    async def complete(self, messages: list[dict], tools: list[dict], forbid_tools: bool) -> Reply:
        """One reply to `messages`. With `forbid_tools` the tools stay listed (providers refuse a
        history of tool calls without them) but may not be called."""
        ...


class OpenAIModel:
    """An OpenAI-compatible endpoint through one shared client."""

    def __init__(self, client: openai.AsyncOpenAI, settings: ModelSettings, on_throttle: Callable[[], None]):
        self.client, self.settings, self.on_throttle = client, settings, on_throttle

    async def complete(self, messages: list[dict], tools: list[dict], forbid_tools: bool) -> Reply:
        response = await llm.complete(self.client, self.settings, messages, tools, self.on_throttle, forbid_tools)
        provider = (response.model_extra or {}).get("provider")
        served_by = {"model": response.model, **({"provider": provider} if isinstance(provider, str) else {})}
        return Reply(response.choices[0].message.model_dump(exclude_none=True), _usage(response.usage), served_by)


def _usage(usage) -> dict:
    if usage is None:
        return {}
    details = usage.completion_tokens_details
    cost = (usage.model_extra or {}).get("cost")
    return {"prompt_tokens": usage.prompt_tokens or 0, "completion_tokens": usage.completion_tokens or 0,
            "reasoning_tokens": (details.reasoning_tokens or 0) if details else 0,
            "cost": cost if isinstance(cost, (int, float)) else None}


class ScriptedModel:
    """Replays `replies` in order (each a Reply, or an exception to raise) and keeps what it was sent."""

    def __init__(self, replies: list[Reply | BaseException]):
        self.replies = list(replies)
        self.requests: list[dict] = []

    async def complete(self, messages: list[dict], tools: list[dict], forbid_tools: bool) -> Reply:
        self.requests.append({"messages": [dict(m) for m in messages], "tools": tools, "forbid_tools": forbid_tools})
        if not self.replies:
            raise AssertionError("the script has no reply left")
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return reply


def tool_call(name: str, arguments: str = "{}", call_id: str | None = None) -> dict:
    """A tool call as an endpoint returns it, for scripts."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}, **({"id": call_id} if call_id else {})}
