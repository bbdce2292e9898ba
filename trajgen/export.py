"""Exports of a finished run for the training frameworks, streamed from trajectories.jsonl.

Every export is built from the structured parts each row keeps (`message`, `reasoning`,
`tools`), never by parsing a rendered `value` back.

- sharegpt: the rows, the system turn in the Hermes form with the `<tools>` list, `tools` as a
  field, and a `provenance` object.
- openai: `messages` exactly as the model received them plus its last reply, and `tools`: what
  TRL's SFT trainer takes.
- parquet: one row per trajectory; conversations as a list of {from, value}; messages, tools,
  settings and metadata as JSON text so the schema never depends on which tools a model called.

Every record carries its verify outcome and a `reward` (trajgen/verify.py REWARD: 1 passed, 0
failed or timed out, null when nothing was judged: an error of the check, or no check), and
`outcomes` selects the rows to export by verdict.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterator

import jsonlines
import orjson

from trajgen import store, verify
from trajgen.errors import UsageError
from trajgen.options import PROVENANCE_SETTINGS, as_list
from trajgen.trajectory import FORMAT_VERSION, hermes_system

FORMATS = ("sharegpt", "openai", "parquet")
VERDICTS = tuple(v.value for v in verify.Verdict)


def outcomes(flag) -> frozenset[str] | None:
    """--export_outcome as the verdicts to export (None: all)."""
    chosen = as_list(flag)
    unknown = [v for v in chosen if v not in VERDICTS]
    if unknown:
        raise UsageError(f"--export_outcome must be a comma list of {', '.join(VERDICTS)}; got {', '.join(unknown)}")
    return frozenset(chosen) or None


def outcome(row: dict) -> dict:
    """The row's verify object (an unverified one for rows written before verification) and its reward."""
    check = row.get("verify") or verify.UNVERIFIED.as_row()
    return {"verify": check, "reward": verify.REWARD.get(verify.Verdict(check["status"]))}


def provenance(row: dict, manifest: dict) -> dict:
    meta = row["metadata"]
    return {
        "run_name": manifest.get("run_name"), "model": meta.get("model"), "prompt_key": meta.get("prompt_key"),
        "dataset_id": meta.get("id"), "prompt_index": row["prompt_index"],
        "group_id": meta.get("group_id") or meta.get("prompt_key"), "sample_index": meta.get("sample_index", 0),
        "toolsets_sampled": meta.get("toolsets_sampled"), "toolsets_offered": meta.get("toolsets_offered"),
        "settings": {k: manifest.get(k) for k in PROVENANCE_SETTINGS},
        "request": meta.get("request"), "dataset": meta.get("dataset"),
    }


def to_openai(row: dict) -> list[dict]:
    """The messages of the last request, as sent, then the last reply; each assistant message
    also has the reasoning the model produced with it as `reasoning_content` (never sent back)."""
    return [{**turn["message"], "reasoning_content": turn["reasoning"]} if turn.get("reasoning") else turn["message"]
            for turn in row["conversations"]]


def to_sharegpt(row: dict) -> dict:
    """The row with its system turn in the Hermes form: the `<tools>` list makes the text self-contained."""
    turns = row["conversations"]
    if not row["tools"]:  # nothing was offered, so the requests listed nothing
        return row
    system = turns[0]["value"] if turns[0]["from"] == "system" else ""
    head = {"from": "system", "value": hermes_system(system, row["tools"])}
    return {**row, "conversations": [head, *turns[1 if system else 0:]]}


