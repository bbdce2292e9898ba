"""--export=sharegpt: LLaMA-Factory's sharegpt convention with its default tags, so that its
`dataset_info.json` entry needs no `tags`: `human` and `observation` turns at odd positions, `gpt`
and `function_call` turns at even ones, the tools as a JSON text column.

Written for LLaMA-Factory 0.9.5's FunctionFormatter (src/llamafactory/data/formatter.py): a
`function_call` turn is `<think>\\nREASONING\\n</think>\\n\\nTEXT\\n<tool_call>[calls]</tool_call>`; it takes the
first `<tool_call>…</tool_call>` as the calls and keeps the rest as written, so the text beside the
calls survives, and `<` inside the calls' JSON is written `\\u003c`, which its JSON reader gives back
as `<`. A call turn whose reasoning or text holds a literal `<tool_call>` cannot be carried (that
would be read as the calls): its row is left out. Reasoning, inline `<think>` blocks included, takes
the default templates' one thinking form. The results of one turn's calls are one `observation`,
joined as LLaMA-Factory's own converter of OpenAI messages joins them; the forced final-answer
request, which follows tool results, ends that observation (a `human` turn there would break the
alternation and the row would be skipped)."""
from __future__ import annotations

import json
from pathlib import Path

import orjson
import yaml

from trajgen.conventions import MODEL, NotCarried, hf
from trajgen.trajectory import envelope_json, split_reasoning

FILE = "export_sharegpt.jsonl"
DATASET_INFO_FILE = "dataset_info.json"
CONFIG_FILE = "llamafactory.yaml"
NAME = "trajgen"  # the dataset's name in dataset_info.json
RESULTS_JOINER = "\n</tool_response>\n<tool_response>\n"  # LLaMA-Factory's OpenAIDatasetConverter
THOUGHT = ("<think>\n", "\n</think>\n\n")  # LLaMA-Factory's default thought_words
TOOL_CALL = ("<tool_call>", "</tool_call>")  # its default tool_call_words
DATASET_INFO = {"formatting": "sharegpt", "columns": {"messages": "conversations", "tools": "tools"}}
TAG_IN_CALL_TURN = NotCarried("a call turn's reasoning or text holds a literal <tool_call>, which LLaMA-Factory "
                              "would read as the calls")


def _reasoning_and_text(message: dict) -> tuple[str, str]:
    """The turn's reasoning and text; inline reasoning blocks count only where the reply had no reasoning
    field (as Qwen3's template reads an assistant turn)."""
    if message.get("reasoning_content"):
        return message["reasoning_content"], message.get("content") or ""
    return split_reasoning({"content": message.get("content")})


def _said(reasoning: str, text: str) -> str:
    """The turn's reasoning in the one thinking form, then its text."""
    return f"{THOUGHT[0]}{reasoning}{THOUGHT[1]}{text}" if reasoning else text


def _call_turn(message: dict) -> str | NotCarried:
    reasoning, text = _reasoning_and_text(message)
    said = _said(reasoning, text)
    if TOOL_CALL[0] in said:
        return TAG_IN_CALL_TURN
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message["tool_calls"]]
    beside = "\n" if text else ""  # as Qwen's templates write it: the text, a newline, the calls
    return f"{said}{beside}{TOOL_CALL[0]}{envelope_json(calls)}{TOOL_CALL[1]}"


def conversations(messages: list[dict]) -> list[dict] | NotCarried:
    turns: list[dict] = []
    results: list[str] = []
    for message in messages:
        role = message["role"]
        if role == "tool":
            results.append(message["content"])
            continue
        if results:
            turns.append({"from": "observation", "value": RESULTS_JOINER.join(results)})
            results = []
        if role == "system":
            turns.append({"from": "system", "value": message["content"]})
        elif role == "user" and turns and turns[-1]["from"] == "observation":
            turns[-1] = {"from": "observation", "value": f"{turns[-1]['value']}\n\n{message['content']}"}
        elif role == "user":
            turns.append({"from": "human", "value": message["content"]})
        elif message.get("tool_calls"):
            value = _call_turn(message)
            if isinstance(value, NotCarried):
                return value
            turns.append({"from": "function_call", "value": value})
        else:
            turns.append({"from": "gpt", "value": _said(*_reasoning_and_text(message))})
    return turns


def record(row: dict) -> dict | NotCarried:
    turns = conversations(hf.messages(row))
    if isinstance(turns, NotCarried):
        return turns
    return {"conversations": turns, "tools": orjson.dumps(row["tools"]).decode()}


def companions(path: Path) -> dict[str, str]:
    """The dataset_info.json that names the file, and a minimal training config that reads it."""
    config = {"model_name_or_path": MODEL, "stage": "sft", "do_train": True,
              "finetuning_type": "full", "dataset": NAME, "dataset_dir": str(path.parent), "template": "qwen3",
              "cutoff_len": 4096, "output_dir": str(path.parent / "llamafactory-out"),
              "per_device_train_batch_size": 1, "gradient_accumulation_steps": 8, "learning_rate": 1.0e-5,
              "num_train_epochs": 1.0, "logging_steps": 10, "save_strategy": "no", "report_to": "none"}
    return {DATASET_INFO_FILE: json.dumps({NAME: {"file_name": path.name, **DATASET_INFO}}, indent=2) + "\n",
            CONFIG_FILE: yaml.safe_dump(config, sort_keys=False)}  # YAML: LLaMA-Factory 0.9.5's JSON reader is broken


def next_steps(path: str) -> list[str]:
    folder = Path(path).parent
    return [f"LLaMA-Factory (docs/exports.md): {folder / DATASET_INFO_FILE} names the file as dataset {NAME!r};",
            f"{folder / CONFIG_FILE} trains {MODEL} on it (change model_name_or_path and template together):",
            f"  llamafactory-cli train {folder / CONFIG_FILE}"]
