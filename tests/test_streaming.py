"""Chat calls through httpx against the loopback scripted server: awkward streams assemble into the
message a non-streamed call returns; stalls, cuts and errors mid-stream follow the one retry
policy; the faults of an HTTP client sweep (a silent TLS handshake, a dropped request, gzip, a
BOM, folded and duplicate headers, malformed lengths, stray bytes, NO_PROXY ranges) are handled."""
from __future__ import annotations

import asyncio
import json
import shutil
import socket
import ssl
import subprocess
import time
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import pytest

from tests.conftest import arun
from trajgen import chat_calls, errors, stream
from trajgen.task import ModelSettings

TOOL = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
AWKWARD = {"content": "héllo wörld ☃ done", "reasoning_content": "thïnk", "reasoning": "fïrst",
           "reasoning_details": [{"type": "reasoning.text", "text": "a"}, {"type": "reasoning.text", "text": "b"}],
           "tool_calls": [{"name": "search", "arguments": {"q": "naïve ☃ \"quoted\""}, "id": "a"},
                          {"name": "read_file", "arguments": {"path": "/tmp/x"}, "id": "b"}],
           "usage": {"prompt_tokens": 7, "completion_tokens": 9}, "provider": "Prov"}


def _settings(server, **kw) -> ModelSettings:
    return replace(ModelSettings(model="m", base_url=server.url, api_key="k", max_retries=0), **kw)


def _call(settings: ModelSettings, prompt: str = "hi", times: int = 1, on_retry=None) -> tuple[list, list[int]]:
    """`times` calls on one endpoint (one pool): their completions or errors, and the stalls heard."""
    stalls: list[int] = []

    async def calls():
        endpoint, results = chat_calls.Endpoint(settings, 2), []
        try:
            for _ in range(times):
                try:
                    results.append(await chat_calls.complete(endpoint, settings, [{"role": "user", "content": prompt}], TOOL,
                                                      lambda: None, on_stall=lambda: stalls.append(1),
                                                      on_retry=on_retry))
                except Exception as e:  # noqa: BLE001 - the test looks at which
                    results.append(e)
        finally:
            await endpoint.close()
        return results

    return arun(calls()), stalls


def test_an_awkward_stream_assembles_into_the_unstreamed_message(scripted_server):
    """Deltas of 3 characters written 5 bytes at a time (reads end inside UTF-8 characters and the
    arguments' JSON), comments between chunks, ids and names apart, two calls interleaved."""
    server = scripted_server({"default": [{**AWKWARD, "pieces": 3, "write_bytes": 5, "comments": True}]})
    (plain,), _ = _call(_settings(server, stream=False))
    (streamed,), _ = _call(_settings(server))
    assert streamed.message == plain.message
    assert streamed.message["content"] == "héllo wörld ☃ done" and len(streamed.message["tool_calls"]) == 2
    assert streamed.message["reasoning_details"] == AWKWARD["reasoning_details"]
    assert (streamed.usage, streamed.model, streamed.provider) == (plain.usage, plain.model, "Prov")
    assert server.stats()["stream_events"] > 30
    sent = [r["body"] for r in server.requests()]
    assert "stream" not in sent[0] and sent[1]["stream"] is True and sent[1]["stream_options"] == {"include_usage": True}
    assert set(streamed.timing) == {"first_byte", "first_token", "generation"}
    assert streamed.timing["first_byte"] <= streamed.timing["first_token"] and streamed.timing["generation"] > 0


