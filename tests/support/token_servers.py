"""Loopback chat servers that send token ids the way vLLM, SGLang and llama.cpp's llama-server do
(and one that sends none, as OpenAI), streamed and not, for the --token_ids tests.

Their "tokenizer" is the characters' code points: a request's prompt is its messages rendered as
`<|role|>content` (tool calls as their JSON) ending in `<|assistant|>`, and a reply's ids are its
text's code points then EOS; logprobs are exact binary fractions, so the rows can be compared with
what was sent bit for bit. Each reply answers the request's turn (the number of assistant
messages in it): `replies[turn]` is an assistant message, plus `fault`: "short_logprobs" (one
logprob fewer than ids) or "no_ids" (the ids left out of that reply).
"""
from __future__ import annotations

import asyncio
import functools
import json
import threading
from dataclasses import dataclass, field

from aiohttp import web

EOS, BOS = 0, 1
KINDS = ("vllm", "sglang", "llama.cpp", "openai")
VERSIONS = {"vllm": "0.11.0", "sglang": "0.5.3"}
BUILD_INFO = "b6500-0123abcd"
SERVER = web.AppKey("server", object)


def rendered(body: dict) -> str:
    """The prompt's text as this server's "template" renders it."""
    parts = []
    for message in body["messages"]:
        text = message.get("content") or ""
        if message.get("tool_calls"):
            text += json.dumps(message["tool_calls"], sort_keys=True)
        parts.append(f"<|{message['role']}|>{text}")
    return "".join(parts) + "<|assistant|>"


def prompt_ids(body: dict) -> list[int]:
    return [ord(c) for c in rendered(body)]


def completion_ids(message: dict) -> list[int]:
    text = (message.get("reasoning_content") or "") + (message.get("content") or "")
    if message.get("tool_calls"):
        text += json.dumps(message["tool_calls"], sort_keys=True)
    return [ord(c) for c in text] + [EOS]


def logprobs(n: int) -> list[float]:
    return [-(i % 8) / 8 for i in range(n)]


@dataclass
class TokenServer:
    kind: str
    replies: list[dict]
    url: str = ""
    requests: list[dict] = field(default_factory=list)
    pace: float = 0.0  # streamed: seconds between each ten chunks, as a server generates them (0: at once)
    always_ids: bool = False  # send vLLM's ids and logprobs even when not asked (bench/token_ids.py: their bytes' cost)
    stop: object = None  # ends the server (set by `start`)

    def reply_for(self, body: dict) -> tuple[dict, str | None]:
        turn = sum(1 for m in body["messages"] if m.get("role") == "assistant")
        reply = dict(self.replies[min(turn, len(self.replies) - 1)])
        return {"role": "assistant", **reply}, reply.pop("fault", None)


def _entries(kind: str, ids: list[int], probs: list[float]) -> list[dict]:
    """logprobs.content[]: llama-server names each token's id, the others only its text."""
    entries = []
    for token, logprob in zip(ids, probs):
        entry = {"token": chr(token) if token > BOS else "", "logprob": logprob, "bytes": [token], "top_logprobs": []}
        entries.append({"id": token, **entry} if kind == "llama.cpp" else entry)
    return entries


def _choice_tokens(server: TokenServer, body: dict, ids: list[int], probs: list[float],
                   first: bool) -> tuple[dict, dict]:
    """(top-level fields, choice fields) carrying `ids` and their `probs`, as the server's kind sends them."""
    kind, top, choice = server.kind, {}, {}
    if server.always_ids:
        body = {**body, "return_token_ids": True, "logprobs": True}
    if kind == "vllm" and body.get("return_token_ids"):
        if first:
            top["prompt_token_ids"] = prompt_ids(body)
        choice["token_ids"] = ids
    if kind == "sglang":
        if body.get("return_prompt_token_ids"):
            choice["prompt_token_ids"] = prompt_ids(body)
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
    if body.get("logprobs") and (kind != "llama.cpp" or (body.get("top_logprobs") or 0) >= 1):
        choice["logprobs"] = {"content": _entries(kind, ids, probs)}
    return top, choice


