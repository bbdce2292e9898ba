"""--compress: a finished run's rows brought to a token target, into `<output_dir>/<run_name>_compressed/`.

A row at or under the target is copied unchanged; a longer one has the fewest middle turns from its
start replaced by one summary turn (trajgen/compaction.py), written by the summary model. The job
reads the run twice: once to plan every row and ask for the summaries (concurrently, journaled in the
new directory, so a killed job resumes without paying twice: trajgen/side_jobs.py), once to write
the rows. The new directory is a run directory like any (manifest, batch files, trajectories.jsonl,
statistics.json), so --export, --view and --report take it.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

from trajgen import compaction, console, merge, roles, side_jobs, store, tokenizer, trajectory
from trajgen.errors import FatalAPIError, UsageError
from trajgen.model import Reply, add_usage, no_usage
from trajgen.options import RunOptions, run_api_key
from trajgen.task import ModelSettings

MINIMUM_TARGET = 512
COUNTED = 256  # rows whose turns are counted in one call of the tokenizer
SUFFIX = "_compressed"
HEADER = ("model", "distribution", "total_prompts", "samples_per_prompt", "batch_size", "remaining_not_run",
          "records_not_in_dataset", "invalid_lines_skipped")  # statistics.json's header, as the run's says


@dataclass(frozen=True)
class Planned:
    """A row's tokens and its plan, from the first pass (the second writes it without counting again)."""

    tokens: int
    plan: compaction.Plan
    removed: int = 0  # the tokens of the turns a Cut replaces


def counter(name: str | None) -> Callable[[list[str]], list[int]]:
    """Tokens of each text: --tokenizer's exact count, or the estimate (compaction.CHARS_PER_TOKEN)."""
    if name is None:
        return lambda texts: [compaction.estimate(text) for text in texts]
    tok = tokenizer.load(name)
    return lambda texts: tokenizer.counts(tok, texts)


def planned(row: dict, tokens: list[int], target: int) -> Planned:
    """The row's plan from its turns' tokens; a row's tokens are their sum."""
    turns = [compaction.Turn(t["from"], tuple(c["id"] for c in t.get("tool_calls") or ()), t.get("tool_call_id"))
             for t in row["conversations"]]
    plan = compaction.plan(turns, tokens, sum(tokens), target)
    removed = sum(tokens[plan.start:plan.end]) if isinstance(plan, compaction.Cut) else 0
    return Planned(sum(tokens), plan, removed)


def every_plan(rows: Iterator[dict], count: Callable[[list[str]], list[int]], target: int
               ) -> Iterator[tuple[dict, Planned]]:
    """Each row with its plan; the turns of COUNTED rows are counted in one call (a call per row cost
    the tokenizer more than its counting)."""
    while chunk := list(itertools.islice(rows, COUNTED)):
        tokens = iter(count([t["value"] for row in chunk for t in row["conversations"]]))
        for row in chunk:
            yield row, planned(row, list(itertools.islice(tokens, len(row["conversations"]))), target)


def job_key(row: dict) -> str:
    return store.row_key(row) or f"prompt-{row['prompt_index']}"


def summary_job(row: dict, cut: compaction.Cut) -> side_jobs.Job:
    texts = [(t["from"], t["value"]) for t in row["conversations"][cut.start:cut.end]]
    return side_jobs.Job(key=job_key(row), messages=compaction.summary_messages(texts, cut.budget))


def compressed(row: dict, cut: compaction.Cut, summary: str) -> dict:
    """The row with turns[start:end] replaced by one human turn that says what it stands for."""
    text = compaction.summary_turn_text(cut.turns, summary)
    turn = {"from": "human", "value": text, "message": {"role": "user", "content": text}}
    turns = row["conversations"]
    return {**row, "conversations": [*turns[:cut.start], turn, *turns[cut.end:]]}