@pytest.mark.parametrize("fault, retried", [
    ({"stream_error": {"after": 3, "status": 503, "error": "upstream overloaded"}}, "HTTP 503"),
    # a server_error that names no number: OpenRouter's code, OpenAI's type with a null code
    ({"stream_error": {"after": 3, "status": 500, "error": "Provider disconnected", "code": "server_error"}}, "HTTP 500"),
    ({"stream_error": {"after": 3, "status": 500, "error": "The server had an error", "code": None}}, "HTTP 500"),
    ({"stall_after": 2}, "timeout"),
    ({"cut_after": 2}, "connection error"),
    ({"stream_error": {"after": 2, "status": 400, "error": "bad request"}}, None),
])
def test_faults_mid_stream_follow_the_one_retry_policy(scripted_server, monkeypatch, fault, retried):
    """A mid-stream error is retried as the status it names (a `server_error` as a 500); the retry
    is announced with its cause as the progress line words it."""
    from trajgen.worker import Worker
    monkeypatch.setattr(chat_calls, "BACKOFF_BASE", 0.05)
    monkeypatch.setattr(chat_calls, "backoff", lambda previous: 0.05)
    server = scripted_server({"default": [{"content": "a long answer", "pieces": 2, **fault, "times": 1,
                                           "then": {"content": "fine"}}]})
    announced = []
    worker = SimpleNamespace(send=announced.append)
    settings = _settings(server, max_retries=1, stall_timeout=0.5)
    (result,), stalls = _call(settings, on_retry=lambda *args: Worker.retrying(worker, *args))
    if retried:
        assert result.message["content"] == "fine" and server.stats()["requests"] == 2
        assert [(r.cause, r.attempt, r.wait) for r in announced] == [(retried, 1, 0.05)]
    else:
        assert isinstance(result, errors.ProviderError) and result.status == 400 and server.stats()["requests"] == 1
        assert chat_calls.describe(result) == ("ProviderError", "bad request (status 400)") and not announced
    assert len(stalls) == ("stall_after" in fault)


@pytest.mark.parametrize("ending, stream", [
    ({"end": "reset"}, True),  # usage and [DONE], then a RST
    ({"end": "close"}, True),  # usage and [DONE], then a FIN short of the chunked terminator
    ({"end": "reset", "done": False}, True),  # the finish reason and the usage, then a RST without [DONE]
    ({"end": "close", "done": False}, True),
    ({"end": "reset", "pieces": 2, "chunk_delay": 0.01}, True),  # each event in a read of its own
    ({"end": "hold"}, True),  # the end never comes: kept after END_GRACE, not at the --request_timeout
    ({"end": "reset"}, False),  # a whole JSON body sent chunked, then a RST
    ({"end": "close"}, False),  # ... then a FIN short of the terminator
])
def test_a_complete_reply_is_kept_however_its_connection_ends(scripted_server, monkeypatch, ending, stream):
    """The server bills every complete reply it sends: one that arrived whole is kept, never asked
    (and paid for) again, whether the connection then ends with a RST or a FIN."""
    monkeypatch.setattr(chat_calls, "backoff", lambda previous: 0.05)
    server = scripted_server({"default": [{"content": "paid for", "usage": {"cost": 0.5}, **ending}]})
    (result,), _ = _call(_settings(server, max_retries=3, stream=stream, stall_timeout=600, request_timeout=60))
    assert result.message["content"] == "paid for" and result.usage["cost"] == 0.5
    assert server.stats()["billed"] == server.stats()["requests"] == 1


def test_a_stream_that_ends_cleanly_after_its_finish_reason_stands(scripted_server):
    """No usage and no [DONE], but the chunked body's own end: the server ended the reply, which was
    paid for; it is kept with its usage unknown, not asked again."""
    server = scripted_server({"default": [{"content": "paid for", "usage": False, "done": False}]})
    (result,), _ = _call(_settings(server, max_retries=3))
    assert result.message["content"] == "paid for" and result.usage is None
    assert server.stats()["requests"] == 1


@pytest.mark.parametrize("fault", [
    {"cut_after": 3},  # the finish reason came, the usage never did: the reply may still have been going
    {"end": "reset", "stream_error": {"after": 2, "status": 500}},  # an error, then the end: nothing complete
])
def test_a_reply_that_did_not_fully_arrive_is_asked_again(scripted_server, monkeypatch, fault):
    monkeypatch.setattr(chat_calls, "backoff", lambda previous: 0.05)
    server = scripted_server({"default": [{"content": "ab", "pieces": 1, **fault, "times": 1,
                                           "then": {"content": "fine"}}]})
    (result,), _ = _call(_settings(server, max_retries=1))
    assert result.message["content"] == "fine" and server.stats()["requests"] == 2
    assert server.stats()["billed"] == 1


