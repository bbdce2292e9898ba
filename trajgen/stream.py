"""A streamed chat completion: server-sent events of `chat.completion.chunk`, assembled into the
one message a non-streamed call returns, so everything after the call has one code path.

Bytes are split into events only at the blank line that ends an event, and only a whole event is
decoded: a read may end inside a UTF-8 character or inside the JSON of a tool call's arguments.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import orjson

from trajgen.errors import MalformedResponse, NotJSON, ProviderError
from trajgen.token_ids import Collector

TEXT_FIELDS = ("content", "reasoning_content", "reasoning")  # concatenated in order, as the providers send them
NAMED_STATUS = {"server_error": 500}  # an error object's `code` or `type` that names no number (OpenAI, OpenRouter)


class EventReader:
    """Splits the bytes of an event stream into the `data` of each whole event; comments
    (`: OPENROUTER PROCESSING`) and other fields are dropped. Only the new bytes are searched
    for an event's end, so one huge event costs linear time."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._cr = False  # the last piece ended with a CR, already read as a line end

    def feed(self, data: bytes) -> list[bytes]:
        if self._cr and data.startswith(b"\n"):  # the rest of a CRLF cut between two reads
            data = data[1:]
        if b"\r" in data:
            self._cr = data.endswith(b"\r")
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        else:
            self._cr = False
        if self._buffer:  # an event begun in an earlier read: only the new bytes can hold its end
            start = len(self._buffer) - 1
            self._buffer += data
            if self._buffer.find(b"\n\n", start) < 0:
                return []
            data = bytes(self._buffer)
            self._buffer.clear()
        *events, rest = data.split(b"\n\n")
        self._buffer += rest
        found = []
        for event in events:
            if event.startswith(b"data: ") and b"\n" not in event:  # one data line, as providers send it
                found.append(event[6:])
                continue
            lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                found.append(b"\n".join(lines))
        return found


@dataclass
class Assembly:
    """The message the chunks add up to, and what the stream said about the reply."""

    texts: dict[str, list[str]] = field(default_factory=dict)
    details: list = field(default_factory=list)  # reasoning_details items, in order
    calls: dict[int, dict] = field(default_factory=dict)  # tool calls by their index
    finish_reason: object = None
    usage: object = None
    model: object = None
    provider: object = None
    done: bool = False  # `data: [DONE]` arrived
    tokens: Collector | None = None  # with --token_ids: the ids and logprobs of every chunk

    @property
    def ended(self) -> bool:
        """`data: [DONE]` or a finish reason came: nothing but the usage is to follow."""
        return self.done or self.finish_reason is not None

    @property
    def complete(self) -> bool:
        """The whole reply has arrived (`data: [DONE]`, or its finish reason and its usage): it stands
        however the connection ends."""
        return self.done or (self.finish_reason is not None and self.usage is not None)

    def add(self, data: bytes) -> bool:
        """Take one event's data; True when it carried part of the answer. Nothing after
        `data: [DONE]` is part of the reply."""
        if self.done:
            return False
        if data == b"[DONE]":
            self.done = True
            return False
        chunk = json_object(data, "a streamed chunk")
        self.model = chunk.get("model", self.model)
        self.provider = chunk.get("provider", self.provider)
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not isinstance(choices, list) or (choices and not isinstance(choices[0], dict)):
            raise MalformedResponse(f"a streamed chunk has choices: {str(choices)[:200]}")
        if self.tokens is not None:
            self.tokens.take(chunk, choices[0] if choices else {})
        if not choices:
            return False
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return False
        carried = False
        for name in TEXT_FIELDS:
            if isinstance(piece := delta.get(name), str) and piece:
                self.texts.setdefault(name, []).append(piece)
                carried = True
        if isinstance(details := delta.get("reasoning_details"), list) and details:
            self.details.extend(details)
            carried = True
        for call in delta.get("tool_calls") or []:
            self._add_call(call)
            carried = True
        return carried

    def _add_call(self, part) -> None:
        if not isinstance(part, dict) or type(part.get("index", 0)) is not int:
            raise MalformedResponse(f"a streamed tool call has no index: {str(part)[:200]}")
        call = self.calls.setdefault(part.get("index", 0), {"type": "function", "function": {}})
        for key in ("id", "type"):
            if isinstance(part.get(key), str) and part[key]:
                call[key] = part[key]
        function = part.get("function") or {}
        for key in ("name", "arguments"):
            piece, sofar = function.get(key), call["function"].get(key)
            if isinstance(piece, str) and (sofar is None or isinstance(sofar, str)):
                call["function"][key] = (sofar or "") + piece
            elif piece is not None:  # whole, and not text (object arguments): model.checked judges it as unstreamed
                call["function"][key] = piece

    def message(self) -> dict:
        """The assistant message as a non-streamed reply carries it."""
        message: dict = {"role": "assistant"}
        for name in TEXT_FIELDS:
            if name in self.texts:
                message[name] = "".join(self.texts[name])
        message.setdefault("content", None)
        if self.details:
            message["reasoning_details"] = self.details
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return {k: v for k, v in message.items() if v is not None}


def json_object(data: bytes | bytearray, what: str) -> dict:
    """`data` as a JSON object, or MalformedResponse naming `what`; an error object instead of an
    answer raises as the error it names."""
    try:
        found = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise NotJSON(what, data) from None
    if not isinstance(found, dict):
        raise MalformedResponse(f"{what} is not a JSON object: {bytes(data[:200])!r}")
    if isinstance(error := found.get("error"), dict):
        raise provider_error(error)
    return found


def provider_error(error: dict) -> ProviderError:
    """An `{"error": {...}}` object, in a 200 body or mid-stream: the status it names decides the
    retry, a number in `code`, or a `server_error` in `code` or `type` (a 500)."""
    code = error.get("code")
    status = int(code) if isinstance(code, (int, str)) and str(code).isdigit() else None
    if status is None:
        named = [NAMED_STATUS[n] for n in (code, error.get("type")) if isinstance(n, str) and n in NAMED_STATUS]
        status = named[0] if named else None
    return ProviderError(str(error.get("message") or error)[:2000], status)
