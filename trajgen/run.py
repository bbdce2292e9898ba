"""One run, in three steps: prepare (check everything, plan), execute (the scheduler over the
workers), finish (merge, statistics, exit status). `trajgen/modes.py` picks it (or another mode).
"""
from __future__ import annotations

import asyncio
import importlib.util
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import orjson

from trajgen import console, dataset, dry_run, export, journal, local_model, merge, registry, rescore, roles
from trajgen import plan as plan_module, resume_scan, scheduler, store
from trajgen.distributions import DISTRIBUTIONS, TOOLSETS, Distribution, resolve as resolve_distribution, without
from trajgen.errors import FatalAPIError, UsageError
from trajgen.options import RunOptions, as_list, check as check_options, run_api_key
from trajgen.plan import SANDBOX_TOOLSETS, Plan
from trajgen.sandbox.backends import BACKENDS, SandboxConfig, bwrap_problem, check_images, cleanup, limit_notices, reap, runs_images
from trajgen.sandbox.backends import prepare_host, runtime_problem
from trajgen.tools import ToolSettings, ToolSpec, mcp_config
from trajgen.task import ModelSettings, Task, WorkerConfig
from trajgen.process_pool import ProcessPool, worker_share


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """Everything decided before the first request: the checked options, the plan, the settings."""

    opts: RunOptions
    run_dir: Path
    check: dataset.DatasetCheck
    manifest: dict
    scan: resume_scan.Scan
    model: ModelSettings
    tools: ToolSettings
    unavailable_tools: dict[str, str]
    unavailable_sets: dict[str, str]
    plan: Plan
    distribution: Distribution
    fresh: bool = True  # this invocation starts the run directory (it was empty, or --overwrite)
    not_in_dataset: int = 0  # rows and discards of prompts the dataset no longer has (a resume with another file)
    mcp_servers: tuple[mcp_config.Server, ...] = ()
    mcp_tools: tuple[ToolSpec, ...] = ()  # read from the servers by the probe, just before the run
    left_out: tuple[str, ...] = ()  # toolsets the default distribution leaves out: they could not run here

    def tasks(self, entries: Iterator[dataset.Entry] | None = None) -> Iterator[Task]:
        """The plan's prompts, streamed from the dataset to run them, or from `entries` (the
        checking pass, which counts them before the dataset's fingerprint is known)."""
        opts = self.opts
        if entries is None:
            entries = dataset.entries(str(opts.dataset_file), self.check.duplicates, opts.max_samples)
        return plan_module.tasks(entries, fingerprint=self.check.fingerprint, done=self.scan.done,
                                 distribution=self.distribution, seed=opts.seed, batch_size=opts.batch_size,
                                 first_batch=self.scan.next_batch, unavailable=self.unavailable_sets,
                                 journal=self.scan.journal, samples=opts.samples_per_prompt,
                                 toolsets_per_sample=opts.toolsets_per_sample)

    def counted(self) -> Prepared:
        """With the dataset checked (into a new `check`) and the plan counted, in one pass."""
        check = dataset.DatasetCheck()
        prepared = replace(self, check=check)
        image = self.opts.docker_image if runs_images(self.opts.backend) else None
        entries = dataset.read(str(self.opts.dataset_file), check, self.opts.max_samples)
        return replace(prepared, plan=plan_module.count(prepared.tasks(entries), self.scan.next_batch, image))


@dataclass(frozen=True)
class Ran:
    """How a run ended: its exit status, and what this invocation paid (a --models invocation
    gives the next model what is left of its limits)."""

    status: int
    paid_cost: float = 0.0
    paid_tokens: int = 0


def single(opts: RunOptions) -> Ran:
    """One model's run: the packaged local model served for it, or the endpoint's."""
    return run_local(opts) if opts.model == local_model.NAME else ran(opts)


def run(opts: RunOptions, health_check: Callable[[], str | None] | None = None) -> int:
    """The exit status of one run (the library entry point)."""
    return ran(opts, health_check).status


