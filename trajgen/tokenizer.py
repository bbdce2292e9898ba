"""--tokenizer=NAME_OR_PATH: a Hugging Face tokenizer from a local path or the local cache (nothing
is downloaded at run time): its chat template renders each request as it was sent, for endpoints
that send no token ids (OpenAI, OpenRouter, llama-cpp-python), and it counts tokens exactly
(--compress, --context_budget).

transformers is imported only here and only when asked for: it costs every worker a second of
CPU and no run without --tokenizer needs it. It renders templates without torch.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

from trajgen.errors import UsageError


@dataclass(frozen=True)
class Tokenizer:
    name: str  # as given to --tokenizer
    revision: str | None  # the Hub commit it was cached from, when known
    chat_template_sha256: str | None
    tokenizer: object  # the loaded transformers tokenizer

    def as_row(self) -> dict:
        return {"name": self.name, "revision": self.revision, "chat_template_sha256": self.chat_template_sha256}


@functools.cache
def load(name_or_path: str) -> Tokenizer:
    """The tokenizer, once per process, or UsageError naming it (the job stops before any request). One
    without a chat template only counts (a run refuses it: trajgen/options.py)."""
    try:
        from transformers import AutoTokenizer
        loaded = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except ImportError as e:
        raise UsageError(f"--tokenizer={name_or_path} cannot be loaded: {e.name} is not installed "
                         "(pip install -e '.[tokenizer]')") from None
    except (OSError, ValueError, KeyError, TypeError) as e:  # what from_pretrained raises for a missing or bad one
        said = " ".join(str(e).split())[:300]
        raise UsageError(f"--tokenizer={name_or_path} cannot be loaded: {said}") from None
    template = loaded.chat_template if isinstance(loaded.chat_template, str) else None
    revision = loaded.init_kwargs.get("_commit_hash")
    return Tokenizer(name_or_path, revision if isinstance(revision, str) else None,
                     hashlib.sha256(template.encode()).hexdigest() if template else None, loaded)


def count(tok: Tokenizer, text: str) -> int:
    """Tokens of `text` alone, without special tokens."""
    return len(tok.tokenizer.encode(text, add_special_tokens=False))


def counts(tok: Tokenizer, texts: list[str]) -> list[int]:
    """`count` of each text, in one call of the tokenizer (a row's turns: a call per text costs more than
    the tokenizing)."""
    if not texts:
        return []
    encoded = tok.tokenizer(texts, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False)
    return [len(ids) for ids in encoded["input_ids"]]


def _rendered(tok: Tokenizer, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> list[int]:
    text = tok.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation_prompt,
                                             tokenize=False)
    return tok.tokenizer.encode(text, add_special_tokens=False)  # the template writes the special tokens itself


def render(tok: Tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The ids of a request's prompt: its messages and tools through the chat template, ready for the reply."""
    if tok.chat_template_sha256 is None:
        raise UsageError(f"--tokenizer={tok.name} has no chat template to render requests with")
    return _rendered(tok, messages, tools, True)


def completion(tok: Tokenizer, messages: list[dict], tools: list[dict] | None, reply: dict) -> list[int]:
    """The ids of `reply` as the template renders it after `messages`: the rendered conversation past
    the rendered prompt, or the reply's content alone where the template renders the prompt otherwise
    once a reply follows it."""
    prompt = render(tok, messages, tools)
    whole = _rendered(tok, [*messages, reply], tools, False)
    if whole[:len(prompt)] == prompt:
        return whole[len(prompt):]
    return tok.tokenizer.encode(reply.get("content") or "", add_special_tokens=False)
