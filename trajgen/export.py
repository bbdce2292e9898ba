"""--export: a finished run's rows as one trainer convention (trajgen/conventions/), streamed from
trajectories.jsonl into a file beside it, written atomically.

Every record carries `completed` and `partial`, its verify outcome, its `reward` (trajgen/rewards.py:
by default the check's, 1 passed, 0 failed or timed out, a graded check's number, null when nothing
was judged), its `judge` and `group` where it has them, and `provenance`. `--export_outcome` selects
rows by verdict; partial rows (ended by the forced final-answer call) are left out unless
`--export_partial`, and so are rows the convention cannot carry (conventions.NotCarried). Beside the
file go what its trainer needs (a convention's `companions`) and, where the format has no room for
them, our keys (its `SIDE_FILE`). After writing, the export prints the command that trains on the
file, and what makes it incomplete or stale.
"""
from __future__ import annotations

import os
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import jsonlines
import orjson

from trajgen import rewards, store, verify
from trajgen.conventions import NotCarried, atropos, hermes, hf, openai, parquet, sharegpt, skyrl, verifiers
from trajgen.errors import UsageError
from trajgen.options import PROVENANCE_SETTINGS, as_list
from trajgen.suggest import did_you_mean
from trajgen.trajectory import FORMAT_VERSION

ROLLOUTS = {"skyrl": skyrl, "atropos": atropos, "verifiers": verifiers}  # token ids for RL trainers (docs/rl.md)
CONVENTIONS = {"hf": hf, "openai": openai, "sharegpt": sharegpt, "hermes": hermes, "parquet": parquet, **ROLLOUTS}
FORMATS = tuple(CONVENTIONS)
TRAINERS = {"trl": "hf", "axolotl": "hf", "llamafactory": "sharegpt", "prime_rl": "verifiers"}  # the format each trainer reads (docs/exports.md)
VERDICTS = tuple(v.value for v in verify.Verdict)
TRAJECTORIES = "trajectories.jsonl"
# the keys a record adds to its convention's (outcome(): judge, judge_error and group where a row has them)
OURS = ("completed", "partial", "verify", "reward", "judge", "judge_error", "group", "provenance")


@dataclass(frozen=True)
class Exported:
    path: Path
    rows: int
    partial_left_out: int
    not_carried: dict[str, int]  # reason -> rows the convention could not carry (conventions.NotCarried)


def outcomes(flag) -> frozenset[str] | None:
    """--export_outcome as the verdicts to export (None: all)."""
    chosen = as_list(flag)
    unknown = [v for v in chosen if v not in VERDICTS]
    if unknown:
        raise UsageError(f"--export_outcome must be a comma list of {', '.join(VERDICTS)}; got {', '.join(unknown)}"
                         + did_you_mean(unknown[0], VERDICTS))
    return frozenset(chosen) or None


def check_format(fmt: str | None) -> None:
    """UsageError unless `fmt` is an export format; a trainer's name suggests the format it reads."""
    if fmt not in FORMATS:
        raise UsageError(f"--export must be one of {', '.join(FORMATS)}, got {fmt!r}"
                         + did_you_mean(str(fmt), FORMATS, TRAINERS, "--export="))


def outcome(row: dict) -> dict:
    """The row's verify object (an unverified one for rows written before verification), its reward
    (trajgen/rewards.py), and its judgement and group where it has them."""
    check = row.get("verify") or verify.UNVERIFIED.as_row()
    return {"verify": check, "reward": rewards.reward_of(row),
            **{name: row[name] for name in ("judge", "judge_error", "group") if row.get(name) is not None}}


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


def _rows(run_dir: Path) -> Iterator[dict]:
    torn: list[str] = []
    for row in store.read_records(run_dir / TRAJECTORIES, torn):
        version = row["metadata"].get("format_version")
        if version != FORMAT_VERSION:
            raise UsageError(f"{run_dir}/{TRAJECTORIES}: prompt {row['prompt_index']} has row format {version}, "
                             f"exports need {FORMAT_VERSION} (run it again with a new --run_name)")
        yield row


def _records(run_dir: Path, fmt: str, selected: frozenset[str] | None, partial: bool, left_out: Counter) -> Iterator[dict]:
    """The records of the rows chosen; `left_out` counts the rows skipped: "partial", or a NotCarried."""
    if fmt in ROLLOUTS:  # lines per sample, prompt group or call: the trainer's own fields
        yield from ROLLOUTS[fmt].records(_chosen(run_dir, selected, partial, left_out))
        return
    manifest = store.read_json(run_dir / "manifest.json")
    convention = hf if fmt == "parquet" else CONVENTIONS[fmt]
    for row in _chosen(run_dir, selected, partial, left_out):
        made = convention.record(row)
        if isinstance(made, NotCarried):
            left_out[made] += 1
            continue
        yield {**made, "completed": row["completed"], "partial": row["partial"],
               **outcome(row), "provenance": provenance(row, manifest)}