def test_a_reply_is_whole_at_its_done_or_at_its_finish_reason_and_usage():
    """The one rule, whatever ends the connection after it (a FIN, a RST, a short chunked body): a
    finish reason without the usage asked for is not yet whole; nothing after `[DONE]` counts."""
    chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}
    assembly = stream.Assembly()
    assembly.add(json.dumps(chunk).encode())
    assert assembly.ended and not assembly.complete
    assembly.add(json.dumps({"choices": [], "usage": {"prompt_tokens": 1}}).encode())
    assert assembly.complete and not assembly.done
    done = stream.Assembly()
    done.add(b"[DONE]")
    done.add(b'{"error": {"message": "late", "code": 500}}')  # after the end: not part of the reply
    assert done.complete and done.message() == {"role": "assistant"}


@pytest.mark.parametrize("reply", [
    {**AWKWARD, "content_type": "text/plain"}, {**AWKWARD, "content_type": "application/json"},
    # read 2 bytes at a time: the first read, `da` (or `: `), does not yet tell a stream from JSON
    {"content": "héllo ☃", "content_type": "application/json; charset=utf-8", "write_bytes": 2, "comments": True},
    {"content": "héllo ☃", "content_type": "text/plain", "write_bytes": 2},
])
def test_a_stream_is_read_as_one_whatever_its_content_type(scripted_server, reply):
    """As the openai SDK does: an event stream is told from JSON by its first bytes."""
    server = scripted_server({"default": [reply]})
    (streamed,), _ = _call(_settings(server))
    (plain,), _ = _call(_settings(server, stream=False))
    assert streamed.message == plain.message and streamed.usage == plain.usage
    assert server.stats()["billed"] == server.stats()["requests"] == 2


def test_a_json_body_served_as_text_is_read_as_json(scripted_server):
    body = '{"choices": [{"message": {"role": "assistant", "content": "fine"}}], "model": "m"}'
    raw = f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(body) + 3}\r\n\r\n \r\n{body}"
    server = scripted_server({"default": [{"raw": raw}]})
    (result,), _ = _call(_settings(server))
    assert result.message["content"] == "fine"


@pytest.mark.parametrize("hint", ["soon", "nan", "inf", "-5", "NaN", "1e999", "Wed, 99 Foo 2026 00:00:00 GMT"])
def test_a_retry_after_that_does_not_parse_falls_back_to_the_backoff(scripted_server, monkeypatch, hint):
    monkeypatch.setattr(chat_calls, "backoff", lambda previous: 0.05)
    server = scripted_server({"default": [{"status": 429, "retry_after": hint, "times": 1}]})
    waits = []
    (result,), _ = _call(_settings(server, max_retries=1), on_retry=lambda error, attempt, retries, wait: waits.append(wait))
    assert result.message["content"] == "ok" and waits == [0.05]
    assert chat_calls._retry_after({"retry-after": hint}) is None


def test_a_retry_after_that_parses_is_honoured():
    assert chat_calls._retry_after({"retry-after": "7"}) == 7.0
    assert chat_calls._retry_after({"retry-after-ms": "soon", "retry-after": "2.5"}) == 2.5
    assert chat_calls._retry_after({"retry-after-ms": "1500"}) == 1.5
    assert chat_calls._retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0  # in the past
    assert chat_calls.retry_wait(errors.status_error(429, {"retry-after": "7"}, b""), 0.0, True) >= 7.0


def test_a_stall_is_named_and_a_cut_stream_is_a_connection_error(scripted_server):
    server = scripted_server({"prompts": {"stall": [{"content": "abcdef", "pieces": 1, "stall_after": 2}],
                                          "cut": [{"content": "abcdef", "pieces": 1, "cut_after": 2}]}})
    (stalled,), stalls = _call(_settings(server, stall_timeout=0.3), "stall")
    assert isinstance(stalled, errors.APITimeoutError) and stalls == [1]
    assert "stalled: no byte for 0.3 s (--stall_timeout)" in chat_calls.describe(stalled)[1]
    (cut,), _ = _call(_settings(server), "cut")
    assert type(cut) is errors.APIConnectionError



