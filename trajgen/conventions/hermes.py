"""--export=hermes: the seed's row format, self-contained Hermes text. The system turn carries the
`<tools>` list, gpt turns their `<think>` block and `<tool_call>` envelopes, tool turns their
`<tool_response>` envelopes (trajgen/trajectory.py): for templates that render role and content only."""
from __future__ import annotations

from trajgen.trajectory import hermes_system

FILE = "export_hermes.jsonl"


def record(row: dict) -> dict:
    """The row with its system turn in the Hermes form: the `<tools>` list makes the text self-contained."""
    turns = row["conversations"]
    if not row["tools"]:  # nothing was offered, so the requests listed nothing
        return row
    system = turns[0]["value"] if turns[0]["from"] == "system" else ""
    head = {"from": "system", "value": hermes_system(system, row["tools"])}
    return {**row, "conversations": [head, *turns[1 if system else 0:]]}


def next_steps(path: str) -> list[str]:
    return ["Hermes text: map from human/gpt/tool to user/assistant/tool and train on role and content only;",
            "for TRL or LLaMA-Factory prefer --export=hf or --export=sharegpt (docs/exports.md)"]
