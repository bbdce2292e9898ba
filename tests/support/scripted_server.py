"""Scripted OpenAI-compatible chat-completions server for tests and benchmarks.

It serves canned replies chosen per conversation, so an agent runner can be
exercised end to end (tool calls, reasoning fields, errors, retries, latency)
without a real model. Binds 127.0.0.1 only; aiohttp.web (its sockets written to directly for the
connection faults) plus orjson if present.

Endpoints
---------
``POST /v1/chat/completions`` (also ``/chat/completions``), ``GET /v1/models``
(also ``/models``), ``POST /_script`` (replace the script; resets ``times``
counters), ``GET /_stats`` -> ``{"requests": n, "by_status": {"200": n, ...}, "stream_events": n, "billed": n}``.
Anything else answers 404 with an OpenAI-style error body. A chat request with
``"stream": true`` gets its reply as server-sent events, in a chunked body: by default
one chunk whose delta is the whole message, a usage chunk if ``stream_options.include_usage``,
then ``[DONE]`` (the reply keys below stream it awkwardly). Only chat-completion requests are
counted in ``/_stats`` (which also counts ``stream_events``, the events written so far, and
``billed``, the complete replies written: a 200 completion body, or a stream up to its usage
chunk, as a provider bills what it generated whether or not the client keeps it) and written
to the log.

Script format (a dict, or a JSON file holding one)
--------------------------------------------------
::

    {
      "latency": 0.0,              # seconds to wait before every answer
      "default": [<reply>, ...],   # prompts not listed (absent: [{"content": "ok"}])
      "prompts": {"<prompt text>": [<reply>, ...]},          # exact match first
      "match": [{"contains": "<substring>", "replies": [<reply>, ...]}],  # then in order
      "outage": {"status": 429, "seconds": 20.0, "retry_after": None, "error": "..."},
      "models": {"<model>": {"default": ..., "prompts": ..., "match": ...}}
    }

``models`` (optional): a request whose ``model`` is listed is answered from that
model's own ``default``/``prompts``/``match`` (several models, one server).

``outage`` (optional): every chat request within ``seconds`` of the first one the
script sees answers ``status`` (a storm of 429s, a 503 outage); after it the
script answers as usual.

A conversation is identified by the text of the FIRST ``user`` message (a string,
or a list of content parts whose ``text`` values are joined with ``"\\n"``).
The turn is the number of ``assistant`` messages in the request; turn ``i`` is
answered by ``replies[min(i, len(replies) - 1)]``.

A reply is a dict with any of:

- ``content`` (str, default ``""``; sent as null when there are tool calls and no content)
- ``tool_calls``: ``[{"name": str, "arguments": <object or raw string>, "id"?: str}]``;
  missing ids become ``call_<n>`` (n counts up per server), object arguments are
  JSON-encoded with ``json.dumps``.
- ``reasoning``, ``reasoning_content`` (str) and ``reasoning_details`` (list):
  copied into the message under those keys.
- ``usage`` (dict merged over ``{"prompt_tokens": 10, "completion_tokens": 5,
  "total_tokens": 15}``; total is recomputed unless given; may carry ``cost`` and
  ``completion_tokens_details``); false: a stream sends no usage chunk, as some endpoints do.
- ``model``: the ``model`` the completion reports (default: the request's);
  ``provider``: a top-level ``provider`` field, as OpenRouter adds.
- ``message``: the assistant message exactly as given, instead of one built from the
  keys above (a tool call without ``function``, a name that is not a string,
  duplicate ids: what a misbehaving endpoint sends), in an otherwise normal completion.
- ``finish_reason`` (default ``"tool_calls"`` with tool calls, else ``"stop"``).
- ``delay``: extra seconds for this reply, on top of ``latency``.
- ``gate``: a name; the answer is held until the test calls ``open_gate(name)``
  (a run kept busy for exactly as long as a test needs, no sleeps).
- ``echo_tools``: content becomes a JSON list of the tool names in the request.
- ``status``: answer with this HTTP error instead, body
  ``{"error": {"message": error, "type": ..., "code": status}}``; ``error`` is the
  message, ``retry_after`` sets a ``Retry-After`` header. With ``times: N`` the
  error is served for the first N requests of that (prompt, turn) and later
  requests get the ``then`` reply (a normal reply) or ``{"content": "ok"}``.
  Without ``times`` the error is served every time.
- ``body``: answer with exactly this body instead (a string is sent as it is, so
  it need not be JSON; anything else is JSON-encoded), with HTTP ``status`` if
  given, else 200: an error object inside a 200, ``{"choices": []}``, garbage.
  ``times``/``then`` work as with ``status``.

Streamed replies (requests with ``"stream": true``) also take:

- ``pieces``: deltas of at most this many characters of content, of each reasoning field
  and of each tool call's arguments; a tool call's id comes in one chunk and its name in
  the next, and the calls' chunks are interleaved by index.
- ``comments``: a ``: OPENROUTER PROCESSING`` comment before every chunk.
- ``chunk_delay``: seconds between events (after the head, which is sent at once); an
  unstreamed answer waits for as long as all of them would take.
- ``write_bytes``: every event is written in pieces of this many bytes, each flushed
  apart, so a client's reads end inside a UTF-8 character or inside the JSON.
- ``stream_error``: ``{"after": N, "status": 503, "error": "..."}``: after N chunks an
  ``{"error": ...}`` event, and the stream ends.
- ``stall_after``: N: after N chunks nothing more is sent until the client leaves.
- ``cut_after``: N: after N chunks the connection is closed in the middle of the body.
- ``done``: false: no ``data: [DONE]`` event (the stream ends after its finish reason and usage).
- ``stream_error`` may also take ``code``: the error object's ``code`` instead of the status
  (``"server_error"`` as OpenRouter sends it mid-stream, or null).

Faults of the connection (any request; ``times``/``then`` work with them too):

- ``drop``: the request is read and the connection closed without an answer.
- ``raw``: this exact text (latin-1) is written as the whole response, then the
  connection is closed: malformed lengths, folded headers, duplicate headers.
- ``gzip``: the (unstreamed) body is sent gzip-compressed, with ``Content-Encoding: gzip``.
- ``end``: ``"reset"`` or ``"close"``: once the whole answer is written (every event of a stream,
  or an unstreamed body, then sent chunked), the connection is reset (RST) or closed (FIN)
  instead of the chunked body's terminator: a complete reply whose connection ends badly;
  ``"hold"`` (streams): the terminator never comes, and the connection stays open until the
  client closes it.
- ``content_type``: the answer's Content-Type instead of ``text/event-stream`` or
  ``application/json`` (a stream served as ``text/plain``).
- ``trailing``: these bytes are written right after the body (in the same write), on a
  kept-alive connection; with ``trailing_delay`` (seconds), that long after it instead.

Log (``log_path`` / ``--log``): one JSON line per chat request, flushed before the
answer is sent: ``{"t", "prompt", "turn", "body", "status", "auth"}``.

Use
---
In process: ``handle = start_server(script, log_path=None, port=0)`` then
``handle.url`` (``http://127.0.0.1:PORT/v1``), ``handle.set_script(d)``,
``handle.requests()``, ``handle.stats()``, ``handle.stop()``. In pytest, import the
``scripted_server`` fixture: ``factory(script, log_path=None) -> ServerHandle``.

As a process: ``python -m tests.support.scripted_server --script FILE.json [--log FILE]
[--port 0] [--latency 0.25] [--tls CERT KEY]`` prints ``READY http://127.0.0.1:PORT/v1``
(``https://`` with ``--tls``: TLS with that certificate and key, PEM files) once it
listens and serves until SIGTERM/SIGINT. ``--latency`` overrides the file's value
(a script later posted to ``/_script`` brings its own latency).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import itertools
import json
import os
import signal
import socket
import ssl
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from aiohttp import web

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is optional
    orjson = None

try:
    import pytest
except ImportError:  # pragma: no cover - only the fixture needs pytest
    pytest = None

HOST = "127.0.0.1"
MODEL_ID = "scripted-model"
DEFAULT_USAGE = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
FALLBACK_REPLY: dict[str, Any] = {"content": "ok"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "insufficient_quota",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "request_too_large",
    422: "unprocessable_entity_error",
    429: "rate_limit_error",
}
JSON_HEADERS = {"Content-Type": "application/json"}
SSE_HEADERS = {"Content-Type": "text/event-stream"}


# --------------------------------------------------------------------------- json


def dumps(obj: Any) -> bytes:
    """Encode compactly; orjson when available because it is much faster."""
    if orjson is not None:
        try:
            return orjson.dumps(obj)
        except TypeError:  # e.g. integers beyond 64 bits
            pass
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def loads(data: bytes | str) -> Any:
    """Decode JSON; falls back to the stdlib for inputs orjson refuses (big ints)."""
    if orjson is not None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)


# ------------------------------------------------------------------ script logic


def normalize_script(script: Any) -> dict[str, Any]:
    """Validate the top-level shape early so a bad script fails at load, not mid-test."""
    if not isinstance(script, dict):
        raise ValueError("script must be a JSON object")
    prompts = script.get("prompts") or {}
    match = script.get("match") or []
    if not isinstance(prompts, dict):
        raise ValueError("script.prompts must be an object")
    if not isinstance(match, list) or not all(isinstance(m, dict) for m in match):
        raise ValueError("script.match must be a list of objects")
    return {
        "latency": float(script.get("latency") or 0.0),
        "default": _reply_list(script.get("default")) or [FALLBACK_REPLY],
        "prompts": {str(k): _reply_list(v) for k, v in prompts.items()},
        "match": [
            {"contains": str(m.get("contains", "")), "replies": _reply_list(m.get("replies"))}
            for m in match
        ],
        "outage": script.get("outage"),
        "models": {str(k): normalize_script(v) for k, v in (script.get("models") or {}).items()},
    }


def _reply_list(value: Any) -> list[dict[str, Any]]:
    """Accept a single reply dict as shorthand for a one-element list."""
    if value is None:
        return []
    if isinstance(value, dict):
        return [value]
    if not isinstance(value, list) or not all(isinstance(r, dict) for r in value):
        raise ValueError(f"replies must be a list of objects, got {value!r}")
    return value


def message_text(content: Any) -> str:
    """Text of a message content: a string, or the joined text parts of a list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "\n".join(parts)
    return ""


