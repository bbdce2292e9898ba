"""Finished runs compared prompt by prompt: per-run figures with 95% Wilson intervals and pass@k,
and per pair the paired table (both, only A, only B, neither) with the exact McNemar test.

Prompts are matched by prompt key (a hash of the task, the same in any dataset that holds it) and
samples by their group. Per-run figures are over the prompts every run holds, so they compare;
each pair is over the prompts both runs judged. Each run's samples are read through the viewer's
index, which applies the merge's precedence (a row beats a discard, which beats a failure).
"""
from __future__ import annotations

import math
import statistics as stats_module
from collections import Counter
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

from trajgen import merge, store, verify
from trajgen.errors import UsageError
from trajgen.trajectory import LATENCY_KEYS
from trajgen.verify import Verdict
from trajgen.viewer.index import DISCARDED, FAILED, ROW, Entry, RunIndex

Z95 = 1.959963984540054  # the standard normal's 97.5th percentile
JUDGED = (Verdict.PASSED.value, Verdict.FAILED.value, Verdict.TIMEOUT.value)
STATUS = {ROW: "ok", DISCARDED: "discarded", FAILED: "failed"}
SETTINGS = ("model", "temperature", "top_p", "max_tokens", "max_turns", "distribution", "seed",
            "toolsets_per_sample", "system_prompt")  # what makes two runs differ beyond their model's skill


@dataclass(frozen=True)
class Interval:
    low: float
    high: float


def wilson(passed: int, n: int, z: float = Z95) -> Interval | None:
    """The Wilson score interval of a proportion (honest near 0 and 1, unlike the normal one); None for n = 0."""
    if n == 0:
        return None
    p = passed / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return Interval(max(0.0, centre - half), min(1.0, centre + half))


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """The exact McNemar p-value: two-sided binomial test of the discordant pairs against p = 1/2."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(only_a, only_b) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


@dataclass(frozen=True)
class Sample:
    """One sample of a prompt as the comparison needs it."""

    key: str
    group: str  # the prompt's key: its samples share it
    status: str  # ok, discarded or failed
    verdict: str  # a Verdict's value; unverified for a failed sample
    reason: str | None
    assistant_turns: int
    turns_with_reasoning: int
    tool_calls: int
    tool_failures: int
    hallucinated_names: int
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    cost: float | None
    wall_seconds: float | None
    served_by: tuple[str, ...]
    file: str
    line: int
    preview: str


@dataclass(frozen=True)
class Run:
    path: Path
    manifest: dict
    statistics: dict
    groups: dict[str, list[Sample]]  # prompt key -> its samples
    index: RunIndex

    @property
    def label(self) -> str:
        return f"{self.manifest.get('model', '?')} ({self.path})"  # two runs may share a model and a name


def load(path: Path) -> Run:
    """A run directory's samples by prompt; UsageError where it holds no run."""
    if not (path / "manifest.json").is_file():
        raise UsageError(f"{path}: not a run directory (no manifest.json)")
    index = RunIndex(path)
    index.refresh()
    groups: dict[str, list[Sample]] = {}
    for entry in index.entries:
        if entry.key is None:
            continue
        found = _sample(entry, index.read(entry))
        groups.setdefault(found.group, []).append(found)
    for samples in groups.values():
        samples.sort(key=lambda s: int(s.key.partition("~")[2] or 0))  # sample 0 first
    return Run(path, store.read_json_or_empty(path / "manifest.json"), store.read_json_or_empty(path / merge.STATISTICS), groups, index)


def _sample(entry: Entry, record: dict) -> Sample:
    row = record if entry.kind == ROW else record.get("row")
    row = row if isinstance(row, dict) else {}
    meta = row.get("metadata") if isinstance(row.get("metadata"), dict) else {}
    usage = (meta.get("usage") if entry.kind != FAILED else record.get("usage")) or {}
    tools = [s for s in (row.get("tool_stats") or {}).values() if isinstance(s, dict)]
    served = (meta.get("request") or {}).get("served_by") or []
    return Sample(
        key=entry.key, group=str(entry.key).split("~")[0], status=STATUS[entry.kind],
        verdict=verify.status(row) if entry.kind != FAILED else Verdict.UNVERIFIED.value, reason=entry.reason,
        assistant_turns=int(meta.get("assistant_turns") or 0), turns_with_reasoning=int(meta.get("turns_with_reasoning") or 0),
        tool_calls=sum(int(s.get("count") or 0) for s in tools), tool_failures=sum(int(s.get("failure") or 0) for s in tools),
        hallucinated_names=len(meta.get("hallucinated_tools") or []),
        prompt_tokens=int(usage.get("prompt_tokens") or 0), completion_tokens=int(usage.get("completion_tokens") or 0),
        reasoning_tokens=int(usage.get("reasoning_tokens") or 0), cost=usage.get("cost"),
        wall_seconds=usage.get("wall_seconds"),
        served_by=tuple(sorted({" via ".join(str(s[k]) for k in ("model", "provider") if s.get(k))
                                for s in served if isinstance(s, dict)})),
        file=entry.file, line=entry.line, preview=entry.preview)