def _paths(opts: RunOptions) -> tuple[Path, Path]:
    if opts.run_name is None:
        raise UsageError("--compress needs --run_name (the run to compress)")
    source = Path(opts.output_dir) / opts.run_name
    if not (source / merge.TRAJECTORIES).exists() or not (source / "manifest.json").exists():
        raise UsageError(f"{source}: no finished run to compress (trajectories.jsonl and manifest.json are needed)")
    return source, Path(opts.output_dir) / f"{opts.run_name}{SUFFIX}"


def _summary_settings(opts: RunOptions, manifest: dict) -> ModelSettings:
    """The summary model: --summary_model/--summary_base_url, by default the run's model and endpoint."""
    run_opts = replace(opts, model=manifest.get("model") or opts.model,
                       base_url=manifest.get("base_url") or opts.base_url)
    return roles.settings_for(run_opts.model_settings(run_api_key(run_opts), []), opts.summary_model,
                              opts.summary_base_url, opts.summary_api_key)


def _rows(source: Path) -> Iterator[dict]:
    return store.read_records(source / merge.TRAJECTORIES, [])


def run(opts: RunOptions) -> int:
    """Check everything before any request (exit 2), ask for the summaries, write the new run."""
    started = time.monotonic()
    source, target_dir = _paths(opts)
    if opts.compress_tokens < MINIMUM_TARGET:
        raise UsageError(f"--compress_tokens must be at least {MINIMUM_TARGET}, got {opts.compress_tokens}")
    count = counter(opts.tokenizer)
    manifest = store.read_json(source / "manifest.json")
    settings = _summary_settings(opts, manifest)
    store.lock_run_dir(target_dir)
    plans, jobs = {}, []
    for row, plan in every_plan(_rows(source), count, opts.compress_tokens):
        plans[job_key(row)] = plan
        if isinstance(plan.plan, compaction.Cut):
            jobs.append(summary_job(row, plan.plan))
    replies: dict[str, Reply | Exception] = {}
    try:
        paid = asyncio.run(side_jobs.run_jobs(
            jobs, settings=settings, journal_path=target_dir / store.JOURNAL, concurrency=opts.concurrency,
            cache_dir=opts.cache_dir, on_done=lambda job, reply: replies.__setitem__(job.key, reply), role="summary",
            max_cost=opts.max_cost, max_total_tokens=opts.max_total_tokens, cache_max_mb=opts.cache_max_mb))
    except FatalAPIError as e:
        console.error(f"the summary model at {settings.base_url} refuses or cannot be reached ({e}): "
                      "fix --summary_base_url, --summary_model or the key; the summaries already paid are "
                      "kept and the same command goes on from them")
        return 1
    totals = _write(source, target_dir, manifest, opts, count, plans, replies, settings.model)
    header = {"run_name": target_dir.name, **{k: v for k, v in _source_stats(source).items() if k in HEADER},
              "duration_seconds": round(time.monotonic() - started, 3)}
    header["duration_seconds_total"] = header["duration_seconds"]  # this directory's own work: the compression
    stats = merge.merged_statistics(target_dir, merge.Filtering(keep_hallucinated=True), header)
    stats["compression"] = {**totals, "summary_calls_this_invocation": paid.calls,
                            "summary_calls_replayed": paid.replayed}
    store.write_json(target_dir / merge.STATISTICS, stats)
    _say(target_dir, stats["compression"])
    if paid.not_run:
        console.notice(f"a spend limit was reached: {paid.not_run} summary call(s) not made, their rows kept "
                       "uncompressed (not_summarized); the same command goes on")
        return 3
    return 0


def _source_stats(source: Path) -> dict:
    return store.read_json_or_empty(source / merge.STATISTICS)


