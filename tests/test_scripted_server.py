"""Tests for the scripted OpenAI-compatible server, driven through the real SDK."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.support.scripted_server import ServerHandle, scripted_server  # noqa: F401 (fixture)

REPO_ROOT = Path(__file__).resolve().parent.parent
TOOLS = [
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}},
]


def client_for(handle: ServerHandle) -> OpenAI:
    return OpenAI(base_url=handle.url, api_key="dummy", max_retries=0)


def chat(client: OpenAI, prompt: Any, assistant_turns: int = 0, **kwargs: Any):
    """One request whose history holds ``assistant_turns`` assistant/tool exchanges."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "sys"},
                                      {"role": "user", "content": prompt}]
    for i in range(assistant_turns):
        call_id = f"c{i}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "search", "arguments": "{}"}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": "result"})
    return client.chat.completions.create(model="test-model", messages=messages, **kwargs)


# ----------------------------------------------------------------- replies


def test_multi_turn_tool_calls_select_by_assistant_count(scripted_server):
    handle = scripted_server({"prompts": {"find it": [
        {"content": "looking", "tool_calls": [
            {"name": "search", "arguments": {"q": "x"}},
            {"name": "read_file", "arguments": "{\"path\": \"a\"}", "id": "fixed_id"}]},
        {"tool_calls": [{"name": "search", "arguments": {}}]},
        {"content": "done", "usage": {"prompt_tokens": 100, "completion_tokens": 7}},
    ]}})
    client = client_for(handle)

    first = chat(client, "find it", tools=TOOLS)
    choice = first.choices[0]
    assert first.object == "chat.completion" and first.model == "test-model"
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "looking"
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["search", "read_file"]
    assert json.loads(calls[0].function.arguments) == {"q": "x"}
    assert calls[0].id.startswith("call_")
    assert calls[1].function.arguments == '{"path": "a"}'
    assert calls[1].id == "fixed_id"

    second = chat(client, "find it", assistant_turns=1).choices[0]
    assert second.message.content is None
    assert second.message.tool_calls[0].function.name == "search"
    assert second.message.tool_calls[0].id != calls[0].id

    third = chat(client, "find it", assistant_turns=2)
    assert third.choices[0].message.content == "done"
    assert third.choices[0].finish_reason == "stop"
    assert not third.choices[0].message.tool_calls
    assert third.usage.prompt_tokens == 100 and third.usage.total_tokens == 107

    # Past the end of the list the last reply repeats.
    assert chat(client, "find it", assistant_turns=5).choices[0].message.content == "done"


def test_reasoning_fields_and_usage_extras(scripted_server):
    details = [{"type": "reasoning.text", "text": "step 1"}]
    handle = scripted_server({"default": [{
        "content": "answer", "reasoning": "thinking...", "reasoning_content": "deep",
        "reasoning_details": details, "finish_reason": "length",
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "cost": 0.0125,
                  "completion_tokens_details": {"reasoning_tokens": 2}},
    }]})
    response = chat(client_for(handle), "anything")
    message = response.choices[0].message
    assert message.model_extra["reasoning"] == "thinking..."
    assert message.model_extra["reasoning_content"] == "deep"
    assert message.model_dump()["reasoning_details"] == details
    assert response.choices[0].finish_reason == "length"
    assert response.usage.total_tokens == 7
    assert response.usage.model_extra["cost"] == 0.0125
    assert response.usage.completion_tokens_details.reasoning_tokens == 2


def test_stream_true_answers_server_sent_events(scripted_server):
    """Clients that always stream (the reference implementation does) get the scripted reply."""
    handle = scripted_server({"default": [{
        "tool_calls": [{"name": "search", "arguments": {"q": "x"}}], "reasoning": "look it up",
        "usage": {"prompt_tokens": 3, "completion_tokens": 4}}]})
    with client_for(handle).chat.completions.stream(
            model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
            stream_options={"include_usage": True}) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [("search", {"q": "x"})]
    assert message.model_extra["reasoning"] == "look it up"
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.usage.total_tokens == 7


