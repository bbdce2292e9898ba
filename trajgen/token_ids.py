"""--token_ids: each chat call asks its server for the token ids and logprobs it used, in that
server's dialect, and each reply's ids are checked before they reach a row (docs/token_ids.md).

Re-tokenizing text afterwards drifts (BPE merges across message boundaries, templates that drop
earlier reasoning, tool calls rendered again): a trainer needs the tokens the policy sampled.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from trajgen.errors import MalformedResponse

VLLM, SGLANG, LLAMA_CPP = "vllm", "sglang", "llama.cpp"
PROBE = "probe"  # the one-token probe asks in every dialect at once, to learn which one the server speaks
_FIELDS = {
    VLLM: {"return_token_ids": True, "logprobs": True},
    SGLANG: {"return_prompt_token_ids": True, "return_token_ids": True, "logprobs": True},
    LLAMA_CPP: {"logprobs": True, "top_logprobs": 1},  # each logprob names its token's id
    PROBE: {"return_prompt_token_ids": True, "return_token_ids": True, "logprobs": True, "top_logprobs": 1},
}
MISSING = ("--token_ids: the endpoint sent no token ids ({what}; vLLM >= 0.10.2, SGLang and llama.cpp's "
           "llama-server send them); retokenize the text instead with --tokenizer=NAME_OR_PATH, or leave "
           "--token_ids out")


@dataclass(frozen=True)
class Dialect:
    """How the run's server is asked for ids, found by the probe before any prompt."""

    kind: str  # VLLM, SGLANG, LLAMA_CPP (or PROBE, for the probe itself)
    version: str | None = None

    @property
    def fields(self) -> dict:
        """What every request adds to its body."""
        return _FIELDS[self.kind]

    @property
    def streams(self) -> bool:
        """SGLang refuses its `return_*` flags on a streamed request."""
        return self.kind != SGLANG

    @property
    def prompt_from_tokenize(self) -> bool:
        """llama-server sends no prompt ids: they come from its /apply-template and /tokenize."""
        return self.kind == LLAMA_CPP

    def as_row(self) -> dict:
        return {"kind": self.kind, "version": self.version}


class Collector:
    """The ids and logprobs of one reply, gathered from its body or from each streamed chunk as
    they come: vLLM's top-level `prompt_token_ids` (the first chunk), SGLang's per choice, every
    `choices[0].token_ids` piece, and each `logprobs.content[]` entry (llama.cpp's with its `id`).
    Only numbers are kept of a chunk, never its objects: a 1,000-token reply streams 1,000 chunks,
    and keeping their dicts alive until the reply ends made the garbage collector walk them over
    and over (bench/token_ids.py)."""

    __slots__ = ("prompt_ids", "prompt_where", "completion_ids", "logprobs", "logprob_ids")

    def __init__(self) -> None:
        self.prompt_ids, self.prompt_where = None, None
        self.completion_ids: list | None = None
        self.logprobs: list = []
        self.logprob_ids: list = []

    def take(self, holder: dict, choice: dict) -> None:
        """Read one body or chunk (`holder`) and its first choice."""
        if self.prompt_where is None:
            if (ids := holder.get("prompt_token_ids")) is not None:
                self.prompt_ids, self.prompt_where = ids, VLLM
            elif (ids := choice.get("prompt_token_ids")) is not None:
                self.prompt_ids, self.prompt_where = ids, SGLANG
        try:
            if (ids := choice.get("token_ids")) is not None:
                if self.completion_ids is None:
                    self.completion_ids = []
                self.completion_ids += ids
            if logprobs := choice.get("logprobs"):
                for entry in logprobs["content"] or ():
                    self.logprobs.append(entry.get("logprob"))
                    self.logprob_ids.append(entry.get("id"))
        except (TypeError, KeyError, AttributeError):
            raise MalformedResponse(f"the reply's token_ids or logprobs are not a token's each: "
                                    f"{str(choice)[:200]}") from None

    def found(self) -> dict:
        """What arrived, unchecked (`checked` judges it): the Completion's `tokens`."""
        return {"prompt_ids": self.prompt_ids, "prompt_where": self.prompt_where,
                "completion_ids": self.completion_ids, "logprobs": self.logprobs, "logprob_ids": self.logprob_ids}


def kind_of(found: dict | None) -> str | None:
    """The dialect the probe's reply speaks, or None when it carries no ids."""
    if not found:
        return None
    if found["prompt_where"] is not None and found["completion_ids"] is not None:
        return found["prompt_where"]
    if found["logprob_ids"] and all(type(i) is int for i in found["logprob_ids"]):
        return LLAMA_CPP
    return None


