"""One module per trainer convention an export follows: each builds its part of a record from a
trajectory row's structured parts (`message`, `reasoning`, `tools`), never from a rendered `value`.

- openai: the OpenAI fine-tuning API's chat format (tool-call arguments as JSON text).
- hf: the Hugging Face chat-template convention TRL and axolotl read (arguments as objects).
- sharegpt: LLaMA-Factory's sharegpt convention with its default tags and a `tools` column.
- hermes: the seed's row format (Hermes text: a `<tools>` system turn, `<tool_call>` in gpt turns).
- parquet: the hf records with native nested columns.
- skyrl, atropos, verifiers: token ids for RL trainers, per sample, prompt group or model call
  (rollouts.py: what they share; docs/rl.md).

A convention's `record` returns `NotCarried` for a row it cannot carry whole; `companions` (where
defined) are the files its trainer needs beside the export (trainers/: the TRL script and template).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NotCarried:
    """A row the convention cannot carry whole: left out of the export and counted under `reason`."""
    reason: str


MODEL = "Qwen/Qwen3-0.6B"  # the model the written trainer configs name: its template renders tools, calls, reasoning