def ran(opts: RunOptions, health_check: Callable[[], str | None] | None = None) -> Ran:
    """health_check: asked on every scheduler turn; a reason string stops the run like a fatal endpoint error."""
    started = time.monotonic()
    prepared = prepare(opts)
    sandbox = opts.sandbox_config()
    for line in limit_notices(sandbox):
        console.notice(line)
    try:
        if not opts.dry_run:  # the run directory is locked: what carries this run's tag was left by a killed runner
            reap(sandbox)
            for line in prepare_host(sandbox):
                console.notice(line)
        if any(prepared.plan.sampled[s.name] for s in prepared.mcp_servers):
            try:
                prepared = replace(prepared, mcp_tools=_probe_mcp(prepared, sandbox))
            except mcp_config.ServerFailed as e:
                console.error(f"{e}; nothing was sent")
                return Ran(1)
        missing_images = {} if _on_cluster(opts) else _missing_images(prepared.plan, sandbox)
        if opts.token_ids:
            found = dry_run.token_dialect(prepared.model)
            if found.settings is None:
                _forget(prepared)
                console.error(found.said)
                return Ran(found.status)
            console.notice(found.said)
            prepared = replace(prepared, model=found.settings)
        if opts.dry_run:
            return Ran(dry_run.report(prepared.plan, prepared.model, opts.batch_size, len(prepared.scan.done),
                                      opts.max_cost, opts.max_total_tokens))
        if (opts.max_cost is not None or opts.max_total_tokens is not None) and (refused := _unmeasured(prepared)):
            return Ran(refused)
        outcome, previous = execute(prepared, sandbox, missing_images, started, health_check)
    finally:
        cleanup(sandbox)
    return Ran(finish(prepared, outcome, previous, started), outcome.paid_cost, outcome.paid_tokens)


def run_local(opts: RunOptions) -> Ran:
    """Serve the small packaged model for the length of the run. It answers one request at a
    time, so more conversations in flight would only queue."""
    local_model.model_path()  # a clear usage error before anything starts
    if opts.concurrency > 1 or opts.num_workers != 1:
        console.notice("--model=local serves one request at a time: running with --num_workers=1 --concurrency=1")
    with local_model.serve(opts.token_ids) as server:
        return ran(replace(opts, base_url=server.url, api_key="none", num_workers=1, concurrency=1),
                   health_check=server.problem)


def run_export(opts: RunOptions) -> int:
    export.check_format(opts.export)
    if opts.run_name is None:
        raise UsageError("--export needs --run_name (the run to export)")
    run_dir = Path(opts.output_dir) / opts.run_name
    if not (run_dir / "trajectories.jsonl").exists() or not (run_dir / "manifest.json").exists():
        raise UsageError(f"{run_dir}: no finished run to export (trajectories.jsonl and manifest.json are needed)")
    store.lock_run_dir(run_dir)
    exported = export.export(run_dir, opts.export, export.outcomes(opts.export_outcome), opts.export_partial)
    console.out.print(f"wrote {exported.rows} rows to {exported.path}")
    for line in export.warnings(run_dir, exported):
        console.notice(line)
    console.out.print("\n".join(export.next_steps(exported, opts.export)), markup=False, highlight=False, soft_wrap=True)
    return 0


LEFT_OUT = "default_left_out"  # manifest.json: the toolsets the default distribution left out