def test_a_trickling_stream_is_read_in_batches_that_never_look_like_a_stall(scripted_server, monkeypatch):
    """Chunks 5 ms apart are read a tenth of a second's worth at a time (one wake-up for many chunks);
    a pause between reads stays within half of --stall_timeout, however long a batch would be."""
    reads = []
    feed = stream.EventReader.feed
    monkeypatch.setattr(stream.EventReader, "feed", lambda self, data: reads.append(data) or feed(self, data))
    server = scripted_server({"default": [{"content": "z" * 200, "pieces": 1, "chunk_delay": 0.005}]})
    (batched,), _ = _call(_settings(server))
    assert batched.message["content"] == "z" * 200 and len(reads) < 50
    monkeypatch.setattr(chat_calls, "BATCH_SECONDS", 5.0)
    (capped,), stalls = _call(_settings(server, stall_timeout=1.0))
    assert capped.message["content"] == "z" * 200 and not stalls

def test_a_reply_over_the_cap_fails_at_once_streamed_or_not(scripted_server):
    big = "x" * (3 << 20)
    server = scripted_server({"prompts": {"big": [{"content": big}], "pieces": [{"content": big, "pieces": 1 << 16}]}})
    for prompt, stream in (("big", False), ("big", True), ("pieces", True)):
        (result,), _ = _call(_settings(server, stream=stream, max_retries=3, max_reply_bytes=1 << 20), prompt)
        assert isinstance(result, errors.ReplyTooLarge), result
        assert "larger than --max_reply_mb=1 " in str(result)
    assert server.stats()["requests"] == 3  # never asked again within the call


def test_a_long_generation_through_a_gateway_that_cuts_idle_connections(scripted_server):
    """A gateway that cuts a connection idle for 2 s (Cloudflare does at 100 s): a 10-second
    generation lands when streamed, and the unstreamed call, silent until done, is cut."""
    server = scripted_server({"default": [{"content": "x" * 20, "pieces": 1, "chunk_delay": 0.5}]})

    async def through_gateway(stream: bool):
        async def relay(client_reader, client_writer):
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", server.port)
            last = [time.monotonic()]  # a byte either way keeps the connection alive

            async def pipe(src, dst):
                while time.monotonic() - last[0] < 2.0:
                    try:
                        data = await asyncio.wait_for(src.read(65536), 0.1)
                    except TimeoutError:
                        continue
                    if not data:
                        return
                    last[0] = time.monotonic()
                    dst.write(data)
                    await dst.drain()

            await asyncio.wait([asyncio.ensure_future(pipe(client_reader, upstream_writer)),
                                asyncio.ensure_future(pipe(upstream_reader, client_writer))],
                               return_when=asyncio.FIRST_COMPLETED)
            client_writer.transport.abort()
            upstream_writer.transport.abort()

        gateway = await asyncio.start_server(relay, "127.0.0.1", 0)
        port = gateway.sockets[0].getsockname()[1]
        settings = _settings(server, base_url=f"http://127.0.0.1:{port}/v1", stream=stream)
        endpoint = chat_calls.Endpoint(settings, 1)
        try:
            return await chat_calls.complete(endpoint, settings, [{"role": "user", "content": "go"}], None, lambda: None)
        except errors.APIConnectionError as e:
            return e
        finally:
            await endpoint.close()
            gateway.close()

    streamed = arun(through_gateway(True))
    assert streamed.message["content"] == "x" * 20 and streamed.timing["generation"] >= 9
    assert isinstance(arun(through_gateway(False)), errors.APIConnectionError)