def passed(samples: list[Sample]) -> bool | None:
    """Whether a prompt passed (any judged sample passed); None where none was judged."""
    judged = [s for s in samples if s.verdict in JUDGED]
    return any(s.verdict == Verdict.PASSED.value for s in judged) if judged else None


def completed(samples: list[Sample]) -> bool:
    """Whether a prompt kept a row (what is left to compare where nothing was verified)."""
    return any(s.status == "ok" for s in samples)


def _rate(part: int, whole: int) -> dict:
    interval = wilson(part, whole)
    return {"passed": part, "of": whole, "rate": round(part / whole, 4) if whole else None,
            "ci95": [round(interval.low, 4), round(interval.high, 4)] if interval else None}


def run_figures(run: Run, keys: list[str]) -> dict:
    """The run's figures over the prompts `keys`."""
    samples = [s for k in keys for s in run.groups.get(k, [])]
    ran = [s for s in samples if s.status != "failed"]
    judged = [s for s in samples if s.verdict in JUDGED]
    verdicts = {k: passed(run.groups.get(k, [])) for k in keys}
    prompts_judged = [v for v in verdicts.values() if v is not None]
    at_k = Counter()
    counted = Counter()
    for k in keys:
        group = [s for s in run.groups.get(k, []) if s.verdict in JUDGED]
        wins = sum(s.verdict == Verdict.PASSED.value for s in group)
        for i in range(1, len(group) + 1):
            at_k[i] += merge.pass_at_k(len(group), wins, i)
            counted[i] += 1
    costs = [s.cost for s in samples if s.cost is not None]
    cost = round(sum(costs), 6) if costs else None
    prompts_passed = sum(prompts_judged)
    turns = sum(s.assistant_turns for s in ran)
    calls = sum(s.tool_calls for s in ran)
    walls = [s.wall_seconds for s in ran if isinstance(s.wall_seconds, (int, float))]
    return {
        "run_dir": str(run.path), "model": run.manifest.get("model"),
        "served_by": dict(Counter(name for s in ran for name in s.served_by)),
        "prompts": len(keys), "prompts_in_run": len(run.groups),
        "samples": dict(Counter(s.status for s in samples)) | {"total": len(samples)},
        "verdicts": dict(Counter(s.verdict for s in samples)),
        "pass_rate_prompts": _rate(prompts_passed, len(prompts_judged)),
        "pass_rate_samples": _rate(sum(s.verdict == Verdict.PASSED.value for s in judged), len(judged)),
        "pass_at_k": {str(i): {"rate": round(at_k[i] / counted[i], 4), "prompts": counted[i]} for i in sorted(counted)},
        "mean_turns": round(turns / len(ran), 3) if ran else None,
        "mean_tool_calls": round(calls / len(ran), 3) if ran else None,
        "tool_error_rate": round(sum(s.tool_failures for s in ran) / calls, 4) if calls else None,
        "hallucinated_tool_names": sum(s.hallucinated_names for s in ran),
        "samples_with_hallucinated_tools": sum(1 for s in ran if s.hallucinated_names),
        "reasoning_coverage": round(sum(s.turns_with_reasoning for s in ran) / turns, 4) if turns else None,
        "tokens": {"prompt": sum(s.prompt_tokens for s in samples), "completion": sum(s.completion_tokens for s in samples),
                   "reasoning": sum(s.reasoning_tokens for s in samples)},
        "cost": cost,
        "cost_per_passed_prompt": round(cost / prompts_passed, 6) if cost is not None and prompts_passed else None,
        "wall_seconds_total": run.statistics.get("duration_seconds_total"),
        "median_seconds_per_sample": round(stats_module.median(walls), 3) if walls else None,
        "latency": latency(run.statistics),
    }