def prepare(opts: RunOptions) -> Prepared:
    """Check the flags, the key, the dataset and the run directory; plan; say what is missing."""
    check_options(opts)
    servers = mcp_config.load_config(opts.mcp_config) if opts.mcp_config else ()
    if servers and importlib.util.find_spec("mcp") is None:
        raise UsageError("--mcp_config needs the MCP SDK: pip install -e '.[mcp]' in the clone")
    try:
        distribution = resolve_distribution(opts.distribution, as_list(opts.toolsets),
                                            (*TOOLSETS, *(s.name for s in servers)))
    except ValueError as e:
        raise UsageError(f"--{'toolsets' if opts.toolsets else 'distribution'}: {e}")
    api_key = run_api_key(opts)
    prefill = _prefill(opts.prefill_messages_file)
    run_dir = Path(opts.output_dir) / opts.run_name
    existed = bool(store.entries(run_dir))
    if opts.resume and not existed and not opts.overwrite:
        raise UsageError(f"--resume: there is no run {run_dir} to continue (check --run_name and --output_dir, "
                         "or leave out --resume to start it)")
    scan, refused = _look_at_run_dir(run_dir, opts) if existed else (resume_scan.Scan(), None)
    tools = opts.tool_settings(api_key)
    unavailable_tools = registry.unavailable_tools(tools)
    unavailable_sets = registry.unavailable_toolsets(unavailable_tools)
    fresh = opts.overwrite or not existed
    left_out = _left_out(distribution, unavailable_sets, run_dir, fresh)
    prepared = Prepared(opts=opts, run_dir=run_dir, check=dataset.DatasetCheck(), manifest={}, scan=scan,
                        model=opts.model_settings(api_key, prefill), tools=tools, unavailable_tools=unavailable_tools,
                        unavailable_sets=unavailable_sets, plan=Plan(), distribution=without(distribution, left_out),
                        fresh=fresh, mcp_servers=servers, left_out=left_out).counted()
    _say_what_is_wrong_with(prepared.check, opts)
    if opts.judge_model and not opts.rubric and not any(e.extra.get("rubric") for e in dataset.entries(
            str(opts.dataset_file), prepared.check.duplicates, opts.max_samples)):
        raise UsageError("--judge_model needs a rubric: --rubric TEXT, --rubric @FILE, or a rubric field in the "
                         "dataset's rows")
    if refused:
        raise refused
    if not opts.dry_run and not existed:
        prepared = _make_run_dir(prepared)
    check, scan = prepared.check, prepared.scan
    manifest = opts.manifest({"path": opts.dataset_file, "fingerprint": check.fingerprint, "prompts": check.valid,
                              "invalid_lines_skipped": check.error_count})
    if distribution is DISTRIBUTIONS["default"]:
        manifest[LEFT_OUT] = list(left_out)
    prepared = replace(prepared, manifest=manifest)
    if scan.torn:
        console.notice(f"ignored {len(scan.torn)} torn line(s) left by an interrupted run: {', '.join(scan.torn[:5])}")
    for note in scan.notes:
        console.notice(note)
    prepared = replace(prepared, not_in_dataset=_dataset_change(prepared))
    _say_what_is_missing(prepared)
    for line in opts.request_extras()[2]:
        console.notice(f"sending {line}")
    if prepared.plan.with_user and not opts.user_model:
        console.notice(f"{prepared.plan.with_user} sample(s) name a simulated user (a \"user\" field): without "
                       "--user_model they run without one")
    return prepared


def execute(prepared: Prepared, sandbox: SandboxConfig, missing_images: dict[str, str], started: float,
            health_check: Callable[[], str | None] | None) -> tuple[scheduler.RunEnd, float]:
    """Create or continue the run directory and run the plan; returns the outcome and earlier runs' seconds."""
    opts, run_dir = prepared.opts, prepared.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    if opts.overwrite:
        for child in store.entries(run_dir):
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    if not prepared.fresh and (back := _bring_back_unreasoned(run_dir)):
        console.notice(f"{back} sample(s) that an earlier version discarded for having no reasoning are back in the "
                       "batch files: --require_reasoning now filters them at the merge only")
    previous = store.read_checkpoint(run_dir).get("duration_seconds_total", 0.0)
    store.write_json(run_dir / "manifest.json", {**prepared.manifest, "updated_at": scheduler.now()})
    auto = opts.num_workers == "auto"  # Ray actors as the cluster's CPUs hold, each up to --concurrency
    judging = opts.judge_config(prepared.model) if opts.judge_model and opts.judge_mode == "sample" else None
    config = WorkerConfig(model=prepared.model, sandbox=sandbox, tools=prepared.tools,
                          unavailable_tools=prepared.unavailable_tools,
                          concurrency=worker_share(opts.concurrency, 1 if auto else opts.num_workers),
                          verbose=opts.verbose, cache_dir=opts.cache_dir, verify_timeout=opts.verify_timeout,
                          cache_max_mb=opts.cache_max_mb, mcp_tools=prepared.mcp_tools,
                          user=opts.simulated_user(prepared.model), judge=judging, reward_from=opts.reward_from,
                          summary=roles.settings_for(prepared.model, opts.summary_model, opts.summary_base_url,
                                                     opts.summary_api_key) if opts.context_budget else None)
    workers = None if auto else min(opts.num_workers, prepared.plan.remaining)
    if opts.executor == "processes" or not prepared.plan.remaining:  # nothing to run: no worker, no Ray cluster
        pool = ProcessPool(workers or 0, config)
    else:
        from trajgen.ray_executor import make_executor
        pool = make_executor(opts.executor, workers, config, opts.ray_address, opts.worker_cpus, opts.worker_memory,
                             tuple(prepared.plan.images), opts.require_toolsets)
    limits = scheduler.Limits(run_name=opts.run_name, batch_size=opts.batch_size, concurrency=opts.concurrency,
                              verbose=opts.verbose, max_cost=opts.max_cost, max_total_tokens=opts.max_total_tokens,
                              health_check=health_check)
    cache = journal.Cache(opts.cache_dir, opts.cache_max_mb) if opts.cache_dir else None
    if cache:
        cache.open()
    run = scheduler.Scheduler(prepared.plan, pool, limits, run_dir, missing_images, previous, started)
    end = run.execute(prepared.tasks(), on_exit=lambda: cleanup(sandbox))
    if cache:
        cache.trim()
    return end, previous


