"""The final merge and the statistics, in one streaming pass over the whole run directory.

Everything is counted from the files (old and resumed batches alike), so statistics.json
always agrees with trajectories.jsonl, the batch files and the side records. When none of
them changed since the last merge (a resume of a finished run), its counts are reused.
"""
from __future__ import annotations

import hashlib
import math
import os
import tempfile
from array import array
from collections import Counter
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Iterable

import orjson

from trajgen import rewards, store, verify
from trajgen.model import UNKNOWN
from trajgen.samples import Cause
from trajgen.trajectory import LATENCY_KEYS, tool_stat
from trajgen.verify import Verdict

COUNTS_VERSION = 4  # of what statistics() counts: a change makes every run directory merge again
STATISTICS = "statistics.json"
TRAJECTORIES = "trajectories.jsonl"


@dataclass
class Tally:
    """Tool, reasoning, usage and turn counts over a group of rows."""

    rows: int = 0
    tools: dict[str, dict[str, int]] = field(default_factory=dict)
    assistant_turns: int = 0
    turns_with_reasoning: int = 0
    api_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cost: float | None = None
    replies_without_usage: int = 0  # their tokens are unknown, and so are the totals
    stalls: int = 0  # calls abandoned for silence (--stall_timeout) and asked again
    rows_with_ids: int = 0  # rows with token ids (--token_ids, --tokenizer)
    drift_turns: int = 0  # their turns whose retokenized ids differ from the server's
    latency: dict[str, Counter] = field(default_factory=lambda: {k: Counter() for k in LATENCY_KEYS})  # bin -> replies
    side: dict[str, "Tally"] = field(default_factory=dict)  # role -> what its side model paid (trajgen/roles.py)
    episodes: Counter = field(default_factory=Counter)  # a simulated user's episodes by how they ended
    user_turns: int = 0  # the simulated human turns of those episodes
    compactions: int = 0  # --context_budget's (trajgen/context_budget.py)

    def add(self, row: dict) -> None:
        self.rows += 1
        for name, s in (row.get("tool_stats") or {}).items():
            entry = self.tools.get(name) or self.tools.setdefault(name, tool_stat())
            if s.get("count"):  # most of a row's tools were not called: nothing to add
                for k in entry:
                    entry[k] += s.get(k, 0)
        meta = row.get("metadata") or {}
        self.assistant_turns += meta.get("assistant_turns", 0)
        self.turns_with_reasoning += meta.get("turns_with_reasoning", 0)
        self.api_calls += row.get("api_calls", 0)
        self.add_usage(meta.get("usage") or {})
        if isinstance(ids := meta.get("token_ids"), dict):
            self.rows_with_ids += 1
            self.drift_turns += ids.get("drift_turns", 0)
        for key, values in (meta.get("latency") or {}).items():
            if key in self.latency:
                self.latency[key].update(map(_bin, values))
        for role, usage in (meta.get("side_usage") or {}).items():
            side = self.side.setdefault(role, Tally())
            side.rows += 1
            side.api_calls += usage.get("api_calls", 0)
            side.add_usage(usage)
        if episode := meta.get("episode"):
            self.episodes[episode.get("ended")] += 1
            self.user_turns += episode.get("user_turns", 0)
        self.compactions += len(meta.get("compactions") or ())

    def add_usage(self, usage: dict) -> None:
        self.prompt_tokens += usage.get("prompt_tokens", 0)
        self.completion_tokens += usage.get("completion_tokens", 0)
        self.reasoning_tokens += usage.get("reasoning_tokens", 0)
        self.replies_without_usage += usage.get(UNKNOWN, 0)
        self.stalls += usage.get("stalls", 0)
        if usage.get("cost") is not None:
            self.cost = (self.cost or 0.0) + usage["cost"]

    def __add__(self, other: "Tally") -> "Tally":
        """Totals of counters only (tools stay per group)."""
        total = Tally()
        for name in ("rows", "assistant_turns", "turns_with_reasoning", "api_calls",
                     "prompt_tokens", "completion_tokens", "reasoning_tokens", "replies_without_usage", "stalls",
                     "rows_with_ids", "drift_turns", "compactions"):
            setattr(total, name, getattr(self, name) + getattr(other, name))
        total.latency = {k: self.latency[k] + other.latency[k] for k in LATENCY_KEYS}
        total.side = {role: self.side.get(role, Tally()) + other.side.get(role, Tally())
                      for role in (*self.side, *(r for r in other.side if r not in self.side))}
        total.episodes, total.user_turns = self.episodes + other.episodes, self.user_turns + other.user_turns
        costs = [c for c in (self.cost, other.cost) if c is not None]
        total.cost = sum(costs) if costs else None
        return total

    def tool_statistics(self) -> dict:
        out = {}
        for name, s in self.tools.items():
            rate = (lambda n: round(n / s["count"], 4) if s["count"] else None)  # never called: no rate
            out[name] = {**s, "success_rate": rate(s["success"]), "failure_rate": rate(s["failure"])}
        return out