def latency(statistics: dict) -> dict[str, dict] | None:
    """Seconds per reply (median, p95, over how many replies) to the first byte, to the first token
    and of generation, as the run's statistics.json holds them; None where the run measured none."""
    spreads = statistics.get("latency") if isinstance(statistics.get("latency"), dict) else {}
    found = {key: spread for key in LATENCY_KEYS
             if isinstance(spread := spreads.get(key), dict) and spread.get("replies")}
    return found or None


def pair_figures(a: Run, b: Run, names: tuple[int, int]) -> dict:
    """Both, only A, only B, neither over the prompts both runs hold: by verdict where both judged
    any, with the exact McNemar p-value; else by completion, with no p-value."""
    shared = sorted(a.groups.keys() & b.groups.keys())
    outcomes = [(k, passed(a.groups[k]), passed(b.groups[k])) for k in shared]
    judged = [(k, x, y) for k, x, y in outcomes if x is not None and y is not None]
    verified = bool(judged)
    pairs = judged if verified else [(k, completed(a.groups[k]), completed(b.groups[k])) for k in shared]
    table = Counter(("both" if y else "only_a") if x else ("only_b" if y else "neither") for _, x, y in pairs)
    counts = {name: table[name] for name in ("both", "only_a", "only_b", "neither")}
    return {
        "a": names[0], "b": names[1], "shared_prompts": len(shared),
        "outcome": "passed" if verified else "completed", "prompts_compared": len(pairs), **counts,
        "p_value": round(mcnemar_exact(counts["only_a"], counts["only_b"]), 6) if verified else None,
        "note": None if verified else "nothing was verified in both runs: compared on completion (a row kept), no test",
        "discordant": [_discordant(k, a, b, x) for k, x, y in pairs if x != y],
    }


def _discordant(key: str, a: Run, b: Run, a_won: bool) -> dict:
    return {"prompt_key": key, "preview": a.groups[key][0].preview or b.groups[key][0].preview,
            "solved_by": "a" if a_won else "b", "a": _where(a.groups[key]), "b": _where(b.groups[key])}


def _where(samples: list[Sample]) -> dict:
    """Where a run's record of the prompt is: its first passed sample, else its first sample."""
    sample = next((s for s in samples if s.verdict == Verdict.PASSED.value), samples[0])
    return {"key": sample.key, "status": sample.status, "verdict": sample.verdict, "file": sample.file, "line": sample.line}


def settings_that_differ(runs: list[Run]) -> dict[str, list]:
    """The settings (model, sampling, max_turns, toolsets, system prompt) that are not the same in every run."""
    values = {name: [run.manifest.get(name) for run in runs] for name in SETTINGS}
    return {name: found for name, found in values.items() if len(set(map(repr, found))) > 1}


def compare(paths: list[Path]) -> tuple[dict, list[Run]]:
    """comparison.json (the runs, their shared prompts, per-run and per-pair figures) and the runs read."""
    if len(paths) < 2:
        raise UsageError("--compare needs two or more run directories, comma-separated")
    runs = [load(p) for p in paths]
    shared = sorted(set.intersection(*(set(r.groups) for r in runs)))
    differ = settings_that_differ(runs)
    warnings = [f"{name} differs: " + ", ".join(f"{r.label}: {v!r}" for r, v in zip(runs, values))
                for name, values in differ.items() if name != "model"]
    samples = [max(map(len, r.groups.values()), default=0) for r in runs]
    if len(set(samples)) > 1:
        warnings.append("samples per prompt differ (" + ", ".join(f"{r.label}: {n}" for r, n in zip(runs, samples))
                        + "): a prompt passes if any of its samples passed, so more samples mean more chances")
    if any(len(r.groups) != len(shared) for r in runs):
        warnings.append(f"the runs share {len(shared)} prompts of " + ", ".join(f"{len(r.groups)}" for r in runs)
                        + ": every figure is over the shared ones")
    return {
        "format_version": 1,
        "runs": [run_figures(r, shared) for r in runs],
        "shared_prompts": len(shared),
        "settings_that_differ": differ,
        "warnings": warnings,
        "pairs": [pair_figures(runs[i], runs[j], (i, j)) for i, j in combinations(range(len(runs)), 2)],
    }, runs