def finish(prepared: Prepared, outcome: scheduler.RunEnd, previous: float, started: float) -> int:
    """Merge, write statistics.json, show the summary; the exit status says how the run ended."""
    opts, check = prepared.opts, prepared.check
    if outcome.unreachable and prepared.fresh and not outcome.failed:
        return _unreachable(prepared, outcome.fatal)
    finished = not (outcome.fatal or outcome.stopped_by or outcome.budget or outcome.failed or outcome.not_run)
    if opts.judge_model and opts.judge_mode == "group" and finished:  # every group whole: judge them
        outcome = _judge_groups(prepared, outcome)
    filtering = merge.Filtering(opts.keep_hallucinated, opts.require_reasoning, opts.require_verified,
                                opts.samples_per_prompt > 1)
    stats = merge.merged_statistics(prepared.run_dir, filtering, {
        "run_name": opts.run_name, "model": opts.model, "distribution": opts.distribution,
        "total_prompts": check.valid, "samples_per_prompt": opts.samples_per_prompt, "batch_size": opts.batch_size,
        "remaining_not_run": outcome.not_run, "records_not_in_dataset": prepared.not_in_dataset,
        "invalid_lines_skipped": check.error_count,
        "duration_seconds": round(time.monotonic() - started, 3),
        "duration_seconds_total": round(previous + time.monotonic() - started, 3),
    })
    store.write_json(prepared.run_dir / merge.STATISTICS, stats)
    console.summary(stats)
    if not_kept := console.not_kept_line(stats):
        console.notice(not_kept)
    failures = console.failures_line(stats, prepared.run_dir)
    for path in export.stale(prepared.run_dir):
        console.notice(f"{path} was exported before this merge and is stale: run --export again")
    if outcome.fatal:
        console.stopped(f"the run was stopped: {outcome.fatal}. Fix it, then resume with:", failures=failures)
        return 1
    if outcome.stopped_by:
        console.stopped(f"stopped by {outcome.stopped_by.name}: the prompts in flight were cancelled and run again on "
                        "resume; resume with:", error=False, failures=failures)
        return scheduler.exit_status(outcome.stopped_by)
    if outcome.budget:
        console.stopped(f"stopped: {outcome.budget} reached; this invocation paid ${outcome.paid_cost:.4f}, "
                        f"{outcome.paid_tokens} tokens (failed attempts and the prompts in flight at the limit "
                        f"included); {outcome.not_run} prompt(s) not run. Resume with:", error=False, failures=failures)
        return 3
    if outcome.failed:
        console.stopped(f"{failures}; --resume runs them again:", error=False)
        return 1
    return 0


