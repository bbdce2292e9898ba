"""Run by a venv's python that has torch and transformers: a tiny causal LM with random weights in a folder,
for training tests that must not reach the Hub.

`python tiny_model.py OUT TEXT_FILE` trains a byte-level BPE tokenizer (any text has a
tokenization) on TEXT_FILE with the ChatML special tokens Qwen's templates write, and saves it with a
one-layer Qwen3 model sized to it.
"""
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def main(out: str, text_file: str) -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(Path(text_file).read_text().splitlines(), trainers.BpeTrainer(
        vocab_size=4000, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out)
    config = Qwen3Config(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=8192,
                         eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)


if __name__ == "__main__":
    main(*sys.argv[1:])
