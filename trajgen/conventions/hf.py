"""--export=hf: the Hugging Face chat-template convention that TRL and axolotl read. The openai
messages with each call's `arguments` as an object (templates apply `tojson` to it: a string would
be encoded twice), each tool result named after its call, and `tools` as JSON schemas."""
from __future__ import annotations

from trajgen.conventions import openai
from trajgen.trajectory import parse_arguments

FILE = "export_hf.jsonl"


def messages(row: dict) -> list[dict]:
    names: dict[str, str] = {}  # call id -> tool name, for the tool messages that answer the calls
    converted = []
    for message in openai.messages(row):
        if message.get("tool_calls"):
            calls = [{**call, "function": {"name": call["function"]["name"],
                                           "arguments": parse_arguments(call["function"]["arguments"])}}
                     for call in message["tool_calls"]]
            names.update((call["id"], call["function"]["name"]) for call in calls)
            message = {**message, "tool_calls": calls}
        elif message["role"] == "tool":
            message = {**message, "name": names[message["tool_call_id"]]}
        converted.append(message)
    return converted


def record(row: dict) -> dict:
    return {"messages": messages(row), "tools": row["tools"]}


def next_steps(path: str) -> list[str]:
    return ["TRL's SFTTrainer (docs/exports.md):",
            "  from datasets import load_dataset",
            "  from trl import SFTConfig, SFTTrainer",
            f'  dataset = load_dataset("json", data_files="{path}", split="train").select_columns(["messages", "tools"])',
            "  trainer = SFTTrainer(model=MODEL, train_dataset=dataset, args=SFTConfig(max_length=4096))"]