def test_billed_counts_every_complete_reply_written_however_its_connection_ends(scripted_server):
    """What a provider bills: each 200 completion written whole, and each stream written up to its
    usage; not an error, nor a stream cut or failed before it. The openai SDK, which reads a stream
    whatever its Content-Type, sees the same reply under text/plain."""
    handle = scripted_server({"prompts": {
        "plain": [{"content": "a"}], "gzip": [{"content": "a", "gzip": True}],
        "error": [{"status": 500}], "stream error": [{"content": "abc", "pieces": 1, "stream_error": {"after": 2}}],
        "cut": [{"content": "abc", "pieces": 1, "cut_after": 3}],  # the finish reason is out, the usage is not
        "reset": [{"content": "a", "end": "reset"}], "no done": [{"content": "a", "done": False, "end": "close"}],
        "text": [{"content": "typed", "content_type": "text/plain"}]}})
    client = client_for(handle)
    for prompt in ("plain", "gzip", "reset", "error"):
        try:
            chat(client, prompt)
        except (openai.APIError, httpx.HTTPError):
            pass
    texts = {}
    for prompt in ("stream error", "cut", "no done", "text"):
        try:
            for chunk in chat(client, prompt, stream=True, stream_options={"include_usage": True}):
                texts[prompt] = texts.get(prompt, "") + "".join(c.delta.content or "" for c in chunk.choices)
        except (openai.APIError, httpx.HTTPError):
            pass
    assert texts["text"] == "typed" and handle.stats()["billed"] == 5 and handle.stats()["requests"] == 8


def test_awkward_streams_assemble_in_the_openai_sdk_to_the_unstreamed_message(scripted_server):
    """Pieces of 3 characters, written 5 bytes at a time (inside UTF-8 characters and the JSON),
    comments between chunks, two tool calls interleaved with their ids and names apart: the SDK's
    own assembler gets the message the unstreamed answer carries."""
    reply = {"content": "héllo wörld ☃ done", "reasoning": "thïnk first",
             "tool_calls": [{"name": "search", "arguments": {"q": "naïve ☃"}, "id": "a"},
                            {"name": "read_file", "arguments": {"path": "/tmp/x"}, "id": "b"}],
             "pieces": 3, "write_bytes": 5, "comments": True}
    handle = scripted_server({"default": [reply]})
    client = client_for(handle)
    plain = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    with client.chat.completions.stream(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                        stream_options={"include_usage": True}) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    got, want = final.choices[0].message, plain.choices[0].message
    assert got.content == want.content == "héllo wörld ☃ done"
    assert [(c.id, c.function.name, c.function.arguments) for c in got.tool_calls] == [
        (c.id, c.function.name, c.function.arguments) for c in want.tool_calls]
    assert got.model_extra["reasoning"] == "thïnk first" and final.usage.total_tokens == 15
    assert handle.stats()["stream_events"] > 20


def test_defaults_without_script_entries(scripted_server):
    handle = scripted_server({})
    response = chat(client_for(handle), "unknown")
    assert response.choices[0].message.content == "ok"
    assert response.usage.prompt_tokens == 10 and response.usage.total_tokens == 15


def test_prompt_from_content_parts_and_echo_tools(scripted_server):
    handle = scripted_server({"prompts": {"part one\npart two": [{"echo_tools": True}]}})
    prompt = [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]
    response = chat(client_for(handle), prompt, tools=TOOLS)
    assert json.loads(response.choices[0].message.content) == ["search", "read_file"]


def test_match_by_substring_in_order_after_exact(scripted_server):
    handle = scripted_server({
        "prompts": {"alpha exact": [{"content": "exact"}]},
        "match": [{"contains": "alpha", "replies": [{"content": "first match"}]},
                  {"contains": "alp", "replies": [{"content": "second match"}]},
                  {"contains": "beta", "replies": [{"content": "beta match"}]}],
        "default": [{"content": "fallback"}],
    })
    client = client_for(handle)
    got = {p: chat(client, p).choices[0].message.content
           for p in ("alpha exact", "the alpha task", "alpine", "a beta task", "gamma")}
    assert got == {"alpha exact": "exact", "the alpha task": "first match",
                   "alpine": "second match", "a beta task": "beta match", "gamma": "fallback"}


# ------------------------------------------------------------------ errors