def _records(run_dir: Path, fmt: str, selected: frozenset[str] | None) -> Iterator[dict]:
    manifest = store.read_json(run_dir / "manifest.json")
    torn: list[str] = []
    for row in store.read_records(run_dir / "trajectories.jsonl", torn):
        version = row["metadata"].get("format_version")
        if version != FORMAT_VERSION:
            raise UsageError(f"{run_dir}/trajectories.jsonl: prompt {row['prompt_index']} has row format {version}, "
                             f"exports need {FORMAT_VERSION} (run it again with a new --run_name)")
        if selected is not None and verify.status(row) not in selected:
            continue
        origin, result = provenance(row, manifest), outcome(row)
        if fmt == "sharegpt":
            yield {**to_sharegpt(row), **result, "provenance": origin}
        elif fmt == "openai":
            yield {"messages": to_openai(row), "tools": row["tools"], **result, "provenance": origin}
        else:
            yield {
                "conversations": [{"from": t["from"], "value": t["value"]} for t in row["conversations"]],
                "tool_calls": orjson.dumps([t.get("tool_calls") for t in row["conversations"]]).decode(),
                "messages": orjson.dumps(to_openai(row)).decode(), "tools": orjson.dumps(row["tools"]).decode(),
                "completed": row["completed"], "api_calls": row["api_calls"],
                **{k: v for k, v in origin.items() if k not in ("settings", "request", "dataset")},
                "settings": orjson.dumps(origin["settings"]).decode(),
                "metadata": orjson.dumps(row["metadata"]).decode(),
                "verify_status": result["verify"]["status"], "reward": result["reward"],
                "verify": orjson.dumps(result["verify"]).decode(),
            }


def target(run_dir: Path, fmt: str) -> Path:
    return run_dir / ("export.parquet" if fmt == "parquet" else f"export_{fmt}.jsonl")


def stale(run_dir: Path) -> list[Path]:
    """The exports written before trajectories.jsonl last changed (a merge after a resume)."""
    try:
        merged = (run_dir / "trajectories.jsonl").stat().st_mtime_ns
    except FileNotFoundError:
        return []
    return [path for fmt in FORMATS if (path := target(run_dir, fmt)).exists() and path.stat().st_mtime_ns < merged]


def export(run_dir: Path, fmt: str, selected: frozenset[str] | None = None) -> tuple[Path, int]:
    """Write `export_<fmt>.jsonl` (or `export.parquet`) beside the run's files, atomically;
    `selected`: only rows with these verdicts."""
    if not (run_dir / "trajectories.jsonl").exists():
        raise FileNotFoundError(f"{run_dir}/trajectories.jsonl: no finished run to export")
    path = target(run_dir, fmt)
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=f".{path.name}.")
    os.close(fd)
    try:
        count = _write_parquet(run_dir, tmp, selected) if fmt == "parquet" else _write_jsonl(run_dir, fmt, tmp, selected)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path, count


def _write_jsonl(run_dir: Path, fmt: str, tmp: str, selected: frozenset[str] | None) -> int:
    count = 0
    with jsonlines.open(tmp, mode="w", dumps=lambda record: orjson.dumps(record).decode()) as out:
        for record in _records(run_dir, fmt, selected):
            out.write(record)
            count += 1
    return count


def _write_parquet(run_dir: Path, tmp: str, selected: frozenset[str] | None, chunk: int = 1000) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([
        ("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))),
        ("tool_calls", pa.string()), ("messages", pa.string()), ("tools", pa.string()), ("completed", pa.bool_()), ("api_calls", pa.int64()),
        ("run_name", pa.string()), ("model", pa.string()), ("prompt_key", pa.string()), ("dataset_id", pa.string()),
        ("prompt_index", pa.int64()), ("group_id", pa.string()), ("sample_index", pa.int64()), ("toolsets_sampled", pa.list_(pa.string())),
        ("toolsets_offered", pa.list_(pa.string())), ("settings", pa.string()), ("metadata", pa.string()),
        ("verify_status", pa.string()), ("reward", pa.float64()), ("verify", pa.string()),
    ])
    count = 0
    with pq.ParquetWriter(tmp, schema) as writer:
        batch: list[dict] = []
        for record in _records(run_dir, "parquet", selected):
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