def conversation_key(body: dict[str, Any]) -> tuple[str | None, int]:
    """(first user text, assistant-message count): what selects the scripted reply."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None, 0
    prompt: str | None = None
    turn = 0
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        role = msg.get("role")
        if role == "user" and prompt is None:
            prompt = message_text(msg.get("content"))
        elif role == "assistant":
            turn += 1
    return prompt, turn


def error_payload(status: int, message: str) -> dict[str, Any]:
    """OpenAI-shaped error body, so SDK exception mapping works as with the real API."""
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "api_error")
    return {"error": {"message": message, "type": kind, "code": status}}


@dataclass
class Streamed:
    """A streamed answer: its events, and how awkwardly to send them."""

    events: list[bytes]  # each a whole `data: ...` event
    chunk_delay: float = 0.0
    write_bytes: int = 0  # 0: each event in one write
    comments: bool = False
    stall_after: int | None = None
    cut_after: int | None = None
    complete_after: int | None = None  # the events that make the whole reply (billed once written); None: never whole
    end: str | None = None  # "reset", "close" or "hold" instead of the chunked terminator


@dataclass
class Raw:
    """Bytes written to the socket as they are after the request is read, then the connection is closed."""

    data: bytes
    reset: bool = False  # end with a RST instead of a FIN
    billed: bool = False  # `data` is a complete reply


@dataclass
class Outcome:
    """What to answer to one request, decided before any waiting."""

    status: int
    payload: dict[str, Any] | bytes | Streamed | Raw  # bytes are sent as they are
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    gate: threading.Event | None = None  # held until the test opens it
    billed: bool = False  # the payload is a complete reply (a Raw or a Streamed one says so itself)
    trailing: bytes = b""  # written to the socket after the answer, on its kept-alive connection
    trailing_delay: float = 0.0  # that long after it


class ScriptedBackend:
    """Request -> reply logic plus log and stats; shared by both run modes.

    All mutable state sits behind one lock because ``set_script`` is called from the
    test thread while the event loop thread serves requests.
    """

    def __init__(
        self, script: dict[str, Any], log_path: str | os.PathLike[str] | None = None,
        keep_in_memory: bool = True,
    ) -> None:
        self._lock = threading.Lock()
        self._script = normalize_script(script)
        self._times: dict[tuple[str | None, int], int] = {}
        self._outage_ends: float | None = None  # set by the first request under an outage
        self._gates: dict[str, threading.Event] = {}
        self._call_ids = itertools.count(1)
        self._completion_ids = itertools.count(1)
        self._total = 0
        self._by_status: dict[str, int] = {}
        self.stream_events = 0  # events written by streamed answers (the HTTP layer counts them)
        self.billed = 0  # complete replies written (the HTTP layer counts them)
        self.log_path = os.fspath(log_path) if log_path else None
        self._log_file = open(self.log_path, "ab") if self.log_path else None
        self._memory: list[dict[str, Any]] | None = (
            [] if keep_in_memory and self._log_file is None else None
        )

    # -- control ----------------------------------------------------------------

    def set_script(self, script: dict[str, Any]) -> None:
        """Swap the script and reset ``times`` counters (a "healed" server starts fresh)."""
        normalized = normalize_script(script)
        with self._lock:
            self._script = normalized
            self._times.clear()
            self._outage_ends = None

    def set_latency(self, latency: float) -> None:
        with self._lock:
            self._script["latency"] = float(latency)

    def gate(self, name: str) -> threading.Event:
        with self._lock:
            return self._gates.setdefault(name, threading.Event())

    def open_gate(self, name: str) -> None:
        self.gate(name).set()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"requests": self._total, "by_status": dict(self._by_status), "stream_events": self.stream_events,
                    "billed": self.billed}

    def requests(self) -> list[dict[str, Any]]:
        """Logged requests: parsed from the log file, else the in-memory copy."""
        if self.log_path:
            return list(read_log(self.log_path))
        with self._lock:
            return list(self._memory or [])

    def close(self) -> None:
        with self._lock:
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None

    # -- serving ----------------------------------------------------------------

    def handle_chat(self, raw_body: bytes, auth: str | None) -> Outcome:
        """Decide the answer for one chat-completions request, log it, count it."""
        arrived = time.time()
        try:
            body = loads(raw_body) if raw_body else None
        except ValueError:
            body = None
        if not isinstance(body, dict):
            outcome = Outcome(400, error_payload(400, "request body must be a JSON object"))
            self._record(arrived, None, 0, body, outcome.status, auth)
            return outcome
        prompt, turn = conversation_key(body)
        with self._lock:
            reply = self._outage(arrived) or self._pick_reply(prompt, turn, body.get("model"))
            latency = self._script["latency"]
        outcome = self._build(reply, body)
        outcome.delay += latency
        if reply.get("gate"):
            outcome.gate = self.gate(str(reply["gate"]))
        self._record(arrived, prompt, turn, body, outcome.status, auth)
        return outcome

    def _outage(self, now: float) -> dict[str, Any] | None:
        """The outage's error reply while it lasts; caller holds the lock."""
        outage = self._script["outage"]
        if not outage:
            return None
        if self._outage_ends is None:
            self._outage_ends = now + float(outage["seconds"])
        return outage if now < self._outage_ends else None

    def _pick_reply(self, prompt: str | None, turn: int, model: Any = None) -> dict[str, Any]:
        """Script lookup plus the ``times`` rule; caller holds the lock."""
        replies = self._replies_for(prompt, self._script["models"].get(str(model), self._script))
        reply = replies[min(turn, len(replies) - 1)]
        if "times" in reply:
            key = (prompt, turn)
            seen = self._times.get(key, 0)
            self._times[key] = seen + 1
            if seen >= int(reply["times"]):
                then = reply.get("then")
                return then if isinstance(then, dict) else FALLBACK_REPLY
        return reply

    def _replies_for(self, prompt: str | None, script: dict[str, Any]) -> list[dict[str, Any]]:
        if prompt is not None:
            exact = script["prompts"].get(prompt)
            if exact:
                return exact
            for entry in script["match"]:
                if entry["replies"] and entry["contains"] in prompt:
                    return entry["replies"]
        return script["default"]

    def _build(self, reply: dict[str, Any], body: dict[str, Any]) -> Outcome:
        delay = float(reply.get("delay") or 0.0)
        if reply.get("drop"):
            return Outcome(0, Raw(b""), {}, delay)
        if "raw" in reply:
            return Outcome(0, Raw(str(reply["raw"]).encode("latin-1")), {}, delay)
        if "body" in reply:
            body = reply["body"]
            return Outcome(int(reply.get("status", 200)), body.encode() if isinstance(body, str) else dumps(body),
                           {}, delay)
        if "status" in reply:
            status = int(reply["status"])
            message = str(reply.get("error") or f"scripted error {status}")
            headers = {}
            if reply.get("retry_after") is not None:
                headers["Retry-After"] = str(reply["retry_after"])
            return Outcome(status, error_payload(status, message), headers, delay)
        completion = self._completion(reply, body)
        typed = {"Content-Type": reply["content_type"]} if "content_type" in reply else {}
        if body.get("stream") is True:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage")) and reply.get("usage") is not False
            done = reply.get("done", True) is not False
            events = stream_chunks(completion, include_usage, int(reply.get("pieces") or 0), reply.get("stream_error"),
                                   done)
            whole = None if reply.get("stream_error") else len(events) - done  # billed once all but [DONE] are out
            plan = Streamed(events, float(reply.get("chunk_delay") or 0.0), int(reply.get("write_bytes") or 0),
                            bool(reply.get("comments")), reply.get("stall_after"), reply.get("cut_after"), whole,
                            reply.get("end"))
            return Outcome(200, plan, {**SSE_HEADERS, **typed}, delay)
        if reply.get("chunk_delay"):  # the generation takes as long unstreamed: its answer waits for all of it
            delay += float(reply["chunk_delay"]) * (len(stream_chunks(completion, False, int(reply.get("pieces") or 0))) - 1)
        if reply.get("gzip"):
            return Outcome(200, gzip.compress(dumps(completion)), {"Content-Encoding": "gzip"}, delay, billed=True)
        if reply.get("end"):  # sent chunked, and the terminator never comes
            answer = encode_response(200, b"", typed, True).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
            data = dumps(completion)
            return Outcome(200, Raw(answer + b"%x\r\n%s\r\n" % (len(data), data), reset=reply["end"] == "reset",
                                    billed=True), {}, delay)
        if "trailing" in reply:
            return Outcome(200, completion, {}, delay, billed=True, trailing=str(reply["trailing"]).encode("latin-1"),
                           trailing_delay=float(reply.get("trailing_delay") or 0.0))
        return Outcome(200, completion, typed, delay, billed=True)

    def _completion(self, reply: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        """A ``chat.completion`` object as the OpenAI API would send it."""
        tool_calls = [self._tool_call(tc) for tc in reply.get("tool_calls") or []]
        content: str | None = reply.get("content", "")
        if reply.get("echo_tools"):
            content = json.dumps(offered_tool_names(body))
        if tool_calls and not content:
            content = None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        if "message" in reply:
            message = reply["message"]
        for key in ("reasoning", "reasoning_content", "reasoning_details"):
            if key in reply:
                message[key] = reply[key]
        finish = reply.get("finish_reason") or ("tool_calls" if tool_calls else "stop")
        return {
            "id": f"chatcmpl-scripted-{next(self._completion_ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": reply.get("model") or body.get("model") or MODEL_ID,
            **({"provider": reply["provider"]} if "provider" in reply else {}),
            "choices": [{"index": 0, "message": message, "finish_reason": finish,
                         "logprobs": None}],
            "usage": make_usage(reply.get("usage")),
        }

    def _tool_call(self, spec: dict[str, Any]) -> dict[str, Any]:
        arguments = spec.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        call_id = spec.get("id") or f"call_{next(self._call_ids)}"
        return {"id": call_id, "type": "function",
                "function": {"name": spec.get("name", ""), "arguments": arguments}}

    def _record(self, t: float, prompt: str | None, turn: int, body: Any, status: int,
                auth: str | None) -> None:
        """Count and log before answering, so a client that got a reply sees its entry."""
        entry = {"t": t, "prompt": prompt, "turn": turn, "body": body,
                 "status": status, "auth": auth}
        with self._lock:
            self._total += 1
            self._by_status[str(status)] = self._by_status.get(str(status), 0) + 1
            if self._log_file is not None:
                self._log_file.write(dumps(entry) + b"\n")
                self._log_file.flush()
            elif self._memory is not None:
                self._memory.append(entry)


def stream_events(completion: dict[str, Any], include_usage: bool) -> bytes:
    """The completion as the server-sent events of ``stream: true``, in one piece."""
    return b"".join(stream_chunks(completion, include_usage))


def stream_chunks(completion: dict[str, Any], include_usage: bool, pieces: int = 0,
                  error: dict[str, Any] | None = None, done: bool = True) -> list[bytes]:
    """The completion as ``chat.completion.chunk`` events, then the usage chunk if asked for and
    ``[DONE]`` (unless not `done`). With ``pieces``, text and arguments come in deltas of that many
    characters, each tool call's id and name in chunks of their own, the calls interleaved by index.
    With ``error``, an error event replaces everything after its ``after`` chunks."""
    choice = completion["choices"][0]
    message = choice["message"]
    head = {"id": completion["id"], "object": "chat.completion.chunk", "created": completion["created"],
            "model": completion["model"], **({"provider": completion["provider"]} if "provider" in completion else {})}
    deltas = _deltas(message, pieces) if pieces and isinstance(message, dict) else [_whole_delta(message)]
    chunks = [{**head, "choices": [{"index": 0, "delta": d, "finish_reason": None, "logprobs": None}]} for d in deltas]
    chunks[-1]["choices"][0]["finish_reason"] = choice["finish_reason"]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": completion["usage"]})
    events = [b"data: " + dumps(chunk) + b"\n\n" for chunk in chunks] + ([b"data: [DONE]\n\n"] if done else [])
    if error:
        after = int(error.get("after", 0))
        status = int(error.get("status", 500))
        failure = error_payload(status, str(error.get("error") or f"scripted error {status}"))
        if "code" in error:
            failure["error"]["code"] = error["code"]
        events = events[:after] + [b"data: " + dumps(failure) + b"\n\n"]
    return events


def _whole_delta(message: Any) -> Any:
    if isinstance(message, dict) and isinstance(message.get("tool_calls"), list):
        message = dict(message)
        message["tool_calls"] = [{"index": i, **call} if isinstance(call, dict) else call
                                 for i, call in enumerate(message["tool_calls"])]
    return message


def _deltas(message: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The message cut into deltas of at most `n` characters (see stream_chunks)."""
    cut = lambda text: [text[i:i + n] for i in range(0, len(text), n)] or [""]  # noqa: E731
    deltas: list[dict[str, Any]] = [{"role": "assistant"}]
    for key in ("reasoning_content", "reasoning", "content"):
        if isinstance(message.get(key), str) and message[key]:
            deltas += [{key: piece} for piece in cut(message[key])]
    if isinstance(message.get("reasoning_details"), list):
        deltas += [{"reasoning_details": [item]} for item in message["reasoning_details"]]
    per_call = []
    for i, call in enumerate(message.get("tool_calls") or []):
        fn = call.get("function") or {}
        parts = [{"index": i, "id": call.get("id"), "type": "function", "function": {"arguments": ""}},
                 {"index": i, "function": {"name": fn.get("name")}}]
        parts += [{"index": i, "function": {"arguments": piece}} for piece in cut(fn.get("arguments") or "")]
        per_call.append(parts)
    for round_ in itertools.zip_longest(*per_call):
        deltas += [{"tool_calls": [part]} for part in round_ if part is not None]
    return deltas


def make_usage(usage: Any) -> dict[str, Any]:
    """Merge over defaults; recompute the total unless the script pins it."""
    if not isinstance(usage, dict):
        return dict(DEFAULT_USAGE)
    merged = {**DEFAULT_USAGE, **usage}
    if "total_tokens" not in usage:
        merged["total_tokens"] = merged["prompt_tokens"] + merged["completion_tokens"]
    return merged


def offered_tool_names(body: dict[str, Any]) -> list[str]:
    names = []
    for tool in body.get("tools") or []:
        if isinstance(tool, dict):
            fn = tool.get("function")
            names.append((fn or {}).get("name") if isinstance(fn, dict) else tool.get("name"))
    return names


def read_log(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Parse a request log, skipping a possibly half-written last line."""
    try:
        with open(path, "rb") as fh:
            for line in fh:
                if line.strip():
                    try:
                        yield loads(line)
                    except ValueError:
                        continue
    except FileNotFoundError:
        return


def load_script(path: str | os.PathLike[str]) -> dict[str, Any]:
    with open(path, "rb") as fh:
        return loads(fh.read())


# ---------------------------------------------------------------------- HTTP layer


def encode_response(status: int, body: bytes, headers: dict[str, str], keep_alive: bool) -> bytes:
    """A whole HTTP/1.1 response as bytes: the head of the answers that break the protocol on purpose."""
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Status"
    lines = [f"HTTP/1.1 {status} {reason}", f"Content-Length: {len(body)}",
             "Connection: keep-alive" if keep_alive else "Connection: close"]
    lines.extend(f"{k}: {v}" for k, v in {**JSON_HEADERS, **headers}.items())
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class HttpServer:
    """aiohttp.web routing requests to a ScriptedBackend. The faults of a connection (Raw answers, a
    stream's stall, cut or bad end) are written to, or done to, its socket itself."""

    def __init__(self, backend: ScriptedBackend) -> None:
        self.backend = backend
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, port: int = 0, tls: ssl.SSLContext | None = None) -> int:
        app = web.Application(client_max_size=1 << 30)  # a long conversation's request is large
        app.router.add_route("*", "/{path:.*}", self._handle)
        # answers still held or paced are not waited for at the close (0 would mean: wait for ever)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.01)
        await self._runner.setup()
        site = web.TCPSite(self._runner, HOST, port, backlog=4096, reuse_address=True, ssl_context=tls)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self.port

    async def close(self) -> None:
        """Stop listening and drop open connections, then end the answers still held or paced (the loop
        is the server's own: every other task on it is one)."""
        if self._runner is not None:
            await self._runner.cleanup()
        while answers := asyncio.all_tasks() - {asyncio.current_task()}:
            for task in answers:
                task.cancel()
            await asyncio.gather(*answers, return_exceptions=True)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        answer = await self._route(request)
        payload = answer.payload
        try:
            if isinstance(payload, Raw):
                return await self._raw(request, payload)
            if isinstance(payload, Streamed):
                return await self._stream(request, payload, answer.headers)
            body = payload if isinstance(payload, bytes) else dumps(payload)
            self.backend.billed += answer.billed
            response = web.Response(status=answer.status, body=body, headers={**JSON_HEADERS, **answer.headers})
            if answer.trailing:
                await response.prepare(request)
                await response.write_eof()
                if answer.trailing_delay:
                    await asyncio.sleep(answer.trailing_delay)
                request.transport.write(answer.trailing)
            return response
        except ConnectionError:  # the client left mid-answer
            return web.Response()

    async def _raw(self, request: web.Request, raw: Raw) -> web.StreamResponse:
        """Bytes written as they are, then the connection ended: aiohttp writes nothing more to it."""
        self.backend.billed += raw.billed  # counted before it is sent, as the log is
        request.transport.write(raw.data)
        _reset(request.transport) if raw.reset else request.transport.close()
        return web.Response()

    async def _stream(self, request: web.Request, plan: Streamed, headers: dict[str, str]) -> web.StreamResponse:
        """A streamed answer as a chunked body, paced and broken as the plan says."""
        response = web.StreamResponse(headers={**JSON_HEADERS, **headers})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if not (plan.chunk_delay or plan.write_bytes or plan.comments or plan.stall_after is not None
                or plan.cut_after is not None):  # nothing to pace: one write, as an unstreamed answer is
            self.backend.stream_events += len(plan.events)
            self.backend.billed += plan.complete_after is not None
            await response.write(b"".join(plan.events))
            return await self._end(request, response, plan)
        for n, event in enumerate(plan.events):
            if n == plan.stall_after:
                await _until_closed(request)
                return response
            if n == plan.cut_after:
                request.transport.abort()
                return response
            if n and plan.chunk_delay:
                await asyncio.sleep(plan.chunk_delay)
            if plan.comments:
                event = b": OPENROUTER PROCESSING\n\n" + event
            self.backend.billed += n + 1 == plan.complete_after
            step = plan.write_bytes or len(event)
            for i in range(0, len(event), step):
                await response.write(event[i:i + step])
                if plan.write_bytes:
                    await asyncio.sleep(0.002)  # apart, so that the client reads them apart
            self.backend.stream_events += 1
        return await self._end(request, response, plan)

    @staticmethod
    async def _end(request: web.Request, response: web.StreamResponse, plan: Streamed) -> web.StreamResponse:
        """The chunked terminator, or the plan's bad end instead of it."""
        if plan.end is None:
            await response.write_eof()
        elif plan.end == "reset":
            _reset(request.transport)
        elif plan.end == "close":
            request.transport.close()
        else:  # "hold"
            await _until_closed(request)
        return response

    async def _route(self, request: web.Request) -> Outcome:
        path, method, body = request.path.rstrip("/") or "/", request.method, await request.read()
        if method == "POST" and path in ("/v1/chat/completions", "/chat/completions"):
            outcome = self.backend.handle_chat(body, request.headers.get("authorization"))
            while outcome.gate is not None and not outcome.gate.is_set():
                await asyncio.sleep(0.02)
            if outcome.delay > 0:
                await asyncio.sleep(outcome.delay)
            return outcome
        if method == "GET" and path in ("/v1/models", "/models"):
            return Outcome(200, models_payload())
        if method == "POST" and path == "/_script":
            return self._swap_script(body)
        if method == "GET" and path == "/_stats":
            return Outcome(200, self.backend.stats())
        return Outcome(404, error_payload(404, f"no route for {method} {request.path}"))

    def _swap_script(self, raw: bytes) -> Outcome:
        try:
            self.backend.set_script(loads(raw))
        except ValueError as exc:
            return Outcome(400, error_payload(400, f"bad script: {exc}"))
        return Outcome(200, {"ok": True})


def _reset(transport: asyncio.Transport) -> None:
    """End the connection with a RST (SO_LINGER 0), not a FIN; what was written has left already
    (on loopback the kernel hands it to the client at once)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def _until_closed(request: web.Request) -> None:
    """Hold a connection open, sending nothing, until the client closes it."""
    while request.transport is not None and not request.transport.is_closing():
        await asyncio.sleep(0.02)


def models_payload() -> dict[str, Any]:
    return {"object": "list",
            "data": [{"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "scripted"}]}


# ------------------------------------------------------------- in-process handle


class ServerHandle:
    """A server running on its own event loop in a daemon thread."""

    def __init__(self, backend: ScriptedBackend, http_server: HttpServer,
                 loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
        self.backend = backend
        self._http = http_server
        self._loop = loop
        self._thread = thread
        self._stopped = False
        self.port: int = http_server.port
        self.root_url = f"http://{HOST}:{self.port}"
        self.url = f"{self.root_url}/v1"

    def set_script(self, script: dict[str, Any]) -> None:
        self.backend.set_script(script)

    def open_gate(self, name: str) -> None:
        self.backend.open_gate(name)

    def requests(self) -> list[dict[str, Any]]:
        return self.backend.requests()

    def stats(self) -> dict[str, Any]:
        return self.backend.stats()

    def stop(self) -> None:
        """Idempotent; closes connections, stops the loop, closes the log."""
        if self._stopped:
            return
        self._stopped = True
        if self._loop.is_running():
            future = asyncio.run_coroutine_threadsafe(self._http.close(), self._loop)
            try:
                future.result(timeout=5)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self.backend.close()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(script: dict[str, Any], log_path: str | os.PathLike[str] | None = None,
                 port: int = 0) -> ServerHandle:
    """Start a scripted server in a daemon thread; returns once it is listening."""
    backend = ScriptedBackend(script, log_path)
    http_server = HttpServer(backend)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(http_server.start(port))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            failure.append(exc)
            ready.set()
            loop.close()
            return
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=run, name=f"scripted-server-{port}", daemon=True)
    thread.start()
    if not ready.wait(timeout=10):
        raise RuntimeError("scripted server did not start within 10 s")
    if failure:
        backend.close()
        raise failure[0]
    return ServerHandle(backend, http_server, loop, thread)


if pytest is not None:

    @pytest.fixture
    def scripted_server() -> Iterator[Callable[..., ServerHandle]]:
        """Factory fixture: ``scripted_server(script, log_path=None) -> ServerHandle``."""
        handles: list[ServerHandle] = []

        def factory(script: dict[str, Any],
                    log_path: str | os.PathLike[str] | None = None) -> ServerHandle:
            handle = start_server(script, log_path)
            handles.append(handle)
            return handle

        yield factory
        for handle in handles:
            handle.stop()


# ----------------------------------------------------------------- process mode


async def serve_until_signal(backend: ScriptedBackend, port: int, tls: ssl.SSLContext | None = None) -> None:
    http_server = HttpServer(backend)
    bound = await http_server.start(port, tls)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"READY {'https' if tls else 'http'}://{HOST}:{bound}/v1", flush=True)
    await stop.wait()
    await http_server.close()


def _tls(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Scripted OpenAI-compatible server.")
    parser.add_argument("--script", help="JSON script file (default: empty script)")
    parser.add_argument("--log", help="append one JSON line per chat request here")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--latency", type=float, help="override the script's latency")
    parser.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"), help="serve https with this certificate and key")
    args = parser.parse_args(argv)
    script = load_script(args.script) if args.script else {}
    backend = ScriptedBackend(script, args.log, keep_in_memory=False)
    if args.latency is not None:
        backend.set_latency(args.latency)
    try:
        asyncio.run(serve_until_signal(backend, args.port, _tls(*args.tls) if args.tls else None))
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