def test_error_times_then_success(scripted_server):
    handle = scripted_server({"prompts": {
        "flaky": [{"status": 500, "times": 2, "error": "boom", "then": {"content": "recovered"}}],
        "flaky-plain": [{"content": "turn0"}, {"status": 502, "times": 1}],
    }})
    client = client_for(handle)
    for _ in range(2):
        with pytest.raises(openai.InternalServerError) as info:
            chat(client, "flaky")
        assert info.value.status_code == 500
        assert info.value.body["message"] == "boom"
    assert chat(client, "flaky").choices[0].message.content == "recovered"
    assert chat(client, "flaky").choices[0].message.content == "recovered"

    # Counters are per (prompt, turn); without ``then`` the fallback is "ok".
    assert chat(client, "flaky-plain").choices[0].message.content == "turn0"
    with pytest.raises(openai.APIStatusError) as info:
        chat(client, "flaky-plain", assistant_turns=1)
    assert info.value.status_code == 502
    assert chat(client, "flaky-plain", assistant_turns=1).choices[0].message.content == "ok"


def test_error_without_times_is_permanent(scripted_server):
    handle = scripted_server({"default": [{"status": 401, "error": "bad key"}],
                              "prompts": {"pay": [{"status": 402}]}})
    client = client_for(handle)
    for _ in range(3):
        with pytest.raises(openai.AuthenticationError) as info:
            chat(client, "x")
        assert info.value.body == {"message": "bad key", "type": "authentication_error",
                                   "code": 401}
    with pytest.raises(openai.APIStatusError) as info:
        chat(client, "pay")
    assert info.value.status_code == 402


def test_retry_after_header_on_429(scripted_server):
    handle = scripted_server({"default": [{"status": 429, "retry_after": 7, "error": "slow"}]})
    with pytest.raises(openai.RateLimitError) as info:
        chat(client_for(handle), "x")
    assert info.value.response.headers["retry-after"] == "7"
    assert info.value.body["type"] == "rate_limit_error"


def test_latency_and_delay_are_applied(scripted_server):
    handle = scripted_server({"latency": 0.15, "prompts": {"slow": [{"delay": 0.2}]}})
    client = client_for(handle)
    start = time.monotonic()
    chat(client, "fast-ish")
    assert time.monotonic() - start >= 0.15
    start = time.monotonic()
    chat(client, "slow")
    assert time.monotonic() - start >= 0.35


# ------------------------------------------------------------- log, control


def test_log_file_contents(scripted_server, tmp_path):
    log = tmp_path / "requests.jsonl"
    handle = scripted_server({"prompts": {"b": [{"status": 429}]}}, log_path=log)
    client = client_for(handle)
    chat(client, "a")
    chat(client, "a", assistant_turns=1, tools=TOOLS)
    with pytest.raises(openai.RateLimitError):
        chat(client, "b")

    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert entries == handle.requests()
    assert [(e["prompt"], e["turn"], e["status"]) for e in entries] == [
        ("a", 0, 200), ("a", 1, 200), ("b", 0, 429)]
    assert all(e["auth"] == "Bearer dummy" for e in entries)
    assert all(isinstance(e["t"], float) for e in entries)
    assert entries[1]["body"]["model"] == "test-model"
    assert entries[1]["body"]["tools"] == TOOLS
    assert [m["role"] for m in entries[1]["body"]["messages"]] == [
        "system", "user", "assistant", "tool"]


def test_in_memory_requests_without_log(scripted_server):
    handle = scripted_server({})
    chat(client_for(handle), "p")
    [entry] = handle.requests()
    assert entry["prompt"] == "p" and entry["status"] == 200


def test_script_swap_over_http_resets_times(scripted_server):
    failing = {"default": [{"status": 503, "times": 1, "then": {"status": 500}}]}
    handle = scripted_server(failing)
    client = client_for(handle)
    for expected in (503, 500, 500):
        with pytest.raises(openai.APIStatusError) as info:
            chat(client, "x")
        assert info.value.status_code == expected

    swap = httpx.post(f"{handle.root_url}/_script", json={"default": [{"content": "healed"}]})
    assert swap.status_code == 200
    assert chat(client, "x").choices[0].message.content == "healed"

    handle.set_script(failing)  # times counters start over
    with pytest.raises(openai.APIStatusError) as info:
        chat(client, "x")
    assert info.value.status_code == 503

    assert httpx.post(f"{handle.root_url}/_script", content=b"[1]").status_code == 400


