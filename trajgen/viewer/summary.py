"""The run at a glance: the statistics of statistics.json, counted live from the index by the
merge's own Tally, plus the distributions only the rows hold (turns, tokens, toolsets).

For a finished run the numbers are statistics.json's: the same files, the same precedence, the
same code. While a run is still going (the files hold more than statistics.json says), the counts
are live and the durations are those of the last checkpoint.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from trajgen import merge, store
from trajgen.merge import Filtering
from trajgen.viewer.index import DISCARDED, FAILED, ROW, RunIndex
from trajgen.viewer.query import reason, status

HISTOGRAM_BINS = 20
NOT_KEPT_SHOWN = 1000  # rows of the report's table of prompts not kept; the viewer lists them all


@dataclass(frozen=True)
class Summary:
    stats: dict  # in statistics.json's format
    live: bool  # the files hold more than statistics.json: counts live, durations from the checkpoint
    turns: list[tuple[int, int, int]]  # histogram over kept rows: (low, high, rows)
    tokens: list[tuple[int, int, int]]
    toolsets: dict[str, tuple[int, int]]  # toolset -> (prompts that sampled it, prompts offered it)


def read_filtering(run_dir: Path, index: RunIndex) -> Filtering:
    """The run's filters, from what statistics.json reports: no filtered row although rows called tools
    that were not offered (--keep_hallucinated), rows filtered for having no reasoning (--require_reasoning)
    or for their verdict (--require_verified)."""
    saved = store.read_json_or_empty(run_dir / "statistics.json")
    hallucinated = any(h and tally.rows for (h, _, _), tally in index.tallies.rows.items())
    return Filtering(keep_hallucinated=saved.get("filtered_hallucinated") == 0 and hallucinated,
                     require_reasoning=bool(saved.get("filtered_no_reasoning")),
                     require_verified=bool(saved.get("filtered_not_passed")))


def histogram(values: list[int], bins: int = HISTOGRAM_BINS) -> list[tuple[int, int, int]]:
    """Integer bins of equal width from the smallest value to the largest: (low, high, count)."""
    if not values:
        return []
    low, high = min(values), max(values)
    width = max(1, math.ceil((high - low + 1) / bins))
    counts = Counter((v - low) // width for v in values)
    return [(low + i * width, low + (i + 1) * width - 1, counts[i]) for i in range((high - low) // width + 1)]


def summarize(index: RunIndex) -> Summary:
    run_dir = index.run_dir
    saved = store.read_json_or_empty(run_dir / "statistics.json")
    filters = read_filtering(run_dir, index)
    t = index.tallies
    entries = index.entries
    groups = {name: merge.Tally() for name in ("kept", "hallucinated", "no_reasoning", "not_passed")}
    for (hallucinated, reasoned, passed), tally in t.rows.items():
        group = filters.group(hallucinated, reasoned, passed)
        groups[group] = _together(groups[group], tally)
    merged = merge.Merged(
        **groups, discarded=t.discarded, verification=t.verification, rewards=t.rewards,
        discarded_by_reason=Counter(e.reason for e in entries if e.kind == DISCARDED),
        failed_by_class=Counter(e.reason for e in entries if e.kind == FAILED), failed_attempts=t.failed_attempts,
        batch_files=len(store.batch_files(run_dir)), duplicates_skipped=t.duplicates, torn=list(t.torn))
    counted = merge.statistics(merged, {})
    live = not saved or any(saved.get(k) != counted[k] for k in ("ok", "discarded", "failed"))
    stats = merge.statistics(merged, _live_header(run_dir, counted) if live else
                             {k: saved.get(k) for k in _HEADER})
    kept = [e for e in entries if e.kind == ROW and status(e, filters) == "ok"]
    sampled = Counter(name for e in entries for name in e.toolsets_sampled)
    offered = Counter(name for e in entries for name in e.toolsets_offered)
    return Summary(stats=stats, live=live,
                   turns=histogram([e.turns for e in kept]), tokens=histogram([e.tokens for e in kept]),
                   toolsets={name: (sampled[name], offered[name]) for name in sorted(sampled | offered)})


@dataclass(frozen=True)
class NotKept:
    """A prompt the run did not keep, for the report's table: failed, discarded or filtered, and why."""

    status: str
    prompt_index: int | None
    dataset_id: str | None
    reason: str | None
    preview: str


def not_kept(index: RunIndex) -> list[NotKept]:
    """Every prompt that has no row in trajectories.jsonl and was run, in prompt order."""
    filters = read_filtering(index.run_dir, index)
    found = sorted((e for e in index.entries if status(e, filters) != "ok"), key=lambda e: e.order)
    return [NotKept(status(e, filters), e.prompt_index, e.dataset_id, reason(e, filters), e.preview) for e in found]


def _together(a: merge.Tally, b: merge.Tally) -> merge.Tally:
    """One Tally of both groups, tools included (Tally's `+` leaves tools out)."""
    total = a + b
    for group in (a, b):
        for name, counts in group.tools.items():
            entry = total.tools.setdefault(name, {"count": 0, "success": 0, "failure": 0})
            for k in entry:
                entry[k] += counts[k]
    return total


_HEADER = ("run_name", "model", "distribution", "total_prompts", "samples_per_prompt", "batch_size", "remaining_not_run",
           "records_not_in_dataset", "invalid_lines_skipped", "duration_seconds", "duration_seconds_total")


def _live_header(run_dir: Path, counted: dict) -> dict:
    manifest = store.read_json_or_empty(run_dir / "manifest.json")
    dataset = manifest.get("dataset") if isinstance(manifest.get("dataset"), dict) else {}
    done = counted["ok"] + counted["discarded"]["total"] + counted["failed"]["total"]
    total = dataset.get("prompts") if isinstance(dataset.get("prompts"), int) else done
    seconds = store.read_json_or_empty(run_dir / "checkpoint.json").get("duration_seconds_total") or 0.0
    return {
        "run_name": manifest.get("run_name", run_dir.name), "model": manifest.get("model", "unknown"),
        "distribution": manifest.get("distribution"), "total_prompts": total,
        "batch_size": manifest.get("batch_size"), "remaining_not_run": max(0, total - done),
        "invalid_lines_skipped": dataset.get("invalid_lines_skipped", 0),
        "duration_seconds": seconds, "duration_seconds_total": seconds,
    }
