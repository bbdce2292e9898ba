"""A Hugging Face tokenizer built in the test's own directory (the `tokenizers` library), so that
--tokenizer is tested with nothing downloaded: every word and every run of punctuation is one token."""
from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build(directory: Path) -> Path:
    """A word-level tokenizer saved under `directory`, loadable by AutoTokenizer from that path."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "<|end|>": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return directory
