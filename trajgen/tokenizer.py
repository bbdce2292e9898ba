"""--tokenizer=NAME_OR_PATH: a Hugging Face tokenizer from a local path or the local cache (nothing
is downloaded at run time), to count tokens exactly (--compress, --context_budget) and to render a
request as its chat template would.

transformers is imported only here and only when asked for: it costs a second of CPU and no run
without --tokenizer needs it. It loads tokenizers and renders templates without torch.
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


@functools.cache
def load(name_or_path: str) -> Tokenizer:
    """The tokenizer, once per process, or UsageError naming it (the job stops before any request)."""
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


def render(tok: Tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The ids of a request's prompt: its messages and tools through the chat template, ready for the reply."""
    if tok.chat_template_sha256 is None:
        raise UsageError(f"--tokenizer={tok.name} has no chat template to render requests with")
    text = tok.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False)
    return tok.tokenizer.encode(text, add_special_tokens=False)  # the template writes the special tokens itself