def _judge_groups(prepared: Prepared, outcome: scheduler.RunEnd) -> scheduler.RunEnd:
    """--judge_mode=group: every group with an unjudged sample judged as a whole (trajgen/rescore.py),
    within what is left of the spend limits; the run's end with what the judge paid, or why it stopped."""
    opts = prepared.opts
    left = lambda limit, paid: None if limit is None else max(limit - paid, 0)  # noqa: E731
    try:
        judged = rescore.score(prepared.run_dir, opts.judge_config(prepared.model), opts, only_unjudged=True,
                               max_cost=left(opts.max_cost, outcome.paid_cost),
                               max_total_tokens=left(opts.max_total_tokens, outcome.paid_tokens))
    except FatalAPIError as e:
        return replace(outcome, fatal=str(e))
    return replace(outcome, paid_cost=outcome.paid_cost + (judged.cost or 0.0),
                   paid_tokens=outcome.paid_tokens + judged.prompt_tokens + judged.completion_tokens,
                   budget=outcome.budget or ("a spend limit, before every group was judged" if judged.not_run else None))


def _bring_back_unreasoned(run_dir: Path) -> int:
    """Append to its batch file each row that an earlier version discarded for having no reasoning (a
    finished, paid sample), so that the merge keeps or filters it by --require_reasoning like any row.
    Its record stays in discarded.jsonl, where the merge and resume give way to the row."""
    back = {record["prompt_key"]: record for record in store.read_records(run_dir / store.DISCARDED, [])
            if record.get("reason") == "no_reasoning" and isinstance(record.get("batch_num"), int)
            and isinstance(record.get("row"), dict) and store.row_key(record["row"]) == record.get("prompt_key")}
    if not back:
        return 0
    for key in store.row_keys(run_dir, []):  # brought back already (or landed as a row since)
        back.pop(key, None)
    for batch_num in sorted({record["batch_num"] for record in back.values()}):
        file = store.AppendFile(run_dir / f"batch_{batch_num}.jsonl")
        try:
            for record in back.values():
                if record["batch_num"] == batch_num:
                    file.append(orjson.Fragment(store.encode_row(record["row"])))
            file.sync()
        finally:
            file.close()
    return len(back)


def _unreachable(prepared: Prepared, reason: str | None) -> int:
    """A new run whose endpoint never answered leaves nothing behind (only the lock, as a usage error
    does): the same command, with --base_url fixed, starts it afresh."""
    _forget(prepared)
    console.error(f"{reason}; nothing was sent or recorded. Fix --base_url (--dry_run checks it) and run the same "
                  "command again")
    return 1


def _forget(prepared: Prepared) -> None:
    """Remove what this invocation made of a new run directory."""
    if prepared.fresh:
        for child in store.entries(prepared.run_dir):
            shutil.rmtree(child) if child.is_dir() else child.unlink()


def _unmeasured(prepared: Prepared) -> int | None:
    """The exit status of a run whose spend limit could never be reached, told by the endpoint's reply to one
    tiny request (no cost, no token counts): 2, a usage error, before any prompt is paid; 1 when the endpoint
    does not answer it. A new run directory is left empty."""
    opts = prepared.opts
    probe = dry_run.probe(prepared.model, retried=True)
    refused = dry_run.unmeasured(probe.usage, opts.max_cost, opts.max_total_tokens) if not probe.problem else None
    if not (probe.problem or refused):
        return None
    _forget(prepared)
    if refused:
        console.error(refused)
        return 2
    console.error(f"the endpoint does not answer ({probe.problem}); no prompt was sent. Fix --base_url, --model or "
                  "the key (--dry_run checks them) and run the same command again")
    return 1


def _prefill(path: str | None) -> list[dict]:
    if not path:
        return []
    try:
        messages = orjson.loads(Path(path).read_bytes())
    except (OSError, orjson.JSONDecodeError) as e:
        raise UsageError(f"--prefill_messages_file {path}: {e}")
    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str)
        for m in messages)
    if not ok:
        raise UsageError(f"--prefill_messages_file {path}: must be a JSON list of {{role, content}} messages")
    return messages


def _say_what_is_wrong_with(check: dataset.DatasetCheck, opts: RunOptions) -> None:
    """Bad lines stop the run unless --skip_invalid; an empty dataset always does."""
    if check.error_count:
        shown = "\n  ".join(check.errors)
        more = f"\n  ... and {check.error_count - len(check.errors)} more" if check.error_count > len(check.errors) else ""
        if not opts.skip_invalid:
            raise UsageError(f"{check.error_count} bad line(s) in the dataset, nothing was run "
                             f"(--skip_invalid runs without them):\n  {shown}{more}")
        console.notice(f"skipping {check.error_count} bad line(s):\n  {shown}{more}")
    if check.valid == 0:
        raise UsageError(f"{opts.dataset_file}: no prompts to run")


