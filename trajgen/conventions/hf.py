"""--export=hf: the Hugging Face chat-template convention that TRL and axolotl read. The openai
messages with each call's `arguments` as an object (templates apply `tojson` to it: a string would
be encoded twice), each tool result named after its call, and `tools` as JSON schemas."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import yaml

from trajgen.conventions import MODEL, openai
from trajgen.trajectory import parse_arguments

FILE = "export_hf.jsonl"
TRL_SCRIPT = "train_trl.py"
TEMPLATE_FILE = "chat_template.jinja"  # TRL's qwen3_training.jinja: tools, calls, and {% generation %} markers
AXOLOTL_FILE = "axolotl.yaml"
_TRAINERS = resources.files("trajgen.conventions") / "trainers"


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


def trl_companions() -> dict[str, str]:
    """The TRL script and the chat template it trains with, to be written beside an export."""
    return {TRL_SCRIPT: (_TRAINERS / TRL_SCRIPT).read_text(),
            TEMPLATE_FILE: (_TRAINERS / "qwen3_training.jinja").read_text()}


def companions(path: Path) -> dict[str, str]:
    """TRL's script and template, and an axolotl config (its own qwen3 template, the loss on assistant turns)."""
    config = {"base_model": MODEL, "chat_template": "qwen3",
              "datasets": [{"path": str(path), "ds_type": "json", "type": "chat_template", "field_messages": "messages",
                            "field_tools": "tools", "roles_to_train": ["assistant"]}],
              "sequence_len": 4096, "micro_batch_size": 1, "gradient_accumulation_steps": 8, "num_epochs": 1,
              "learning_rate": 1.0e-5, "optimizer": "adamw_torch", "output_dir": str(path.parent / "axolotl-out")}
    return {**trl_companions(), AXOLOTL_FILE: yaml.safe_dump(config, sort_keys=False)}


def trl_steps(path: str) -> list[str]:
    """The command that trains on the export with the TRL script written beside it."""
    folder = Path(path).parent
    return [f"TRL's SFTTrainer (docs/exports.md): {TRL_SCRIPT} beside the file trains on it with {TEMPLATE_FILE},",
            "the loss on the assistant turns only:",
            f"  python {folder / TRL_SCRIPT} --model {MODEL} --data {path}"]


def next_steps(path: str) -> list[str]:
    return [*trl_steps(path), "axolotl:", f"  axolotl train {Path(path).parent / AXOLOTL_FILE}"]