@dataclass
class Verification:
    """The verdicts of every finished sample (kept, filtered and discarded alike), by prompt.

    Judged samples are those whose check reached a verdict (passed, failed, timeout); an error
    says nothing about the model, so it is counted apart and judged nowhere. A prompt passes if
    any of its judged samples passed."""

    samples: Counter = field(default_factory=Counter)  # verdict -> samples
    errors: Counter = field(default_factory=Counter)  # error kind -> samples
    groups: dict[str, list[int]] = field(default_factory=dict)  # prompt (group id) -> [judged, passed]

    def add(self, row: dict) -> None:
        if not row:  # a side record without its row
            return
        verdict = verify.status(row)
        self.samples[verdict] += 1
        if verdict == Verdict.ERROR.value:
            self.errors[row["verify"].get("error") or "unknown"] += 1
        if verdict in (Verdict.PASSED.value, Verdict.FAILED.value, Verdict.TIMEOUT.value):
            group = self.groups.setdefault(row["metadata"].get("group_id") or store.row_key(row), [0, 0])
            group[0] += 1
            group[1] += verdict == Verdict.PASSED.value

    def statistics(self) -> dict:
        judged = sum(n for n, _ in self.groups.values())
        passed_prompts = sum(1 for _, c in self.groups.values() if c)
        most = max((n for n, _ in self.groups.values()), default=0)
        at_k = {k: [pass_at_k(n, c, k) for n, c in self.groups.values() if n >= k] for k in range(1, most + 1)}
        return {
            "samples": {v.value: self.samples[v.value] for v in Verdict},
            "errors_by_kind": dict(self.errors),
            "timeouts": self.samples[Verdict.TIMEOUT.value],
            "samples_judged": judged,
            "pass_rate_samples": _ratio(self.samples[Verdict.PASSED.value], judged),
            "prompts_judged": len(self.groups),
            "prompts_passed": passed_prompts,
            "pass_rate_prompts": _ratio(passed_prompts, len(self.groups)),
            "pass_at_k": {str(k): round(sum(v) / len(v), 4) for k, v in at_k.items()},
            "pass_at_k_prompts": {str(k): len(v) for k, v in at_k.items()},
        }


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of passing with k of a prompt's n judged samples, c of them passed."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


@dataclass
class Samples:
    """Training samples per row and breaks by cause (trajgen/samples.py), over the kept rows with token ids."""

    rows: int = 0
    samples: int = 0
    most: int = 0
    breaks: Counter = field(default_factory=Counter)

    def add(self, row: dict) -> None:
        ids = (row.get("metadata") or {}).get("token_ids") or {}
        if "samples" not in ids:
            return
        self.rows += 1
        self.samples += len(ids["samples"])
        self.most = max(self.most, len(ids["samples"]))
        self.breaks.update(b["cause"] for b in ids["breaks"])

    def statistics(self) -> dict:
        return {"samples": {"rows": self.rows, "total": self.samples, "mean_per_row": _ratio(self.samples, self.rows),
                            "max_per_row": self.most},
                "breaks": {cause.value: self.breaks[cause.value] for cause in Cause}}