def _look_at_run_dir(run_dir: Path, opts: RunOptions) -> tuple[resume_scan.Scan, UsageError | None]:
    """An existing run directory, locked and scanned before the dataset is read, with a refusal to use
    it kept for after the dataset's errors (a new one is made only once the dataset has passed)."""
    try:
        if not opts.dry_run:
            store.lock_run_dir(run_dir)
        return _prepare_run_dir(run_dir, opts), None
    except UsageError as e:
        return resume_scan.Scan(), e


def _make_run_dir(prepared: Prepared) -> Prepared:
    """Create and lock a new run directory; if another runner made it since we looked, look and count again."""
    store.lock_run_dir(prepared.run_dir)
    if not store.entries(prepared.run_dir):
        return prepared
    return replace(prepared, scan=_prepare_run_dir(prepared.run_dir, prepared.opts)).counted()


def _prepare_run_dir(run_dir: Path, opts: RunOptions) -> resume_scan.Scan:
    """Refuse to clobber, check a resumed run's settings, and scan what is already done."""
    exists = bool(store.entries(run_dir))
    if exists and not opts.resume and not opts.overwrite:
        raise UsageError(f"run directory {run_dir} already exists: pass --resume to continue it or --overwrite to start again")
    if not exists or opts.overwrite:
        return resume_scan.Scan()
    manifest_path = run_dir / "manifest.json"
    changed = opts.changed_since(store.read_json(manifest_path)) if manifest_path.exists() and not opts.force else []
    scan = resume_scan.scan(run_dir)
    said = f"the run's settings changed ({'; '.join(changed)})"
    if changed and resume_scan.anything_paid(run_dir, scan):
        raise UsageError(f"{said}; pass --force to resume anyway")
    if changed:  # a wrong --base_url or model name stopped the run before any reply: nothing to keep apart
        console.notice(f"{said}; nothing was paid with the old ones, so the run goes on with the new ones")
    return scan


def _dataset_change(prepared: Prepared) -> int:
    """On a resume with another dataset file, or the same file edited, say in one line what changed;
    refuse (without --force) a dataset that shares no prompt with the run. Returns how many records
    (rows and discards) belong to prompts the dataset no longer has."""
    opts, check, done = prepared.opts, prepared.check, prepared.scan.done
    in_dataset = check.valid * opts.samples_per_prompt - prepared.plan.remaining  # of the dataset's samples
    try:
        before = store.read_json(prepared.run_dir / "manifest.json").get("dataset") or {}
    except (FileNotFoundError, store.UnreadableFile):  # a new run; or --force writes it again
        before = {}
    if not done or (before.get("path"), before.get("fingerprint")) == (opts.dataset_file, check.fingerprint):
        return len(done) - in_dataset
    if not in_dataset and not opts.force:
        raise UsageError(f"{opts.dataset_file} shares no prompt with run {opts.run_name}, whose {len(done)} done "
                         f"came from {before.get('path', 'another dataset')}: pass --force to add its prompts "
                         "to this run anyway, or choose another --run_name")
    console.notice(f"the dataset changed since the last invocation: {before.get('path', 'unknown')} "
                   f"({before.get('prompts', '?')} prompts) -> {opts.dataset_file} ({check.valid} prompts), "
                   f"{in_dataset} of its samples already done; {len(done) - in_dataset} rows (and discards) of "
                   "prompts no longer in it stay in the run (statistics.json: records_not_in_dataset)")
    return len(done) - in_dataset


def _left_out(distribution: Distribution, unavailable_sets: dict[str, str], run_dir: Path,
              fresh: bool) -> tuple[str, ...]:
    """The toolsets the `default` distribution leaves out: those that cannot run here, as the run's
    first invocation found them (its manifest keeps them, so a resume samples the same toolsets).
    None when nothing could run: then the notes say why for each."""
    if distribution is not DISTRIBUTIONS["default"]:
        return ()
    if fresh:
        left_out = tuple(t for t in distribution.chances if t in unavailable_sets)
    else:  # a run begun before the default left anything out has no such list: it left out nothing
        left_out = tuple(store.read_json_or_empty(run_dir / "manifest.json").get(LEFT_OUT) or ())
    return () if len(left_out) == len(distribution.chances) else left_out


