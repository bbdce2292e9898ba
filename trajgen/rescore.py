"""The judge after the rollouts: --rescore scores a finished run's rows again, and --judge_mode=group
scores each prompt's samples together once they have all finished. No rollout request is sent.

The judge's calls are side jobs (trajgen/side_jobs.py) journaled in JOURNAL, keyed by the row (or the
group) and the request's hash: a killed rescore done again pays only for what it had not received,
and a changed rubric is a new request, so a new score. Each batch file is then replaced whole
(temp file, fsync, rename) with its rows' `judge`, `judge_error`, judge usage and `reward` new:
every reader sees a row as it was or as it is, never half of it; the merge that follows recomputes
`group`, trajectories.jsonl and statistics.json, and names older exports stale.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import orjson

from trajgen import console, export, judge, merge, rewards, store
from trajgen.errors import EndpointUnreachable, FatalAPIError, UsageError
from trajgen.model import Reply, no_usage
from trajgen.options import RunOptions, check_judge, run_api_key
from trajgen.side_jobs import Job, SideStats, run_jobs
from trajgen.task import JudgeConfig

JOURNAL = "judge_journal.jsonl"


def _rows(run_dir: Path) -> list[dict]:
    """Each key's first row in the batch files, as the merge reads them."""
    rows, seen = [], set()
    for _, path in store.batch_files(run_dir):
        for row in store.read_records(path, []):
            if (key := store.row_key(row)) is not None and key not in seen:
                seen.add(key)
                rows.append(row)
    return rows


def _jobs(rows: list[dict], config: JudgeConfig, only_unjudged: bool) -> tuple[list[Job], dict[str, list[dict]]]:
    """The judge's requests, and the rows each one scores (a group's in sample order)."""
    if config.mode == "sample":
        chosen = {store.row_key(r): [r] for r in rows if not only_unjudged or not _judged(r)}
        jobs = [Job(key=key, messages=judge.messages(row, rubric), response_format=judge.RESPONSE_FORMAT)
                for key, (row,) in chosen.items() if (rubric := judge.rubric_of(row, config))]
        return jobs, chosen
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(rewards.group_id(row), []).append(row)
    chosen = {gid: sorted(g, key=lambda r: r["metadata"].get("sample_index", 0)) for gid, g in groups.items()
              if not only_unjudged or not all(map(_judged, g))}
    jobs = [Job(key=gid, messages=judge.group_messages(g, rubric), response_format=judge.GROUP_FORMAT)
            for gid, g in chosen.items() if (rubric := judge.rubric_of(g[0], config))]
    return jobs, chosen


def _judged(row: dict) -> bool:
    return bool(row.get("judge") or row.get("judge_error"))


def score(run_dir: Path, config: JudgeConfig, opts: RunOptions, only_unjudged: bool = False,
          max_cost: float | None = None, max_total_tokens: int | None = None) -> SideStats:
    """Judge the run's rows (`only_unjudged`: those without a judgement, or, in groups, the groups with
    one such row) and replace them in their batch files. FatalAPIError names --judge_base_url."""
    rows = _rows(run_dir)
    jobs, scored = _jobs(rows, config, only_unjudged)
    judged: dict[str, dict] = {}  # row key -> the fields the judgement replaces
    model = config.settings.model

    def on_done(job: Job, reply: Reply | Exception) -> None:
        group = scored[job.key]
        rubric = judge.rubric_of(group[0], config)
        try:
            if isinstance(reply, Exception):
                raise reply
            scores: list = [judge.parse(reply)] if config.mode == "sample" else judge.parse_group(reply, len(group))
        except Exception as e:  # the judge's error, on every row it was to score
            scores = [e] * len(group)
        usage = {**reply.usage} if isinstance(reply, Reply) else {}
        for i, (row, found) in enumerate(zip(group, scores)):  # the call's usage on the first row it scored
            paid = {**usage, "api_calls": 1} if i == 0 else {"api_calls": 0}
            judged[store.row_key(row)] = {**judge.fields(found, model, rubric), "usage": paid}

    try:
        stats = asyncio.run(run_jobs(jobs, settings=config.settings, journal_path=run_dir / JOURNAL,
                                     concurrency=opts.concurrency, cache_dir=opts.cache_dir, on_done=on_done,
                                     max_cost=max_cost, max_total_tokens=max_total_tokens,
                                     cache_max_mb=opts.cache_max_mb, role="judge"))
    except EndpointUnreachable as e:
        raise judge.unreachable(config, e) from None
    finally:
        if judged:
            _replace_rows(run_dir, judged, config.reward_from)
    return stats