@dataclass
class Merged:
    kept: Tally = field(default_factory=Tally)
    hallucinated: Tally = field(default_factory=Tally)
    no_reasoning: Tally = field(default_factory=Tally)  # filtered by --require_reasoning
    not_passed: Tally = field(default_factory=Tally)  # filtered by --require_verified
    verification: Verification = field(default_factory=Verification)
    samples: Samples = field(default_factory=Samples)  # of the kept rows
    rewards: rewards.Rewards = field(default_factory=rewards.Rewards)  # of the rows of the batch files
    discarded: Tally = field(default_factory=Tally)
    discarded_by_reason: Counter = field(default_factory=Counter)
    failed_by_class: Counter = field(default_factory=Counter)
    failed_attempts: Tally = field(default_factory=Tally)  # the usage of every failure record: each attempt paid once
    batch_files: int = 0
    duplicates_skipped: int = 0
    torn: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Filtering:
    """The merge's filters, which act on trajectories.jsonl only: the batch files keep every finished
    row, so changing one on --resume merges again without a request."""

    keep_hallucinated: bool = False
    require_reasoning: bool = False
    require_verified: bool = False
    groups: bool = False  # not a filter: each kept row gets its group's statistics (--samples_per_prompt > 1)

    def group(self, hallucinated: bool, reasoned: bool, passed: bool) -> str:
        """Where the merge puts a row (a field of Merged): kept, or filtered as `hallucinated`,
        `no_reasoning` or `not_passed`."""
        if hallucinated and not self.keep_hallucinated:
            return "hallucinated"
        if self.require_reasoning and not reasoned:
            return "no_reasoning"
        return "not_passed" if self.require_verified and not passed else "kept"


def reasoned(row: dict) -> bool:
    """Whether any assistant turn of the row has reasoning (what --require_reasoning keeps)."""
    return bool((row.get("metadata") or {}).get("turns_with_reasoning"))


def merge(run_dir: Path, filtering: Filtering) -> Merged:
    """Write trajectories.jsonl (atomically) and count everything on the way. The filters act here
    only: the batch files keep every row."""
    result = Merged(rewards=rewards.Rewards(groups={} if filtering.groups else None))
    latest = _latest_failures(run_dir, result)
    first = _FirstTime(chain(store.row_keys(run_dir, []),
                             (r.get("prompt_key") for r in store.read_records(run_dir / store.DISCARDED, []))))
    groups = _group_rewards(run_dir) if filtering.groups else None
    with store.writing(run_dir / TRAJECTORIES):  # a full disk: DiskFull, the batch files intact
        fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".trajectories.jsonl.")
        try:
            with os.fdopen(fd, "wb", buffering=1 << 20) as out:
                batches = store.batch_files(run_dir)
                result.batch_files = len(batches)
                for _, path in batches:
                    for line, row in store.read_lines(path, result.torn):
                        key = store.row_key(row)
                        if key is None or not first(key):
                            result.duplicates_skipped += 1
                            continue
                        latest.pop(key, None)
                        result.verification.add(row)
                        result.rewards.add(row)
                        where = filtering.group(bool(row["metadata"].get("hallucinated_tools")), reasoned(row),
                                                verify.status(row) == Verdict.PASSED.value)
                        getattr(result, where).add(row)
                        if where != "kept":
                            continue
                        result.samples.add(row)
                        if groups is None:
                            out.write(line)  # as the batch file holds it
                        else:  # the group spliced in, not the row encoded again (a batch file's row has no group)
                            group = rewards.group(groups.get(rewards.group_id(row), []), rewards.reward_of(row))
                            out.write(line.rstrip()[:-1] + b',"group":' + orjson.dumps(group) + b"}\n")
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, run_dir / TRAJECTORIES)
        except BaseException:
            os.unlink(tmp)
            raise
    for record in store.read_records(run_dir / store.DISCARDED, result.torn):
        key = record.get("prompt_key")
        if not first(key):
            continue
        latest.pop(key, None)
        result.discarded_by_reason[record.get("reason", "unknown")] += 1
        result.discarded.add(record.get("row") or {})
        result.verification.add(record.get("row") or {})
    result.failed_by_class.update(latest.values())  # the prompts with no row and no discard
    return result


