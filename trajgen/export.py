"""Exports of a finished run for the training frameworks, streamed from trajectories.jsonl.

- sharegpt: the rows as they are, one per line, with a `provenance` object added.
- openai: `messages` (role/content/tool_calls/tool_call_id), what TRL and most trainers take.
- parquet: one row per trajectory; conversations as a list of {from, value}, tool calls and
  metadata as JSON text so the schema never depends on which tools a model called.
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Iterator

import jsonlines
import orjson

from trajgen import store
from trajgen.options import PROVENANCE_SETTINGS
from trajgen.trajectory import ENVELOPE_TAGS

FORMATS = ("sharegpt", "openai", "parquet")
_THINK = re.compile(r"\A<think>\n(.*?)\n</think>(?:\n|\Z)", re.DOTALL)
_ESCAPED = re.compile(r"&lt;(/?(?:" + "|".join(ENVELOPE_TAGS) + r"))>")


def provenance(row: dict, manifest: dict) -> dict:
    meta = row["metadata"]
    return {
        "run_name": manifest.get("run_name"), "model": meta.get("model"), "prompt_key": meta.get("prompt_key"),
        "dataset_id": meta.get("id"), "prompt_index": row["prompt_index"],
        "toolsets_sampled": meta.get("toolsets_sampled"), "toolsets_offered": meta.get("toolsets_offered"),
        "settings": {k: manifest.get(k) for k in PROVENANCE_SETTINGS},
    }


def split_gpt_value(turn: dict) -> tuple[str, str]:
    """(reasoning, content) back out of a rendered gpt value: the calls are dropped (they are in
    `tool_calls`), the leading think block is split off, and escaped tags are restored."""
    value = turn["value"]
    for _ in turn.get("tool_calls") or []:
        value = value[: value.rindex("<tool_call>\n")].removesuffix("\n")
    reasoning = ""
    if match := _THINK.match(value):
        reasoning, value = match.group(1), value[match.end():]
    unescape = lambda text: _ESCAPED.sub(r"<\1>", text)  # noqa: E731
    return unescape(reasoning), unescape(value)


def tool_response(turn: dict) -> dict:
    return orjson.loads(turn["value"].removeprefix("<tool_response>\n").removesuffix("\n</tool_response>"))


def to_openai(row: dict) -> list[dict]:
    roles = {"system": "system", "human": "user"}
    messages: list[dict] = []
    for turn in row["conversations"]:
        if turn["from"] in roles:
            messages.append({"role": roles[turn["from"]], "content": turn["value"]})
        elif turn["from"] == "gpt":
            reasoning, content = split_gpt_value(turn)
            message: dict = {"role": "assistant", "content": content}
            if reasoning:
                message["reasoning_content"] = reasoning
            if turn.get("tool_calls"):
                message["tool_calls"] = [
                    {"id": c["id"], "type": "function",
                     "function": {"name": c["name"], "arguments": orjson.dumps(c["arguments"]).decode()}}
                    for c in turn["tool_calls"]]
            messages.append(message)
        else:
            response = tool_response(turn)
            messages.append({"role": "tool", "tool_call_id": response["tool_call_id"], "name": response["name"],
                             "content": orjson.dumps(response["content"]).decode()})
    return messages


def _records(run_dir: Path, fmt: str) -> Iterator[dict]:
    manifest = store.read_json(run_dir / "manifest.json")
    torn: list[str] = []
    for row in store.read_records(run_dir / "trajectories.jsonl", torn):
        origin = provenance(row, manifest)
        if fmt == "sharegpt":
            yield {**row, "provenance": origin}
        elif fmt == "openai":
            yield {"messages": to_openai(row), "provenance": origin}
        else:
            yield {
                "conversations": [{"from": t["from"], "value": t["value"]} for t in row["conversations"]],
                "tool_calls": orjson.dumps([t.get("tool_calls") for t in row["conversations"]]).decode(),
                "completed": row["completed"], "api_calls": row["api_calls"],
                **{k: v for k, v in origin.items() if k != "settings"},
                "settings": orjson.dumps(origin["settings"]).decode(),
                "metadata": orjson.dumps(row["metadata"]).decode(),
            }


def export(run_dir: Path, fmt: str) -> tuple[Path, int]:
    """Write `export_<fmt>.jsonl` (or `export.parquet`) beside the run's files, atomically."""
    if not (run_dir / "trajectories.jsonl").exists():
        raise FileNotFoundError(f"{run_dir}/trajectories.jsonl: no finished run to export")
    target = run_dir / ("export.parquet" if fmt == "parquet" else f"export_{fmt}.jsonl")
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=f".{target.name}.")
    os.close(fd)
    try:
        count = _write_parquet(run_dir, tmp) if fmt == "parquet" else _write_jsonl(run_dir, fmt, tmp)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    return target, count


def _write_jsonl(run_dir: Path, fmt: str, tmp: str) -> int:
    count = 0
    with jsonlines.open(tmp, mode="w", dumps=lambda record: orjson.dumps(record).decode()) as out:
        for record in _records(run_dir, fmt):
            out.write(record)
            count += 1
    return count


def _write_parquet(run_dir: Path, tmp: str, chunk: int = 1000) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([
        ("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))),
        ("tool_calls", pa.string()), ("completed", pa.bool_()), ("api_calls", pa.int64()),
        ("run_name", pa.string()), ("model", pa.string()), ("prompt_key", pa.string()), ("dataset_id", pa.string()),
        ("prompt_index", pa.int64()), ("toolsets_sampled", pa.list_(pa.string())),
        ("toolsets_offered", pa.list_(pa.string())), ("settings", pa.string()), ("metadata", pa.string()),
    ])
    count = 0
    with pq.ParquetWriter(tmp, schema) as writer:
        batch: list[dict] = []
        for record in _records(run_dir, "parquet"):
            if record["dataset_id"] is not None:
                record["dataset_id"] = str(record["dataset_id"])
            batch.append(record)
            if len(batch) == chunk:
                writer.write_table(pa.Table.from_pylist(batch, schema))
                count, batch = count + len(batch), []
        if batch:
            writer.write_table(pa.Table.from_pylist(batch, schema))
            count += len(batch)
    return count