def _write(source: Path, target_dir: Path, manifest: dict, opts: RunOptions, count: Callable[[list[str]], list[int]],
           plans: dict[str, Planned], replies: dict[str, Reply | Exception], model: str) -> dict:
    """The compressed rows into batch files named as the run's (what an earlier invocation left is
    replaced; not fsynced: the merge's trajectories.jsonl is, and a crash before it means running the
    same command again), the manifest, and the totals of statistics.json's `compression`."""
    for path in (*(p for _, p in store.batch_files(target_dir)), target_dir / merge.TRAJECTORIES,
                 target_dir / merge.STATISTICS):
        path.unlink(missing_ok=True)
    store.write_json(target_dir / "manifest.json", {
        **manifest, "run_name": target_dir.name,
        "compressed_from": {"run_name": manifest.get("run_name"), "compress_tokens": opts.compress_tokens,
                            "tokenizer": opts.tokenizer, "summary_model": model}})
    status: Counter = Counter()
    before_total = after_total = 0
    usage = {**no_usage(), "api_calls": 0}
    failed: dict[str, str] = {}
    file: tuple[int, store.AppendFile] | None = None  # the rows come batch by batch: one file open at a time
    try:
        for row in _rows(source):
            key = job_key(row)
            plan, before = plans[key].plan, plans[key].tokens
            metrics: dict = {"tokens_before": before, "tokens_after": before, "turns_summarized": 0,
                             "target": opts.compress_tokens}
            if isinstance(plan, compaction.Cut):
                reply = replies.get(key)
                if isinstance(reply, Reply):
                    row = compressed(row, plan, trajectory.split_reasoning(reply.message)[1])
                    after = before - plans[key].removed + count([row["conversations"][plan.start]["value"]])[0]
                    metrics |= {"tokens_after": after, "turns_summarized": plan.turns, "summary_model": model,
                                "summary_usage": reply.usage,
                                "status": "compressed" if after <= opts.compress_tokens else "over_target"}
                    add_usage(usage, reply.usage)
                    usage["api_calls"] += 1
                elif reply is None:  # a spend limit left its call unmade
                    metrics["status"] = "not_summarized"
                else:
                    failed[key] = " ".join(str(reply).split())[:300]
                    metrics["status"] = "summary_failed"
            else:
                metrics["status"] = {compaction.Fits: "under_target", compaction.Unreachable: "over_target",
                                     compaction.Orphan: "orphan_tool_call"}[type(plan)]
            status[metrics["status"]] += 1
            before_total += before
            after_total += metrics["tokens_after"]
            row = {**row, "metadata": {**row["metadata"], "compression": metrics}}
            batch = row["metadata"].get("batch_num", 0)
            if file is None or file[0] != batch:
                if file:
                    file[1].close()
                file = (batch, store.AppendFile(target_dir / f"batch_{batch}.jsonl"))
            file[1].append(row)
    finally:
        if file:
            file[1].close()
    return {"target": opts.compress_tokens, "tokenizer": opts.tokenizer, "summary_model": model,
            "rows": sum(status.values()), "compressed": status["compressed"], "under_target": status["under_target"],
            "still_over_target": status["over_target"], "orphan_tool_calls": status["orphan_tool_call"],
            "summary_failed": status["summary_failed"], "summary_failed_rows": failed,
            "not_summarized": status["not_summarized"],
            "tokens_before": before_total, "tokens_after": after_total,
            "compression_ratio": round(after_total / before_total, 4) if before_total else None,
            "summary_tokens": {"prompt": usage["prompt_tokens"], "completion": usage["completion_tokens"]},
            "summary_cost": merge.dollars(usage["cost"]), "summary_calls": usage["api_calls"]}


def _say(target_dir: Path, totals: dict) -> None:
    cost = "unknown" if totals["summary_cost"] is None else f"${totals['summary_cost']:.4f}"
    console.out.print(
        f"wrote {totals['rows']} rows to {target_dir}: {totals['compressed']} compressed, {totals['under_target']} "
        f"already under {totals['target']} tokens, {totals['still_over_target']} still over it, "
        f"{totals['orphan_tool_calls']} with a tool call without its result (kept as they were); "
        f"tokens {totals['tokens_before']} -> {totals['tokens_after']}; summaries cost {cost}",
        markup=False, highlight=False, soft_wrap=True)
    if totals["summary_failed"]:
        console.notice(f"{totals['summary_failed']} row(s) kept uncompressed because their summary call failed "
                       f"({', '.join(list(totals['summary_failed_rows'])[:5])}); run the same command again to retry "
                       "them (the summaries already paid are not asked again)")