def test_closing_a_stream_stops_the_generation(scripted_server):
    """A stop cancels the call: the connection closes, and the server writes no more chunks."""
    server = scripted_server({"default": [{"content": "y" * 1000, "pieces": 1, "chunk_delay": 0.01}]})
    settings = _settings(server)

    async def stop_midway():
        endpoint = chat_calls.Endpoint(settings, 1)
        call = asyncio.ensure_future(chat_calls.complete(endpoint, settings, [{"role": "user", "content": "go"}], None,
                                                  lambda: None))
        while server.stats()["stream_events"] < 50:
            await asyncio.sleep(0.01)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        at_stop = server.stats()["stream_events"]
        await endpoint.close()
        await asyncio.sleep(0.5)  # 50 more chunks' worth of time
        return at_stop, server.stats()["stream_events"]

    at_stop, later = arun(stop_midway())
    assert later - at_stop <= 1 and later < 200


@pytest.mark.parametrize("raw", [
    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Long: a\r\n  folded\r\nContent-Length: {n}\r\n\r\n{body}",
    "HTTP/1.1 200 OK\r\nContent-Length: {nb}\r\n\r\n\xef\xbb\xbf{body}",
])
def test_folded_headers_and_a_bom_are_accepted(scripted_server, raw):
    body = '{"choices": [{"message": {"role": "assistant", "content": "fine"}}], "model": "m"}'
    server = scripted_server({"default": [{"raw": raw.format(n=len(body), nb=len(body) + 3, body=body)}]})
    (result,), _ = _call(_settings(server))
    assert result.message["content"] == "fine"


def test_gzip_is_decoded(scripted_server):
    server = scripted_server({"default": [{"content": "zipped", "gzip": True}]})
    (result,), _ = _call(_settings(server, stream=False))
    assert result.message["content"] == "zipped"


@pytest.mark.parametrize("raw", [
    "HTTP/1.1 200 OK\r\nContent-Length: \u00b2\r\n\r\n{}",
    "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n{}\r\n0\r\n\r\n",
    # aiohttp's parser (llhttp) refuses two Content-Length headers even when they agree (h11 accepts them)
    "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
])
def test_malformed_lengths_are_connection_errors_retried_as_the_policy_allows(scripted_server, monkeypatch, raw):
    monkeypatch.setattr(chat_calls, "backoff", lambda previous: 0.05)
    server = scripted_server({"default": [{"raw": raw}]})
    (result,), _ = _call(_settings(server, max_retries=2))
    assert type(result) is errors.APIConnectionError and server.stats()["requests"] == 3


def test_a_request_read_and_dropped_is_sent_again_only_as_the_policy_allows(scripted_server, monkeypatch):
    monkeypatch.setattr(chat_calls, "backoff", lambda previous: 0.05)
    server = scripted_server({"prompts": {"never": [{"drop": True}],
                                          "once": [{"drop": True, "times": 1, "then": {"content": "ok"}}]}})
    (dropped,), _ = _call(_settings(server), "never")
    assert type(dropped) is errors.APIConnectionError and server.stats()["requests"] == 1  # --max_retries=0: once
    (answered,), _ = _call(_settings(server, max_retries=1), "once")
    assert answered.message["content"] == "ok" and server.stats()["requests"] == 3


@pytest.mark.parametrize("trailing", [{"trailing": "\r\n"}, {"trailing": "JUNK!", "trailing_delay": 0.05}])
def test_stray_bytes_after_a_body_do_not_cost_the_next_answer(scripted_server, trailing):
    """A connection with bytes after a body is not used again: the next request would read them as its
    answer and throw the real one away, paid (the openai SDK over httpx does). A stray CRLF in the
    same read as the body is accepted."""
    server = scripted_server({"default": [{"content": "a", **trailing}]})

    async def calls():
        settings = _settings(server, stream=False)
        endpoint, got = chat_calls.Endpoint(settings, 1), []
        for _ in range(3):
            got.append(await chat_calls.complete(endpoint, settings, [{"role": "user", "content": "hi"}], None, lambda: None))
            await asyncio.sleep(0.1)  # the late bytes have come
        await endpoint.close()
        return got

    assert [r.message["content"] for r in arun(calls())] == ["a", "a", "a"] and server.stats()["requests"] == 3


