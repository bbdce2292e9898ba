"""The model as the agent loop sees it: `complete(messages, tools, forbid_tools) -> Reply`.

`OpenAIModel` is the real endpoint (one retry policy, in trajgen/chat_calls.py); `ScriptedModel` replays
replies in process, so the loop can be tested without HTTP (mini-swe-agent's DeterministicModel).
Both hand the loop only checked replies (`checked`): a reply the loop cannot use faithfully fails
its prompt here, as MalformedResponse, and never reaches a row.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

import orjson

from trajgen import chat_calls, token_ids
from trajgen.errors import EmptyAnswer, MalformedResponse
from trajgen.task import ModelSettings

USAGE_KEYS = ("prompt_tokens", "completion_tokens", "reasoning_tokens")
UNKNOWN = "replies_without_usage"  # a usage's count of replies that said nothing of their tokens (0 is not absent)


@dataclass(frozen=True)
class Reply:
    message: dict  # the assistant message as the endpoint returned it: content, tool_calls, reasoning fields
    usage: dict = field(default_factory=dict)  # prompt_tokens, completion_tokens, reasoning_tokens, cost (any missing)
    served_by: dict = field(default_factory=dict)  # the response's `model`, and `provider` when OpenRouter names one
    timing: dict = field(default_factory=dict)  # seconds to the first byte, to the first token, of generation
    finish_reason: object = None  # as the endpoint sent it ("length": cut by the token limit)
    tokens: dict | None = None  # with --token_ids or --tokenizer: the call's ids (token_ids.checked, tokenizer.py)


class ModelClient(Protocol):
    async def complete(self, messages: list[dict], tools: list[dict], forbid_tools: bool,
                       args: dict | None = None) -> Reply:
        """One reply to `messages`. With `forbid_tools` the tools stay listed (providers refuse a
        history of tool calls without them) but may not be called. `args`: the request's body
        (`chat_calls.request_args`) when the caller built it already, the journal to hash it."""
        ...


class OpenAIModel:
    """An OpenAI-compatible endpoint through the worker's shared connection pool, for one prompt:
    `stalls` counts its calls abandoned for silence."""

    def __init__(self, endpoint: chat_calls.Endpoint, settings: ModelSettings, on_throttle: Callable[[], None],
                 on_retry: Callable[[Exception, int, int, float], None] | None = None):
        self.endpoint, self.settings, self.on_throttle, self.on_retry = endpoint, settings, on_throttle, on_retry
        self.stalls = 0

    def _stalled(self) -> None:
        self.stalls += 1

    async def complete(self, messages: list[dict], tools: list[dict], forbid_tools: bool,
                       args: dict | None = None) -> Reply:
        response = await chat_calls.complete(self.endpoint, self.settings, messages, tools, self.on_throttle, forbid_tools,
                                      self._stalled, self.on_retry, args)
        provider = response.provider
        served_by = {"model": response.model, **({"provider": provider} if isinstance(provider, str) else {})}
        reply = checked(response.message, reply_usage(response.usage, self.settings.price_per_mtok))
        tokens = token_ids.checked(response.tokens, reply.usage) if self.settings.token_ids else None
        return replace(reply, served_by=served_by, timing=response.timing, finish_reason=response.finish_reason,
                       tokens=tokens)


def _short(value) -> str:
    return orjson.dumps(value, default=repr).decode()[:200]


def reply_usage(usage, price_per_mtok: tuple[float, float] | None = None) -> dict:
    """Token counts and cost of one reply; counts that are not counts are refused, since the
    spend limits rely on them. A reply without token counts says so (UNKNOWN); one without a cost
    is priced at `price_per_mtok` (dollars per million input, output tokens) when it is stated."""
    if usage is None:
        usage = {}
    if not isinstance(usage, dict):
        raise MalformedResponse(f"the reply's usage is not an object: {_short(usage)}")
    details = usage.get("completion_tokens_details")
    details = details if isinstance(details, dict) else {}
    unknown = usage.get("prompt_tokens") is None and usage.get("completion_tokens") is None
    counts = counted({"prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
                      "reasoning_tokens": details.get("reasoning_tokens"), "cost": usage.get("cost"),
                      UNKNOWN: int(unknown)})
    if counts["cost"] is None and price_per_mtok is not None and not unknown:
        counts["cost"] = (counts["prompt_tokens"] * price_per_mtok[0]
                          + counts["completion_tokens"] * price_per_mtok[1]) / 1e6
    return counts


def counted(usage: dict) -> dict:
    """A reply's usage as a Reply holds it (USAGE_KEYS, cost, UNKNOWN), from the endpoint's or as stored
    by the journal or the cache; counts that are not counts are refused."""
    counts = {key: 0 if usage.get(key) is None else usage[key] for key in USAGE_KEYS}  # null counts as absent
    for key, value in counts.items():
        if type(value) is not int or value < 0:
            raise MalformedResponse(f"the reply's usage has {key} {_short(value)}, not a token count")
    cost = usage.get("cost")
    cost = cost if type(cost) in (int, float) and 0 <= cost < float("inf") else None
    return {**counts, "cost": cost, **({UNKNOWN: 1} if usage.get(UNKNOWN) else {})}


def no_usage() -> dict:
    return {**dict.fromkeys(USAGE_KEYS, 0), "cost": None}


def add_usage(total: dict, usage: dict) -> None:
    for key in USAGE_KEYS:
        total[key] += usage.get(key, 0)
    if usage.get("cost") is not None:
        total["cost"] = (total["cost"] or 0.0) + usage["cost"]
    if usage.get(UNKNOWN):
        total[UNKNOWN] = total.get(UNKNOWN, 0) + usage[UNKNOWN]


def checked(message: dict, usage: dict) -> Reply:
    """The reply as the loop may use it, or MalformedResponse saying what the endpoint did.

    The only repair is lossless: arguments sent as a JSON object are encoded to the string the API
    specifies, and the transcript carries that string, so the row replays exactly what was sent
    back to the model (a call without an id gets one from the loop, likewise). Anything that would
    change the data is refused: a call without a function or a string function name, arguments of
    another type, two calls with one id, content or reasoning that is not text, reasoning_details
    that are not a list, a reply with nothing in it."""
    def bad(what: str) -> MalformedResponse:
        return MalformedResponse(f"the reply {what}", usage)

    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise bad(f"has content that is not text: {_short(content)}")
    for name in ("reasoning", "reasoning_content"):
        if message.get(name) is not None and not isinstance(message[name], str):
            raise bad(f"has {name} that is not text: {_short(message[name])}")
    if message.get("reasoning_details") is not None and not isinstance(message["reasoning_details"], list):
        raise bad(f"has reasoning_details that are not a list: {_short(message['reasoning_details'])}")
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise bad(f"has tool_calls that are not a list: {_short(calls)}")
    clean, ids = [], set()
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise bad(f"has a tool call without a function: {_short(call)}")
        name, arguments, call_id = function.get("name"), function.get("arguments"), call.get("id")
        if not isinstance(name, str) or not name:
            raise bad(f"has a tool call whose function name is {'missing' if name is None else 'not a string'}: "
                      f"{_short(call)}")
        if isinstance(arguments, dict):
            arguments = orjson.dumps(arguments).decode()
        elif not isinstance(arguments, str):
            raise bad(f"has a tool call whose arguments are not a JSON string or object: {_short(call)}")
        if call_id is not None and not isinstance(call_id, str):
            raise bad(f"has a tool call whose id is not a string: {_short(call)}")
        if call_id and call_id in ids:
            raise bad(f"has two tool calls with the id {call_id!r}")
        ids.add(call_id)
        clean.append({**({"id": call_id} if call_id else {}), "type": "function",
                      "function": {"name": name, "arguments": arguments}})
    if not clean and not (content or "").strip():
        raise EmptyAnswer("the reply has neither content nor tool calls (an empty answer)", usage)
    return Reply({**message, "tool_calls": clean} if clean else {k: v for k, v in message.items() if k != "tool_calls"},
                 usage)


class Metered:
    """A prompt's model, summing the usage of every reply it paid for, a malformed one included,
    so a prompt that fails after paid calls still counts them."""

    def __init__(self, model: ModelClient):
        self.model, self.usage = model, no_usage()

    async def complete(self, messages: list[dict], tools: list[dict], forbid_tools: bool,
                       args: dict | None = None) -> Reply:
        try:
            reply = await self.model.complete(messages, tools, forbid_tools, args)
        except MalformedResponse as e:
            add_usage(self.usage, e.usage)
            raise
        add_usage(self.usage, reply.usage)
        return reply


class ScriptedModel:
    """Replays `replies` in order (each a Reply, or an exception to raise) and keeps what it was sent."""

    def __init__(self, replies: list[Reply | BaseException]):
        self.replies = list(replies)
        self.requests: list[dict] = []

    async def complete(self, messages: list[dict], tools: list[dict], forbid_tools: bool,
                       args: dict | None = None) -> Reply:
        self.requests.append({"messages": [dict(m) for m in messages], "tools": tools, "forbid_tools": forbid_tools})
        if not self.replies:
            raise AssertionError("the script has no reply left")
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return replace(checked(reply.message, reply.usage), finish_reason=reply.finish_reason, tokens=reply.tokens)


def tool_call(name: str, arguments: str = "{}", call_id: str | None = None) -> dict:
    """A tool call as an endpoint returns it, for scripts."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}, **({"id": call_id} if call_id else {})}