def _chosen(run_dir: Path, selected: frozenset[str] | None, partial: bool, left_out: Counter) -> Iterator[dict]:
    for row in _rows(run_dir):
        if selected is not None and verify.status(row) not in selected:
            continue
        if row["partial"] and not partial:
            left_out["partial"] += 1
            continue
        yield row


def export(run_dir: Path, fmt: str, selected: frozenset[str] | None = None, partial: bool = False) -> Exported:
    """Write the format's file beside the run's files, and what its trainer needs beside it (each
    atomically); `selected`: only rows with these verdicts; `partial`: partial rows too."""
    if not (run_dir / TRAJECTORIES).exists():
        raise FileNotFoundError(f"{run_dir}/{TRAJECTORIES}: no finished run to export")
    convention = CONVENTIONS[fmt]
    target = run_dir / convention.FILE
    side = getattr(convention, "SIDE_FILE", None)  # where our keys go when the format cannot hold them
    tmp, side_tmp = _temporary(target), _temporary(run_dir / side) if side else None
    left_out: Counter = Counter()
    try:
        records = _records(run_dir, fmt, selected, partial, left_out)
        count = parquet.write(tmp, records) if fmt == "parquet" else _write_jsonl(tmp, records, side_tmp)
        if side_tmp:
            os.replace(side_tmp, run_dir / side)
        os.replace(tmp, target)
    except BaseException:
        for path in (tmp, side_tmp):
            if path and os.path.exists(path):
                os.unlink(path)
        raise
    companions = getattr(convention, "companions", None)
    for name, text in (companions(target.resolve()) if companions else {}).items():
        store.atomic_write(run_dir / name, text.encode())
    not_carried = {reason.reason: n for reason, n in left_out.items() if isinstance(reason, NotCarried)}
    return Exported(target, count, left_out["partial"], not_carried)


def _temporary(target: Path) -> str:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(fd)
    return tmp


def _write_jsonl(tmp: str, records: Iterable[dict], side_tmp: str | None = None) -> int:
    """The records as JSON lines; with `side_tmp`, our keys go there instead, a line per record with its number."""
    count = 0
    with jsonlines.open(tmp, mode="w", dumps=_dumps) as out, \
            jsonlines.open(side_tmp or os.devnull, mode="w", dumps=_dumps) as beside:
        for record in records:
            count += 1
            if side_tmp:
                beside.write({"line": count, **{key: record.pop(key) for key in OURS if key in record}})
            out.write(record)
    return count


def _dumps(record: dict) -> str:
    return orjson.dumps(record).decode()


def next_steps(exported: Exported, fmt: str) -> list[str]:
    """Which trainer takes the file, and the lines that load it."""
    return CONVENTIONS[fmt].next_steps(str(exported.path.resolve()))


def warnings(run_dir: Path, exported: Exported) -> list[str]:
    """What makes the export less than the run could give: rows left out, prompts failed or not yet
    run (statistics.json, as the last run's merge counted them), other exports older than the rows."""
    lines = []
    if exported.partial_left_out:
        lines.append(f"{exported.partial_left_out} partial row(s) left out (ended by the forced final-answer call): "
                     "--export_partial includes them")
    lines += [f"{n} row(s) left out: {reason}" for reason, n in exported.not_carried.items()]
    try:
        stats = store.read_json(run_dir / "statistics.json")
    except (FileNotFoundError, UsageError):
        stats = {}
    failed, pending = (stats.get("failed") or {}).get("total", 0), stats.get("remaining_not_run", 0)
    if failed or pending:
        lines.append(f"the run has {failed} failed and {pending} not yet run prompt(s): --resume runs them, then export again")
    lines += [f"{other.name} is older than {TRAJECTORIES}: export it again"
              for other in stale(run_dir) if other != exported.path]
    return lines


def stale(run_dir: Path) -> list[Path]:
    """The exports written before trajectories.jsonl last changed (a merge after a resume)."""
    try:
        merged = (run_dir / TRAJECTORIES).stat().st_mtime_ns
    except FileNotFoundError:
        return []
    return [path for convention in CONVENTIONS.values()
            if (path := run_dir / convention.FILE).exists() and path.stat().st_mtime_ns < merged]
