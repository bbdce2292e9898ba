"""--export=verifiers: one line per model call, a verifiers `TrajectoryStep` (verifiers 0.3.1,
verifiers/legacy/types.py) whose `tokens` are the call's ids as the server sent them: prompt masked
0, completion 1 (what prime-rl trains), its logprobs, and whether the token limit cut it. Messages
are in verifiers' own shape (a tool call is `{id, name, arguments}`); `response`, the raw reply
object, is null: the row keeps the message, not the reply."""
from __future__ import annotations

from typing import Iterable, Iterator

from trajgen.conventions import rollouts


FILE = "export_verifiers.jsonl"


def records(rows: Iterable[dict]) -> Iterator[dict]:
    for row in rows:
        reward, advantage, key = rollouts.reward(row), rollouts.advantage(row), row["metadata"]["prompt_key"]
        for turn, call in enumerate(rollouts.calls(row)):
            ids = call.tokens
            truncated = ids["finish_reason"] == "length"
            yield {"prompt": list(map(message, call.prompt)), "completion": [message(call.reply)], "response": None,
                   "tokens": {"prompt_ids": ids["prompt_ids"], "prompt_mask": [0] * len(ids["prompt_ids"]),
                              "completion_ids": ids["completion_ids"],
                              "completion_mask": [1] * len(ids["completion_ids"]),
                              "completion_logprobs": ids["completion_logprobs"], "overlong_prompt": False,
                              "is_truncated": truncated, "routed_experts": None},
                   "reward": reward, "advantage": advantage, "is_truncated": truncated, "trajectory_id": key,
                   "extras": {"turn": turn, "prompt_index": row["prompt_index"]}}


def message(sent: dict) -> dict:
    """An OpenAI message in verifiers' shape: tool calls flat."""
    if not sent.get("tool_calls"):
        return sent
    calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in sent["tool_calls"]]
    return {**sent, "tool_calls": calls}


def next_steps(path: str) -> list[str]:
    return ["verifiers / prime-rl (docs/rl.md): each line is one TrajectoryStep (one model call);",
            "  steps of a trajectory share trajectory_id, in order of extras.turn;",
            "  prime-rl merges them into samples by the extension property, as metadata.token_ids.samples records"]