def _say_what_is_missing(prepared: Prepared) -> None:
    """Name, once, every sampled toolset or tool that cannot be offered, what the default distribution
    left out, and images the backend ignores."""
    opts, plan, unavailable_sets = prepared.opts, prepared.plan, prepared.unavailable_sets
    if prepared.left_out:
        console.notice("the default distribution leaves out what cannot run here: " + "; ".join(
            f"{t} ({unavailable_sets.get(t, 'could not run when the run began')})" for t in prepared.left_out))
    missing = [f"toolset {toolset} is unavailable ({reason}); sampled for {plan.sampled[toolset]} prompt(s)"
               for toolset, reason in unavailable_sets.items() if plan.sampled[toolset]]
    missing += [f"tool {name} is unavailable ({reason})" for name, reason in prepared.unavailable_tools.items()
                if plan.sampled[registry.REGISTRY[name].toolset]
                and registry.REGISTRY[name].toolset not in unavailable_sets]
    if missing and opts.require_toolsets:
        raise UsageError("--require_toolsets: " + "; ".join(missing))
    for line in missing:
        console.notice(f"{line}; prompts run without it (--require_toolsets makes this an error)")
    if not runs_images(opts.backend) and plan.rows_with_image:
        console.notice(f"{plan.rows_with_image} prompt(s) name a container image, which needs a container backend "
                       f"(--terminal_backend={'/'.join(b for b in BACKENDS if runs_images(b))}); "
                       f"under the {opts.backend} backend they run in its sandbox")
    if (opts.backend == "local" and not _on_cluster(opts)
            and (plan.verified or any(plan.sampled[t] for t in SANDBOX_TOOLSETS))
            and (problem := bwrap_problem())):
        if not opts.unsafe_local:
            raise UsageError(f"bubblewrap cannot run here ({problem}); install it (apt-get install bubblewrap) "
                             "or pass --unsafe_local for weaker, directory-only isolation")
        console.notice(f"bubblewrap cannot run here ({problem}); --unsafe_local: sandboxes are plain directories")
    if not _on_cluster(opts) and plan.images and (problem := runtime_problem(opts.backend)):
        raise UsageError(f"the {opts.backend} backend cannot run here: {problem}")


def _probe_mcp(prepared: Prepared, sandbox: SandboxConfig) -> tuple[ToolSpec, ...]:
    """The tools of the MCP servers the plan's prompts may call, read once; a name given twice
    stops the run naming both holders."""
    from trajgen.tools import mcp  # the SDK only when a config names servers
    opts = prepared.opts
    servers = tuple(s for s in prepared.mcp_servers if prepared.plan.sampled[s.name])
    tools = asyncio.run(mcp.probe(servers, sandbox, opts.tool_timeout, opts.allow_private_urls))
    holders = {name: f"the built-in toolset {spec.toolset}" for name, spec in registry.REGISTRY.items()}
    for tool in tools:
        if tool.name in holders:
            raise UsageError(f"--mcp_config: tool {tool.name} of MCP server {tool.toolset} clashes with "
                             f"{holders[tool.name]}'s")
        holders[tool.name] = f"MCP server {tool.toolset}"
    console.notice(", ".join(f"MCP server {s.name}: {sum(t.toolset == s.name for t in tools)} tools"
                             for s in servers))
    return tuple(tools)


def _on_cluster(opts: RunOptions) -> bool:
    """On a Ray cluster each node checks its own bubblewrap and images (trajgen/ray_executor.py), not this machine."""
    return opts.executor == "ray" and opts.ray_address is not None


def _missing_images(plan: Plan, sandbox: SandboxConfig) -> dict[str, str]:
    """Images the backend cannot use, each said once: their prompts fail and resume retries them."""
    if not plan.images:
        return {}
    found = asyncio.run(check_images(list(plan.images), sandbox))
    missing = {image: reason for image, reason in found.items() if reason}
    for image, reason in missing.items():
        console.notice(f"image {image} is unavailable ({reason}); its {plan.images[image]} prompt(s) fail and "
                       "--resume retries them")
    return missing
