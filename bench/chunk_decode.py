#!/usr/bin/env python
"""Instructions to decode one streamed chunk, with and without vLLM's ids, by orjson (what
trajgen/stream.py uses) and by msgspec's typed decoding, which skips the fields a runner does not keep.

    pip install msgspec   # not a dependency of the project
    python bench/chunk_decode.py

Counts with valgrind's callgrind (deterministic whatever the load): each decoder is run 20,000 times
and once with 0 decodes, and the difference is divided. Figures: bench/RESULTS.md, "Token ids".
"""
from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import msgspec
import orjson

DECODES = 20_000
PLAIN = (b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
         b'"delta":{"content":"a"},"logprobs":null,"finish_reason":null}]}')
IDS = (b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
       b'"delta":{"content":"a"},"logprobs":{"content":[{"token":"a","logprob":-0.5,"bytes":[97],"top_logprobs":[]}]},'
       b'"finish_reason":null,"token_ids":[97]}]}')  # as vLLM >= 0.10.2 streams it with return_token_ids and logprobs


class Entry(msgspec.Struct, gc=False):
    logprob: float | None = None
    id: int | None = None


class Logprobs(msgspec.Struct, gc=False):
    content: list[Entry] | None = None


class Delta(msgspec.Struct, gc=False):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    reasoning_details: Any = None
    tool_calls: Any = None


class Choice(msgspec.Struct, gc=False):
    delta: Delta | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    logprobs: Logprobs | None = None
    prompt_token_ids: Any = None


class Chunk(msgspec.Struct, gc=False):
    model: str | None = None
    provider: Any = None
    usage: Any = None
    error: Any = None
    prompt_token_ids: Any = None
    choices: list[Choice] | None = None


DECODERS = {"orjson": orjson.loads, "msgspec": msgspec.json.Decoder(Chunk).decode}


def instructions(chunk: str, decoder: str, n: int) -> int:
    """Instructions of this script decoding `chunk` n times, as callgrind counts them."""
    done = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
                           __file__, chunk, decoder, str(n)], capture_output=True, text=True, check=True)
    return int(re.search(r"Collected : (\d+)", done.stderr).group(1))


def main() -> None:
    if len(sys.argv) == 4:  # the measured child
        data, decode = (PLAIN if sys.argv[1] == "plain" else IDS), DECODERS[sys.argv[2]]
        for _ in range(int(sys.argv[3])):
            decode(data)
        return
    print("| chunk | decoder | instructions per decode |\n|---|---|---|")
    for chunk in ("plain", "ids"):
        for decoder in DECODERS:
            per = (instructions(chunk, decoder, DECODES) - instructions(chunk, decoder, 0)) / DECODES
            print(f"| {chunk} | {decoder} | {per / 1000:.1f} k |")


if __name__ == "__main__":
    main()