def _group_rewards(run_dir: Path) -> dict[str, list[float]]:
    """Every group's rewards, over the rows of the batch files (each key's first row, as the merge reads them)."""
    found = rewards.Rewards()
    first = _FirstTime(store.row_keys(run_dir, []))
    for _, path in store.batch_files(run_dir):
        for row in store.read_records(path, []):
            if (key := store.row_key(row)) is not None and first(key):
                found.add(row)
    return found.groups


def _latest_failures(run_dir: Path, result: Merged) -> dict[str, str]:
    """Each failed prompt's error class in its latest attempt; every attempt's usage is counted."""
    latest: dict[str, str] = {}
    for record in store.read_records(run_dir / store.FAILURES, result.torn):
        latest[record.get("prompt_key")] = record.get("error_class", "Exception")
        result.failed_attempts.rows += 1
        result.failed_attempts.add_usage(record.get("usage") or {})
    return latest


class _FirstTime:
    """Whether a key is met for the first time, holding about 16 bytes per key, not the keys (a
    set of every key of a 10-million-row run takes over a gigabyte). A first pass over all the
    keys finds the hashes that come up twice in a bitmap of 64 bits per key; only keys with one
    of those hashes (the repeated ones and about 1% of the others) are then followed exactly."""

    def __init__(self, keys: Iterable[object]):
        hashes = array("q", map(hash, keys))
        size = 64 * len(hashes) + 1
        bits = bytearray(size // 8 + 1)
        self.repeated: set[int] = set()
        for h in hashes:
            i = h % size
            if bits[i >> 3] & (1 << (i & 7)):
                self.repeated.add(h)
            bits[i >> 3] |= 1 << (i & 7)
        self.met: set[object] = set()

    def __call__(self, key: object) -> bool:
        if hash(key) not in self.repeated:
            return True
        if key in self.met:
            return False
        self.met.add(key)
        return True


def merged_statistics(run_dir: Path, filtering: Filtering, header: dict) -> dict:
    """statistics.json after a merge, or, if nothing the last merge read or wrote has changed
    since (its `merged_from` says so), its counts with this run's header: merging a finished
    100,000-prompt run again took 8 s to write the same file."""
    try:
        last = store.read_json(run_dir / STATISTICS)
    except (FileNotFoundError, store.UnreadableFile):
        last = {}
    if last.get("merged_from") == _inputs(run_dir, filtering):
        return {**header, **{k: v for k, v in last.items() if k not in header}}
    stats = statistics(merge(run_dir, filtering), header)
    return {**stats, "merged_from": _inputs(run_dir, filtering)}


def _inputs(run_dir: Path, filtering: Filtering) -> str:
    """A digest of the merge's files (name, size, modification time) and of its filters."""
    digest = hashlib.blake2b(orjson.dumps([COUNTS_VERSION, filtering]), digest_size=16)
    for path in (*(p for _, p in store.batch_files(run_dir)), run_dir / store.DISCARDED, run_dir / store.FAILURES,
                 run_dir / TRAJECTORIES):
        try:
            st = path.stat()
            digest.update(f"{path.name} {st.st_size} {st.st_mtime_ns}\n".encode())
        except FileNotFoundError:
            digest.update(f"{path.name} -\n".encode())
    return digest.hexdigest()


def statistics(merged: Merged, header: dict) -> dict:
    """statistics.json: `header` holds the run's settings and durations."""
    everything = merged.kept + merged.hallucinated + merged.no_reasoning + merged.not_passed + merged.discarded
    paid = sum(everything.side.values(), everything + merged.failed_attempts)  # side models' calls are paid too
    turns = everything.assistant_turns
    return {
        **header,
        "ok": merged.kept.rows + merged.hallucinated.rows + merged.no_reasoning.rows + merged.not_passed.rows,
        "kept": merged.kept.rows,
        "discarded": {"total": merged.discarded.rows, "by_reason": dict(merged.discarded_by_reason)},
        "failed": {"total": sum(merged.failed_by_class.values()), "by_class": dict(merged.failed_by_class),
                   "attempts": merged.failed_attempts.rows, "tokens": _tokens(merged.failed_attempts),
                   "cost": dollars(merged.failed_attempts.cost)},
        "filtered_hallucinated": merged.hallucinated.rows,
        "filtered_no_reasoning": merged.no_reasoning.rows,
        "filtered_not_passed": merged.not_passed.rows,
        "verification": merged.verification.statistics(),
        **merged.rewards.statistics(*_paid(everything.side.get("judge", Tally()))),
        "total_batches": merged.batch_files,
        "tool_statistics": merged.kept.tool_statistics(),
        "filtered_tool_statistics": {
            "hallucinated": merged.hallucinated.tool_statistics(),
            "no_reasoning": merged.no_reasoning.tool_statistics(),
            "discarded": merged.discarded.tool_statistics(),
            "not_passed": merged.not_passed.tool_statistics(),
        },
        "reasoning_statistics": {
            "total_assistant_turns": turns,
            "turns_with_reasoning": everything.turns_with_reasoning,
            "turns_without_reasoning": turns - everything.turns_with_reasoning,
            "coverage_percent": round(100 * everything.turns_with_reasoning / turns, 2) if turns else 0.0,
        },
        "api_calls": everything.api_calls,
        "latency": {key: _spread(values) for key, values in everything.latency.items()},
        "stalls": paid.stalls,
        "tokens": _tokens(paid),
        "cost": dollars(paid.cost),
        "torn_lines_ignored": merged.torn,
        "duplicate_rows_ignored": merged.duplicates_skipped,
        **side_models(everything),  # the judge's section is the rewards' (rewards.py)
        **({"token_ids": {"rows_with_ids": everything.rows_with_ids, "drift_turns": everything.drift_turns,
                          **merged.samples.statistics()}} if everything.rows_with_ids else {}),
        **({"compactions": everything.compactions} if everything.compactions else {}),
    }


SECTIONS = {"summary": "summary", "user": "user_simulator"}  # statistics.json's name for each role; the judge: rewards.py


def _paid(tally: Tally) -> tuple[int, dict, float | None]:
    """A side model's calls, tokens and cost, as its section says them."""
    return tally.api_calls, _tokens(tally), dollars(tally.cost)


def side_models(rows: Tally) -> dict:
    """A section per side model that was asked (roles.py): its calls, tokens and cost, counted apart from
    the agent's; the simulated user's also its episodes."""
    out = {}
    for role, paid in rows.side.items():
        if role in SECTIONS:
            calls, tokens, cost = _paid(paid)
            out[SECTIONS[role]] = {"rows": paid.rows, "calls": calls, "tokens": tokens, "cost": cost}
    if rows.episodes:
        episodes = sum(rows.episodes.values())
        out.setdefault(SECTIONS["user"], {}).update(
            episodes=episodes, ended_by=dict(rows.episodes), user_turns=rows.user_turns,
            user_turns_per_episode=round(rows.user_turns / episodes, 3))
    return out


def dollars(cost: float | None) -> float | None:
    """A sum of costs to the millionth of a dollar: floating-point sums read 0.03800000000000001."""
    return None if cost is None else round(cost, 6)


LATENCY_BINS_PER_DECADE = 100  # bins 2.3% wide: a median or p95 to within 1.2%, in memory that does not grow with the run


def _bin(seconds: float) -> int:
    return round(math.log10(max(seconds, 1e-4)) * LATENCY_BINS_PER_DECADE)


def _spread(bins: Counter) -> dict:
    """Median and 95th percentile (nearest rank) of seconds per reply, over the replies that said."""
    total = sum(bins.values())
    if not total:
        return {"replies": 0, "median": None, "p95": None}
    ordered = sorted(bins.items())

    def rank(q: float) -> float:
        seen, target = 0, math.ceil(q * total)
        for b, n in ordered:
            seen += n
            if seen >= target:
                return round(10 ** (b / LATENCY_BINS_PER_DECADE), 3)
        raise AssertionError("unreachable")

    return {"replies": total, "median": rank(0.5), "p95": rank(0.95)}


def _tokens(tally: Tally) -> dict:
    """The token totals; unknown (null) when some reply did not say its tokens: a sum without them is not the total."""
    if tally.replies_without_usage:
        return {"prompt": None, "completion": None, "reasoning": None, UNKNOWN: tally.replies_without_usage}
    return {"prompt": tally.prompt_tokens, "completion": tally.completion_tokens, "reasoning": tally.reasoning_tokens}