def missing(found: dict | None) -> str:
    """What the probe's reply lacked, for the refusal's one line."""
    if not found or (found["completion_ids"] is None and not found["logprobs"]):
        return "no prompt_token_ids, no token_ids and no logprobs in its reply"
    if found["completion_ids"] is None:
        return "logprobs without token ids"
    return "completion token_ids but no prompt_token_ids"


def _ids(value, what: str) -> list[int]:
    # map(type) and min run in C: a 1,000-token reply's ids are checked in microseconds (bench/token_ids.py)
    if not isinstance(value, list) or not set(map(type, value)) <= {int} or (value and min(value) < 0):
        raise MalformedResponse(f"the reply's {what} are {'missing' if value is None else 'not token ids'}"
                                f"{'' if value is None else ': ' + str(value)[:200]} (--token_ids)")
    return value


def checked(found: dict | None, usage: dict) -> dict:
    """A reply's ids as a row keeps them, or MalformedResponse (the prompt fails and is asked again
    on resume, never written with wrong ids): ids missing, not ids, or logprobs of another length."""
    if found is None:
        raise MalformedResponse("the reply carries no token ids (--token_ids)", usage)
    try:
        prompt = _ids(found["prompt_ids"], "prompt ids")
        if found["completion_ids"] is not None:
            completion, source = _ids(found["completion_ids"], "completion token_ids"), "server"
        else:
            completion, source = _ids(found["logprob_ids"] or None, "logprob ids"), "logprob_ids"
        logprobs = found["logprobs"]
        if len(logprobs) != len(completion):
            raise MalformedResponse(f"the reply has {len(completion)} completion ids but {len(logprobs)} logprobs "
                                    "(--token_ids)")
        if not set(map(type, logprobs)) <= {float, int}:
            raise MalformedResponse(f"the reply's logprobs are not numbers: {str(logprobs)[:200]} (--token_ids)")
    except MalformedResponse as e:
        raise MalformedResponse(str(e), usage) from None
    return {"prompt_ids": prompt, "prompt_source": "server", "completion_ids": completion,
            "completion_source": source, "completion_logprobs": logprobs}


class Retokenizing:
    """A prompt's model whose replies also carry the ids --tokenizer gives each request and reply:
    beside the server's (`retokenized`, so the drift can be counted), or, from a server without ids,
    as the turn's only ids, marked `retokenized` and never mixed with exact ones."""

    def __init__(self, model, tok) -> None:
        self.model, self.tok = model, tok

    async def complete(self, messages: list[dict], tools: list[dict], forbid_tools: bool):
        from trajgen import tokenizer  # transformers: only with --tokenizer

        reply = await self.model.complete(messages, tools, forbid_tools)
        prompt = tokenizer.render(self.tok, messages, tools)
        completion = tokenizer.completion(self.tok, messages, tools, {"role": "assistant", **reply.message})
        if reply.tokens is not None:
            return replace(reply, tokens={**reply.tokens, "retokenized": {"prompt_ids": prompt,
                                                                          "completion_ids": completion}})
        return replace(reply, tokens={"prompt_ids": prompt, "prompt_source": "retokenized",
                                      "completion_ids": completion, "completion_source": "retokenized",
                                      "completion_logprobs": None})

def drifted(tokens: dict) -> bool:
    """The server's ids and the tokenizer's differ for this turn."""
    again = tokens.get("retokenized")
    return again is not None and (again["prompt_ids"] != tokens["prompt_ids"]
                                  or again["completion_ids"] != tokens["completion_ids"])


def turn_tokens(tokens: dict, finish_reason: object, sampling: dict) -> dict:
    """A gpt turn's `tokens` in the row (the order docs/token_ids.md shows)."""
    turn = {key: tokens[key] for key in ("prompt_ids", "prompt_source", "completion_ids", "completion_source",
                                         "completion_logprobs")}
    turn |= {"finish_reason": finish_reason, "sampling": sampling}
    return turn | {"retokenized": tokens["retokenized"]} if "retokenized" in tokens else turn


def row_metadata(dialect: Dialect | None, tok, turns: list[dict]) -> dict:
    """The row's `metadata.token_ids`; `samples` and `breaks` are trajgen/samples.py's to add."""
    return {"server": dialect.as_row() if dialect else {"kind": "none", "version": None},
            "tokenizer": tok.as_row() if tok is not None else None,
            "logprob_mode": "server" if dialect else "none",
            "drift_turns": sum(drifted(t) for t in turns)}
