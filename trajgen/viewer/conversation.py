"""One entry as the viewer shows it: the chat split into reasoning, text, tool calls and tool
results (from each turn's structured parts), with the record's metadata beside it.
A turn that does not parse is shown as its raw text."""
from __future__ import annotations

from itertools import islice
from pathlib import Path

import orjson

from trajgen import dataset, store, trajectory
from trajgen.merge import Filtering
from trajgen.viewer.index import FAILED, ROW, Entry
from trajgen.viewer.query import reason, status

ROW_FIELDS = ("completed", "partial", "api_calls", "toolsets_used")


def _episode(row: dict) -> dict:
    """With a simulated user: how the episode ended, shown beside the row's own fields."""
    episode = (row.get("metadata") or {}).get("episode") if isinstance(row.get("metadata"), dict) else None
    if not isinstance(episode, dict):
        return {}
    return {"episode ended": episode.get("ended"), "simulated user turns": episode.get("user_turns"),
            "simulated user": episode.get("user_model")}


def _turns(turns: list) -> list[dict]:
    """Each turn from its structured parts (`message`, `reasoning`, `tool_calls`); a turn without
    them (an older row format, a damaged row) is shown as its raw text."""
    names: dict[str, str] = {}  # call id -> tool name, for the results that follow
    shown = []
    for turn in turns:
        shown.append(_turn(turn, names))
        for call in shown[-1].get("calls", []):
            if isinstance(call, dict):
                names[str(call.get("id"))] = str(call.get("name"))
    return shown


def _turn(turn, names: dict[str, str]) -> dict:
    if not isinstance(turn, dict):
        return {"role": "unknown", "text": str(turn)}
    role, value, message = str(turn.get("from", "unknown")), turn.get("value"), turn.get("message")
    try:
        if role == "gpt" and isinstance(message, dict):
            reasoning, text = trajectory.split_reasoning({**message, "reasoning": turn.get("reasoning")})
            return {"role": role, "reasoning": reasoning, "text": text, "calls": turn.get("tool_calls") or []}
        if role == "tool" and isinstance(message, dict):
            call_id = message.get("tool_call_id")
            return {"role": role, "name": names.get(str(call_id)), "call_id": call_id,
                    "content": orjson.loads(message["content"])}
    except (ValueError, TypeError, KeyError, AttributeError):
        pass
    simulated = {"simulated": True} if role == "human" and turn.get("simulated") is True else {}
    return {"role": role, "text": value if isinstance(value, str) else str(value), **simulated}


def dataset_prompt(run_dir: Path, entry: Entry) -> str | None:
    """A failed prompt's text (failures.jsonl holds none), from the run's dataset file when it is
    still there and its line still hashes to the prompt's key."""
    try:
        path = store.read_json(run_dir / "manifest.json")["dataset"]["path"]
        with open(path, "rb") as f:
            raw = next(islice(f, entry.prompt_index, None), b"")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    parsed = dataset.parse_line(raw, entry.prompt_index or 0, str(path))
    if isinstance(parsed, str) or not str(entry.key).startswith(dataset.content_hash(parsed).hex() + "-"):
        return None
    return parsed.prompt


def view(entry: Entry, record: dict, filtering: Filtering, run_dir: Path) -> dict:
    """What /api/entry returns for one prompt."""
    row = record if entry.kind == ROW else record.get("row")
    row = row if isinstance(row, dict) else {}
    if entry.kind == FAILED and entry.prompt_index is not None and (prompt := dataset_prompt(run_dir, entry)):
        row = {"conversations": [{"from": "human", "value": prompt}]}
    extra = {k: v for k, v in record.items() if k != "row"} if entry.kind != ROW else {}
    tool_stats = row.get("tool_stats") if isinstance(row.get("tool_stats"), dict) else {}
    return {
        "key": entry.key, "status": status(entry, filtering), "reason": reason(entry, filtering),
        "prompt_index": entry.prompt_index,
        "source": {"file": entry.file, "line": entry.line, "offset": entry.offset},
        "record": extra,
        "turns": _turns(row.get("conversations") or []),
        "metadata": row.get("metadata"),
        "row": {**{k: row[k] for k in ROW_FIELDS if k in row}, **_episode(row)},
        "tool_stats": {n: s for n, s in tool_stats.items() if isinstance(s, dict) and s.get("count")},
        "tools": row.get("tools"),
    }