def _replace_rows(run_dir: Path, judged: dict[str, dict], reward_from: str) -> None:
    """Each batch file with a judged row, replaced whole: its other lines (torn ones too) as they were."""
    for _, path in store.batch_files(run_dir):
        lines, changed = [], False
        with open(path, "rb") as f:
            for raw in f:
                try:
                    row = orjson.loads(raw)
                    new = judged.pop(store.row_key(row), None)  # popped: a repeated key's first row only
                except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError):
                    new = None
                if new is None:
                    lines.append(raw)
                    continue
                usage = new.pop("usage")
                sides = row["metadata"].setdefault("side_usage", {})
                sides["judge"] = {**no_usage(), **usage}
                row.update(new)
                row["reward"] = rewards.chosen(row, reward_from)
                lines.append(store.encode_row(row) + b"\n")
                changed = True
        if changed:
            store.atomic_write(path, b"".join(lines))


def run(opts: RunOptions) -> int:
    """--rescore --run_name=NAME: exit 2 before any request on bad input, 1 when the judge stops it,
    3 at a spend limit (done again, it goes on), else 0."""
    check_judge(opts)
    run_dir = Path(opts.output_dir) / (opts.run_name or "")
    if not opts.run_name or not (run_dir / "manifest.json").is_file():
        raise UsageError(f"--rescore: there is no run {run_dir} to score (check --run_name and --output_dir)")
    if not opts.judge_model:
        raise UsageError("--rescore needs --judge_model (and --rubric, or a rubric field in the dataset's rows)")
    manifest = store.read_json(run_dir / "manifest.json")
    base = replace(opts, model=manifest.get("model") or opts.model, base_url=manifest.get("base_url") or opts.base_url)
    run_settings = base.model_settings(opts.judge_api_key or run_api_key(replace(base, base_url=opts.judge_base_url
                                                                                   or base.base_url)), [])
    config = opts.judge_config(run_settings)
    if not config.rubric and not any(r["metadata"].get("rubric") for r in _rows(run_dir)):
        raise UsageError("--rescore needs --rubric TEXT or --rubric @FILE: no row of the run has a rubric field")
    store.lock_run_dir(run_dir)
    try:
        stats = score(run_dir, config, opts, max_cost=opts.max_cost, max_total_tokens=opts.max_total_tokens)
    except FatalAPIError as e:
        console.error(f"the judge stopped the rescore: {e}; what was paid is kept, and the same command goes on")
        return 1
    merged = remerge(run_dir)
    console.out.print(f"rescored {run_dir}: {stats.calls} judge call(s) paid, {stats.replayed} replayed, "
                      f"{stats.errors} error(s); cost {console.dollars(stats.cost)}; "
                      f"mean reward {merged['rewards']['mean_reward']}")
    for path in export.stale(run_dir):
        console.notice(f"{path} was exported before this rescore and is stale: run --export again")
    if stats.not_run:
        console.notice(f"a spend limit was reached: {stats.not_run} row(s) not scored; the same command goes on")
        return 3
    return 0


def remerge(run_dir: Path) -> dict:
    """trajectories.jsonl and statistics.json again, with the run's filters as its last merge reported them."""
    last = store.read_json_or_empty(run_dir / merge.STATISTICS)
    filtering = merge.Filtering(keep_hallucinated=last.get("filtered_hallucinated") == 0,
                                require_reasoning=bool(last.get("filtered_no_reasoning")),
                                require_verified=bool(last.get("filtered_not_passed")),
                                groups=(last.get("samples_per_prompt") or 1) > 1)
    stats = {**last, **merge.merged_statistics(run_dir, filtering, {})}
    store.write_json(run_dir / merge.STATISTICS, stats)
    return stats
