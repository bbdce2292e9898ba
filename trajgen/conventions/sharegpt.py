"""--export=sharegpt: LLaMA-Factory's sharegpt convention with its default tags, so that its
`dataset_info.json` entry needs no `tags`: `human` and `observation` turns at odd positions, `gpt`
and `function_call` turns at even ones, the tools as a JSON text column.

Every text is what the model saw or wrote, unescaped. Reasoning leads its turn as a `<think>`
block (what LLaMA-Factory strips or keeps per template). A `function_call` turn holds the calls as
JSON, which is all LLaMA-Factory reads there: text the model wrote beside its calls is not in it.
The results of one turn's calls are one `observation`, joined as LLaMA-Factory's own converter of
OpenAI messages joins them; the forced final-answer request, which follows tool results, ends that
observation (a `human` turn there would break the alternation and the row would be skipped)."""
from __future__ import annotations

import json

import orjson

from trajgen.conventions import hf

FILE = "export_sharegpt.jsonl"
RESULTS_JOINER = "\n</tool_response>\n<tool_response>\n"  # LLaMA-Factory's OpenAIDatasetConverter
DATASET_INFO = {"formatting": "sharegpt", "columns": {"messages": "conversations", "tools": "tools"}}


def _thought(message: dict) -> str:
    reasoning = message.get("reasoning_content")
    return f"<think>\n{reasoning}\n</think>\n\n" if reasoning else ""


def conversations(messages: list[dict]) -> list[dict]:
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
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message["tool_calls"]]
            turns.append({"from": "function_call", "value": _thought(message) + json.dumps(calls, ensure_ascii=False)})
        else:
            turns.append({"from": "gpt", "value": _thought(message) + message["content"]})
    return turns


def record(row: dict) -> dict:
    return {"conversations": conversations(hf.messages(row)), "tools": orjson.dumps(row["tools"]).decode()}


def next_steps(path: str) -> list[str]:
    entry = json.dumps({"trajgen": {"file_name": path, **DATASET_INFO}})
    return ["LLaMA-Factory (docs/exports.md): in the dataset_info.json of your dataset_dir,",
            f"  {entry}",
            "  then llamafactory-cli train with dataset: trajgen, stage: sft, and a template that renders tools (e.g. qwen)"]
