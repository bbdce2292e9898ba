"""--export=openai: the OpenAI fine-tuning API's chat format. `messages` are the last request
exactly as sent (tool-call `arguments` as JSON text, the wire format) plus the last reply, and
`tools` the schemas sent with it."""
from __future__ import annotations

FILE = "export_openai.jsonl"


def messages(row: dict) -> list[dict]:
    """The messages of the last request, as sent, then the last reply; each assistant message
    also has the reasoning the model produced with it as `reasoning_content` (never sent back)."""
    return [{**turn["message"], "reasoning_content": turn["reasoning"]} if turn.get("reasoning") else turn["message"]
            for turn in row["conversations"]]


def record(row: dict) -> dict:
    return {"messages": messages(row), "tools": row["tools"]}


def next_steps(path: str) -> list[str]:
    return ["the OpenAI fine-tuning API's format; upload only its keys:",
            f"  jq -c '{{messages: [.messages[] | del(.reasoning_content)], tools}}' {path} > upload.jsonl"]
