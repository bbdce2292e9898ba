"""--model=local --token_ids: llama-cpp-python's own server (its app, chat templates, locking and
streaming), whose chat route also answers vLLM's `return_token_ids`, since this process holds the
tokens. Run as `python -m trajgen.local_server` with llama_cpp.server's arguments (trajgen/local_model.py).

The ids are recorded where llama.cpp samples them (`Llama.generate`): the prompt exactly as the
model was fed it, every token it sampled (the end-of-turn token included, as vLLM sends it) and
that token's logprob under the model, before temperature and sampling filters (vLLM's default)."""
from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass, field
from functools import partial

import anyio
import numpy as np
import uvicorn
from fastapi import Depends, HTTPException, Request
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool

import llama_cpp
from llama_cpp.server import app as llama_app
from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
from llama_cpp.server.settings import ModelSettings, ServerSettings, Settings
from llama_cpp.server.types import CreateChatCompletionRequest

CHAT = "/v1/chat/completions"
_NOT_PASSED = {"n", "logit_bias_type", "user", "min_tokens"}  # what llama_cpp's own chat route leaves out
# llama_cpp's logprobs need logits_all=True, a context-sized copy of every logit (800 MB here): ours come
# from the last logits alone, so these never reach llama_cpp
_OURS = {"logprobs", "top_logprobs"}


@dataclass
class Generation:
    """One `Llama.generate` call: what the model was fed, what it sampled, at which logprobs."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class Recorder:
    """Stands in for a Llama's `generate` for one request (the llama lock serializes requests)."""

    def __init__(self, llama: llama_cpp.Llama) -> None:
        self.llama, self.generations = llama, []
        llama.generate = self  # an instance attribute: llama_cpp's create_completion calls self.generate

    def __call__(self, tokens, **kwargs):
        fed = Generation(list(tokens))
        self.generations.append(fed)
        n_vocab = self.llama.n_vocab()
        for token in type(self.llama).generate(self.llama, tokens, **kwargs):
            # the logits it sampled from are the last decode's until the generator goes on
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llama.ctx, -1), shape=(n_vocab,))
            top = logits.max()
            fed.ids.append(token)
            fed.logprobs.append(float(logits[token] - top - np.log(np.exp(logits - top).sum())))
            yield token

    def only(self) -> Generation:
        """The request's one generation (a chat handler that generates in steps is refused before)."""
        [generation] = self.generations
        return generation


def _logprobs(llama: llama_cpp.Llama, ids: list[int], logprobs: list[float]) -> dict:
    """OpenAI's `logprobs` of a choice, as vLLM fills it (no alternatives)."""
    pieces = (llama.detokenize([i], special=True) for i in ids)
    return {"content": [{"token": p.decode(errors="replace"), "logprob": lp, "bytes": list(p), "top_logprobs": []}
                        for p, lp in zip(pieces, logprobs)]}


def _whole(llama: llama_cpp.Llama, with_logprobs: bool, **kwargs) -> dict:
    recorder = Recorder(llama)
    reply = llama.create_chat_completion(**kwargs)
    fed = recorder.only()
    reply["prompt_token_ids"] = fed.prompt
    reply["choices"][0]["token_ids"] = fed.ids
    if with_logprobs:
        reply["choices"][0]["logprobs"] = _logprobs(llama, fed.ids, fed.logprobs)
    return reply


def _streamed(llama: llama_cpp.Llama, with_logprobs: bool, **kwargs):
    """vLLM's stream: the prompt ids in the first chunk, then in each the ids sampled for its text."""
    recorder, sent = Recorder(llama), 0
    chunks = llama.create_chat_completion(**kwargs)
    role = next(chunks)  # llama_cpp's first chunk is the role alone, sent once the first text is ready
    yield role | {"prompt_token_ids": recorder.only().prompt}
    for chunk in chunks:
        fed, choice = recorder.only(), chunk["choices"][0]
        choice["token_ids"] = fed.ids[sent:]
        if with_logprobs:
            choice["logprobs"] = _logprobs(llama, fed.ids[sent:], fed.logprobs[sent:])
        sent += len(choice["token_ids"])
        yield chunk


async def chat(request: Request, body: CreateChatCompletionRequest):
    """llama_cpp's chat route, or, for a request with `return_token_ids: true`, the same with vLLM's ids."""
    if (await request.json()).get("return_token_ids") is not True:
        return await llama_app.create_chat_completion(request, body)
    if body.tools and body.tool_choice not in (None, "none"):
        raise HTTPException(400, "return_token_ids: with a tool_choice, chatml-function-calling generates in "
                                 "several steps, not one completion")
    kwargs = body.model_dump(exclude=_NOT_PASSED | _OURS)
    call = partial(_streamed if body.stream else _whole, with_logprobs=bool(body.logprobs))
    if body.stream:
        send, receive = anyio.create_memory_object_stream(10)
        return EventSourceResponse(
            receive, sep="\n", ping_message_factory=llama_app._ping_message_factory,
            data_sender_callable=partial(llama_app.get_event_publisher, request=request, inner_send_chan=send,
                                         body=body, body_model=body.model, llama_call=call, kwargs=kwargs))
    async with contextlib.asynccontextmanager(llama_app.get_llama_proxy)() as proxy:
        llama = llama_app.prepare_request_resources(body, proxy, body.model, kwargs)
        return await run_in_threadpool(call, llama, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description="llama_cpp.server, with vLLM's return_token_ids")
    add_args_from_model(parser, Settings)
    args = parser.parse_args()
    server = parse_model_from_args(ServerSettings, args)
    app = llama_app.create_app(server_settings=server, model_settings=[parse_model_from_args(ModelSettings, args)])
    app.add_api_route(CHAT, chat, methods=["POST"], dependencies=[Depends(llama_app.authenticate)])
    app.router.routes.insert(0, app.router.routes.pop())  # before llama_cpp's: the first route that matches serves
    uvicorn.run(app, host=server.host, port=server.port)


if __name__ == "__main__":
    main()
