"""--export=openai: the OpenAI fine-tuning API's chat format, uploadable as it is. Each line holds
only the API's keys: `messages`, the last request exactly as sent (tool-call `arguments` as JSON
text, the wire format) plus the last reply, and `tools`, the schemas sent with it. Our own keys
(outcome, provenance) go to a side file, one line per exported line, since the API refuses unknown keys."""
from __future__ import annotations

FILE = "export_openai.jsonl"
SIDE_FILE = "export_openai.provenance.jsonl"  # {"line": N, ...}: what the API would refuse beside its lines


def messages(row: dict) -> list[dict]:
    """The messages of the last request, as sent, then the last reply; each assistant message
    also has the reasoning the model produced with it as `reasoning_content` (never sent back)."""
    return [{**turn["message"], "reasoning_content": turn["reasoning"]} if turn.get("reasoning") else turn["message"]
            for turn in row["conversations"]]


def record(row: dict) -> dict:
    """The API's keys only: the reasoning is not part of its format, and tools only when some were sent."""
    sent = [turn["message"] for turn in row["conversations"]]
    return {"messages": sent, "tools": row["tools"]} if row["tools"] else {"messages": sent}


def next_steps(path: str) -> list[str]:
    return [f"the OpenAI fine-tuning API's chat format, ready to upload; our outcome and provenance per line: "
            f"{SIDE_FILE}",
            f"""  python -c 'from openai import OpenAI; print(OpenAI().files.create(file=open("{path}", "rb"), """
            """purpose="fine-tune").id)'"""]