def test_models_stats_and_404(scripted_server):
    handle = scripted_server({"default": [{"status": 500}], "prompts": {"ok": [{}]}})
    client = client_for(handle)
    assert [m.id for m in client.models.list()] == ["scripted-model"]
    chat(client, "ok")
    with pytest.raises(openai.InternalServerError):
        chat(client, "bad")
    stats = httpx.get(f"{handle.root_url}/_stats").json()
    assert stats == {"requests": 2, "by_status": {"200": 1, "500": 1}, "stream_events": 0, "billed": 1}
    assert handle.stats() == stats

    missing = httpx.get(f"{handle.root_url}/v1/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    # The path without /v1 works too.
    no_prefix = httpx.post(f"{handle.root_url}/chat/completions",
                           json={"messages": [{"role": "user", "content": "ok"}]})
    assert no_prefix.status_code == 200 and no_prefix.json()["model"] == "scripted-model"


def test_raw_keep_alive_pipelining_and_close(scripted_server):
    """Two requests written back to back on one socket; the second asks to close."""
    handle = scripted_server({"default": [{"content": "hi"}]})
    body = json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode()

    def request(extra: str) -> bytes:
        return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
                f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body

    with socket.create_connection(("127.0.0.1", handle.port), timeout=5) as sock:
        sock.sendall(request("") + request("Connection: close\r\n"))
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.count(b"HTTP/1.1 200 OK") == 2
    assert data.count(b'"content":"hi"') == 2
    assert b"Connection: close" in data


def test_bad_body_is_400_and_logged(scripted_server):
    handle = scripted_server({})
    response = httpx.post(f"{handle.url}/chat/completions", content=b"not json")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert handle.requests()[0]["status"] == 400


# ------------------------------------------------------------- process mode


def _read_line(stream, timeout: float) -> str:
    """readline with a timeout, so a hung server fails the test instead of hanging it."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    return lines.get(timeout=timeout)


def test_subprocess_mode_prints_ready_and_serves(tmp_path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"prompts": {"hello": [{"content": "from subprocess"}]}}))
    log = tmp_path / "log.jsonl"
    command = [sys.executable, "-m", "tests.support.scripted_server", "--script", str(script),
               "--log", str(log), "--port", "0", "--latency", "0.05"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
                          env=env) as proc:
        try:
            line = _read_line(proc.stdout, timeout=20)
            match = re.fullmatch(r"READY (http://127\.0\.0\.1:(\d+)/v1)\n", line)
            assert match, line
            client = OpenAI(base_url=match.group(1), api_key="dummy", max_retries=0)
            start = time.monotonic()
            response = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hello"}])
            assert time.monotonic() - start >= 0.05
            assert response.choices[0].message.content == "from subprocess"
            logged = [json.loads(line) for line in log.read_text().splitlines()]
            assert [e["prompt"] for e in logged] == ["hello"]
        finally:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=10)
        assert rc == 0
        assert proc.stdout.read() == ""  # exactly one line on stdout


# --------------------------------------------------------------- throughput


def test_two_hundred_keep_alive_connections_all_succeed(scripted_server):
    """2,000 requests over 200 keep-alive connections all succeed (the rate is bench/'s business).

    One single-connection AsyncClient per worker: a single httpx pool of 200
    connections is itself limited to ~250 req/s, which would measure httpx, not us.
    ``verify=False`` only skips building 200 SSL contexts (the URL is plain http).
    """
    handle = scripted_server({"default": [{"content": "x"}]})
    total, concurrency = 2000, 200

    async def run() -> list[int]:
        clients = [httpx.AsyncClient(base_url=handle.url, timeout=30, verify=False,
                                     limits=httpx.Limits(max_connections=1))
                   for _ in range(concurrency)]
        pending = iter(range(total))
        statuses: list[int] = []

        async def worker(client: httpx.AsyncClient, w: int) -> None:
            for i in pending:
                body = {"model": "m", "messages": [{"role": "user", "content": f"p{w}-{i}"}]}
                statuses.append((await client.post("/chat/completions", json=body)).status_code)

        await asyncio.gather(*(worker(c, w) for w, c in enumerate(clients)))
        await asyncio.gather(*(c.aclose() for c in clients))
        return statuses

    statuses = asyncio.run(run())
    assert len(statuses) == total and set(statuses) == {200}
    assert handle.stats()["requests"] == total