async def _chat(request: web.Request) -> web.StreamResponse:
    server: TokenServer = request.app[SERVER]
    body = await request.json()
    server.requests.append(body)
    if server.kind == "sglang" and body.get("stream") and (body.get("return_token_ids") or
                                                            body.get("return_prompt_token_ids")):
        return web.json_response({"object": "error", "message": "return_token_ids is not supported with streaming",
                                  "code": 400}, status=400)
    message, fault = server.reply_for(body)
    ids = completion_ids(message)
    probs = logprobs(len(ids))[:-1] if fault == "short_logprobs" else logprobs(len(ids))
    finish = "tool_calls" if message.get("tool_calls") else "stop"
    usage = {"prompt_tokens": len(prompt_ids(body)), "completion_tokens": len(ids), "total_tokens": 0}
    base = {"id": "c1", "model": body.get("model"), "created": 0}
    tokens = (lambda *args: ({}, {})) if fault == "no_ids" else functools.partial(_choice_tokens, server, body)
    if not body.get("stream"):
        top, choice = tokens(ids, probs, True)
        return web.json_response({**base, "object": "chat.completion", **top, "usage": usage,
                                  "choices": [{"index": 0, "message": message, "finish_reason": finish, **choice}]})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)

    async def send(data: dict) -> None:
        await response.write(b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")  # compact, as vLLM

    # a chunk per character of the content with its token's id and logprob; then the reasoning, the
    # tool calls and EOS in the last chunk, with the finish reason
    text = message.get("content") or ""
    last = {k: v for k, v in message.items() if k in ("tool_calls", "reasoning_content")}
    if last.get("tool_calls"):
        last["tool_calls"] = [{"index": n, **call} for n, call in enumerate(last["tool_calls"])]
    deltas = [{"role": "assistant", "content": ""}, *({"content": c} for c in text), last]
    bounds = [0, *range(1, len(text) + 1), len(ids)]  # the ids each delta carries: ids[bounds[i - 1]:bounds[i]]
    for i, delta in enumerate(deltas):
        start, end = bounds[i - 1] if i else 0, bounds[i]
        top, choice = tokens(ids[start:end], probs[start:end], i == 0)
        await send({**base, "object": "chat.completion.chunk", **top,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish if delta is last else None,
                                 **choice}]})
        if server.pace and i % 10 == 9:
            await asyncio.sleep(server.pace)
    await send({**base, "object": "chat.completion.chunk", "choices": [], "usage": usage})
    await response.write(b"data: [DONE]\n\n")
    return response


async def _apply_template(request: web.Request) -> web.Response:
    return web.json_response({"prompt": rendered(await request.json())})


async def _tokenize(request: web.Request) -> web.Response:
    body = await request.json()
    return web.json_response({"tokens": [BOS] * bool(body.get("add_special")) + [ord(c) for c in body["content"]]})


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": VERSIONS[request.app[SERVER].kind]})


async def _props(request: web.Request) -> web.Response:
    return web.json_response({"build_info": BUILD_INFO})


def start(kind: str, replies: list[dict]) -> TokenServer:
    """Serve on 127.0.0.1 from a thread of its own; `stop()` ends it."""
    server = TokenServer(kind, replies)
    app = web.Application()
    app[SERVER] = server
    app.router.add_post("/v1/chat/completions", _chat)
    if kind == "llama.cpp":
        app.router.add_post("/apply-template", _apply_template)
        app.router.add_post("/tokenize", _tokenize)
        app.router.add_get("/props", _props)
    if kind in VERSIONS:
        app.router.add_get("/version", _version)
    ready, loop = threading.Event(), asyncio.new_event_loop()
    runner = web.AppRunner(app)

    async def serve() -> None:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(serve()), loop.run_forever()), daemon=True)
    thread.start()
    ready.wait(30)

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()

    server.stop = stop
    return server


def main(argv: list[str] | None = None) -> int:
    """`python -m tests.support.token_servers --kind=vllm --tokens=N`: one reply of N tokens to every
    request, until killed (bench/token_ids.py); prints `READY <url>` once it listens."""
    import argparse
    import signal

    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=KINDS, default="vllm")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--pace", type=float, default=0.0, help="seconds between each ten chunks")
    parser.add_argument("--always_ids", action="store_true", help="ids and logprobs in every reply, asked or not")
    args = parser.parse_args(argv)
    text = "".join(chr(ord("a") + i % 26) for i in range(args.tokens - 1))  # and EOS: `tokens` ids in all
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # for sigwait, in every thread
    server = start(args.kind, [{"content": text}])
    server.pace, server.always_ids = args.pace, args.always_ids
    server.requests = _Forgetful()
    print(f"READY {server.url}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.stop()
    return 0


class _Forgetful(list):
    """A benchmark's server keeps no requests."""

    def append(self, item) -> None:
        pass


if __name__ == "__main__":
    raise SystemExit(main())
