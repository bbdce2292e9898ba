"""--export=parquet: the hf records with native nested columns (lists of structs). What has no
fixed shape (call arguments, tool schemas, settings) is Arrow's JSON type: `datasets` gives it back
as objects, so rows are trainable without `json.loads`, and other readers see JSON text."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import orjson

from trajgen.conventions import hf

FILE = "export.parquet"
CHUNK = 1000  # records per row group


def _schema(json_type):
    """The export's schema, with `json_type` where the JSON type goes (rows are built with strings there)."""
    import pyarrow as pa

    call = pa.struct([("id", pa.string()), ("type", pa.string()),
                      ("function", pa.struct([("name", pa.string()), ("arguments", json_type)]))])
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string()),
                         ("tool_calls", pa.list_(call)), ("tool_call_id", pa.string()), ("name", pa.string())])
    verify = pa.struct([("status", pa.string()), ("command", pa.string()), ("exit_code", pa.int64()),
                        ("seconds", pa.float64()), ("output", pa.string()), ("error", pa.string()),
                        ("reward", pa.float64())])
    judge = pa.struct([("score", pa.float64()), ("reason", pa.string()), ("model", pa.string()),
                       ("rubric_sha256", pa.string())])
    group = pa.struct([("size", pa.int64()), ("reward_mean", pa.float64()), ("reward_std", pa.float64()),
                       ("advantage", pa.float64())])
    provenance = pa.struct([
        ("run_name", pa.string()), ("model", pa.string()), ("prompt_key", pa.string()), ("dataset_id", pa.string()),
        ("prompt_index", pa.int64()), ("group_id", pa.string()), ("sample_index", pa.int64()),
        ("toolsets_sampled", pa.list_(pa.string())), ("toolsets_offered", pa.list_(pa.string())),
        ("settings", json_type), ("request", json_type), ("dataset", json_type)])
    return pa.schema([("messages", pa.list_(message)), ("tools", pa.list_(json_type)), ("completed", pa.bool_()),
                      ("partial", pa.bool_()), ("verify", verify), ("reward", pa.float64()), ("judge", judge), ("judge_error", pa.string()),
                      ("group", group), ("provenance", provenance)])


def _json(value) -> str:
    return orjson.dumps(value).decode()


def _storage(record: dict) -> dict:
    """The record with its JSON-typed leaves as JSON text."""
    messages = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _json(c["function"]["arguments"])}}
                                     for c in m["tool_calls"]]} if m.get("tool_calls") else m
                for m in record["messages"]]
    origin = record["provenance"]
    dataset_id = origin["dataset_id"]
    return {**record, "messages": messages, "tools": [_json(t) for t in record["tools"]],
            "provenance": {**origin, "dataset_id": None if dataset_id is None else str(dataset_id),
                           **{k: _json(origin[k]) for k in ("settings", "request", "dataset")}}}


def write(path: str, records: Iterable[dict]) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    storage, schema = _schema(pa.string()), _schema(pa.json_())
    count = 0
    with pq.ParquetWriter(path, schema) as writer:
        batch: list[dict] = []
        for record in records:
            batch.append(_storage(record))
            if len(batch) == CHUNK:
                writer.write_table(pa.Table.from_pylist(batch, storage).cast(schema))
                count, batch = count + len(batch), []
        if batch:
            writer.write_table(pa.Table.from_pylist(batch, storage).cast(schema))
            count += len(batch)
    return count


def companions(path: Path) -> dict[str, str]:
    return hf.trl_companions()


def next_steps(path: str) -> list[str]:
    return hf.trl_steps(path)