def test_a_tls_handshake_that_never_answers_is_named(monkeypatch):
    monkeypatch.setattr(chat_calls, "CONNECT_TIMEOUT", 0.5)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel does), never speaks TLS
    try:
        settings = ModelSettings(model="m", base_url=f"https://127.0.0.1:{silent.getsockname()[1]}/v1", api_key="k",
                                 max_retries=0)
        (result,), _ = _call(settings)
    finally:
        silent.close()
    assert isinstance(result, errors.APITimeoutError)
    assert "TLS handshake" in chat_calls.describe(result)[1] and "within 0.5 s" in chat_calls.describe(result)[1]


def test_no_proxy_cidr_ranges_are_honoured(scripted_server, monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    dead = socket.create_server(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()
    server = scripted_server({"default": [{"content": "direct"}]})
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{dead_port}")
    (through_dead_proxy,), _ = _call(_settings(server))
    assert isinstance(through_dead_proxy, errors.EndpointUnreachable)  # the proxy is used when not excluded
    monkeypatch.setenv("NO_PROXY", "example.org,127.0.0.0/8")
    (direct,), _ = _call(_settings(server))
    assert direct.message["content"] == "direct"
    assert chat_calls.env_proxy("http://10.1.2.3/v1") == f"http://127.0.0.1:{dead_port}"
    assert chat_calls.env_proxy("http://api.example.org/v1") is None


@pytest.mark.parametrize("step", [1, 2, 3, 7, 64])
def test_events_are_cut_only_at_their_end(step):
    from trajgen.stream import EventReader
    text = ('data: {"a": "hé☃"}\r\n\r\n: OPENROUTER PROCESSING\r\n\r\ndata: {"b":\ndata: 1}\n\n'
            'event: message\ndata: c\n\ndata:d\n\ndata:  e\n\ndata: [DONE]\r\r').encode()
    reader, found = EventReader(), []
    for i in range(0, len(text), step):
        found += reader.feed(text[i:i + step])
    assert found == ['{"a": "hé☃"}'.encode(), b'{"b":\n1}', b"c", b"d", b" e", b"[DONE]"]


def test_a_streamed_run_counts_stalls_and_latency_and_a_reply_over_the_cap_fails_its_prompt(inline, scripted_server):
    """Through the CLI: a prompt whose first stream stalls lands on the retry, a prompt whose reply
    exceeds --max_reply_mb fails with one line naming the size, asked once; statistics.json and the
    summary carry the stalls and the latency."""
    from tests.conftest import read_jsonl, think, write_jsonl
    server = scripted_server({"prompts": {
        "stalls": [{"content": "abcdef", "pieces": 1, "stall_after": 2, "times": 1, "then": think("after a stall")}],
        "huge": [{"content": "x" * (2 << 20)}]},
        "default": [{**think("streamed in pieces"), "pieces": 2, "chunk_delay": 0.01}]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": p} for p in ("stalls", "huge", "plain 1", "plain 2")])
    done = inline.run(*inline.args(server, max_retries=2, stall_timeout=1, max_reply_mb=1))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    failure, = read_jsonl(inline.run_dir() / "failures.jsonl")
    assert failure["error_class"] == "ReplyTooLarge" and "larger than --max_reply_mb=1 " in failure["message"]
    assert sum(r["prompt"] == "huge" for r in server.requests()) == 1
    stats = json.loads((inline.run_dir() / "statistics.json").read_text())
    assert stats["failed"]["by_class"] == {"ReplyTooLarge": 1} and stats["ok"] == 3 and stats["stalls"] == 1
    assert stats["latency"]["first_token"]["replies"] == 3
    assert stats["latency"]["generation"]["median"] > 0
    rows = {r["conversations"][1]["value"]: r for r in read_jsonl(inline.run_dir() / "trajectories.jsonl")}
    assert rows["stalls"]["metadata"]["usage"]["stalls"] == 1
    assert all(r["body"].get("stream") is True for r in server.requests())
    assert "first token median / p95" in done.stdout + done.stderr and "stalls" in done.stdout + done.stderr


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(folder / "key.pem"),
                    "-out", str(folder / "cert.pem")], check=True, capture_output=True)
    return folder / "cert.pem", folder / "key.pem"


def test_tls_trusts_certifi_or_ssl_cert_file_and_an_https_proxy_tunnels(certificate, monkeypatch, scripted_server):
    """A TLS front to the scripted server with a certificate only SSL_CERT_FILE trusts, reached
    directly and through an https:// proxy (TLS to the proxy, then CONNECT)."""
    cert, key = certificate
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    server = scripted_server({"default": [{"content": "secure"}]})
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY", "no_proxy",
                 "NO_PROXY", "SSL_CERT_FILE", "SSL_CERT_DIR"):
        monkeypatch.delenv(name, raising=False)

    async def pipe(src, dst):
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
        dst.close()

    async def front(reader, writer):  # TLS in front of the scripted server
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", server.port)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

    tunnels = []

    async def proxy(reader, writer):  # an https proxy: TLS from the client, then CONNECT
        head = await reader.readuntil(b"\r\n\r\n")
        tunnels.append(head.split(b"\r\n")[0])
        port = int(head.split(b" ")[1].rsplit(b":", 1)[1])
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

    async def calls():
        tls_front = await asyncio.start_server(front, "127.0.0.1", 0, ssl=tls)
        tls_proxy = await asyncio.start_server(proxy, "127.0.0.1", 0, ssl=tls)
        settings = ModelSettings(model="m", base_url=f"https://localhost:{tls_front.sockets[0].getsockname()[1]}/v1",
                                 api_key="k", max_retries=0)
        results = []
        for env in ({}, {"SSL_CERT_FILE": str(cert)},
                    {"SSL_CERT_FILE": str(cert), "HTTPS_PROXY": f"https://localhost:{tls_proxy.sockets[0].getsockname()[1]}"}):
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            chat_calls.trust.cache_clear()
            endpoint = chat_calls.Endpoint(settings, 1)
            try:
                results.append((await chat_calls.complete(endpoint, settings, [{"role": "user", "content": "hi"}], None,
                                                   lambda: None)).message["content"])
            except errors.EndpointUnreachable as e:  # never answered: the run would stop, naming the cause
                results.append(str(e))
            finally:
                await endpoint.close()
        tls_front.close()
        tls_proxy.close()
        return results

    untrusted, trusted, proxied = arun(calls())
    chat_calls.trust.cache_clear()
    assert untrusted == "TLS failure: the certificate is not accepted (self-signed certificate)"
    assert trusted == proxied == "secure" and tunnels[0].startswith(b"CONNECT localhost:")


def test_kill_9_mid_stream_asks_that_call_again_and_no_complete_reply(cli, scripted_server):
    """A reply is journaled only once its stream is complete: after a kill -9 mid-stream, --resume
    asks that one call again, and never the turn whose reply had arrived."""
    from tests.conftest import call, kill_group, read_jsonl, think, write_jsonl
    from trajgen import store
    server = scripted_server({"default": [call("terminal", command="echo hi"),
                                          {**think("slowly"), "pieces": 1, "chunk_delay": 0.2}]})
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": "long"}])
    args = cli.args(server, num_workers=1, concurrency=1)
    first = cli.start(*args)
    deadline = time.monotonic() + 120
    while server.stats()["stream_events"] < 5:  # turn 0 streamed whole, turn 1 under way
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.05)
    journaled = [e["turn"] for e in store.read_records(cli.run_dir() / store.JOURNAL, [])]
    kill_group(first)
    first.wait()
    assert journaled == [0]  # the stream in flight is not journaled
    server.set_script({"default": [call("terminal", command="echo hi"), think("at once")]})
    done = cli.run(*args, "--resume")
    assert done.returncode == 0, done.stderr
    asked = Counter(r["turn"] for r in server.requests())
    assert asked == Counter({0: 1, 1: 2})
    row, = read_jsonl(cli.run_dir() / "trajectories.jsonl")
    assert row["metadata"]["usage"]["replayed"]["turns"] == 1 and "at once" in row["conversations"][-1]["value"]
