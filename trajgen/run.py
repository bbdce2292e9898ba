"""One run, in three steps: prepare (check everything, plan), execute (the scheduler over the
workers), finish (merge, statistics, exit status). `batch_runner.py` is the CLI over `main`.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import orjson

from trajgen import console, dataset, dry_run, export, fork_server, journal, local_model, merge, registry, scheduler, store
from trajgen import plan as plan_module
from trajgen.distributions import get_distribution
from trajgen.errors import UsageError
from trajgen.options import DEFAULT_BASE_URL, RunOptions, check as check_options
from trajgen.plan import SANDBOX_TOOLSETS, Plan
from trajgen.sandbox.apptainer import runtime_problem as apptainer_problem
from trajgen.sandbox.config import BACKENDS, SandboxConfig, bwrap_problem, check_images, cleanup, limit_notices, reap, runs_images
from trajgen.tools import ToolSettings
from trajgen.work import ModelSettings, Task, WorkerConfig
from trajgen.workers import ProcessPool, worker_share


@dataclass(frozen=True)
class Prepared:
    """Everything decided before the first request: the checked options, the plan, the settings."""

    opts: RunOptions
    run_dir: Path
    check: dataset.DatasetCheck
    manifest: dict
    scan: store.Scan
    model: ModelSettings
    tools: ToolSettings
    unavailable_tools: dict[str, str]
    unavailable_sets: dict[str, str]
    plan: Plan

    def tasks(self) -> Iterator[Task]:
        """The plan's prompts, streamed from the dataset (once to count, once to run)."""
        opts = self.opts
        return plan_module.tasks(str(opts.dataset_file), self.check, self.scan.done,
                                 get_distribution(opts.distribution), opts.seed, opts.batch_size, opts.max_samples,
                                 self.scan.next_batch, self.unavailable_sets, self.scan.journal,
                                 opts.samples_per_prompt, opts.toolsets_per_sample)


def main(opts: RunOptions) -> int:
    """The exit status of whatever the options ask for."""
    if opts.list_distributions:
        console.out.print(console.distributions_table())
        return 0
    if opts.export:
        return run_export(opts)
    if opts.view or opts.report:
        from trajgen.viewer import command as viewer  # the viewer's modules only when asked for
        return viewer.run(opts)
    if opts.model == local_model.NAME:
        return run_local(opts)
    return run(opts)


def run(opts: RunOptions, health_check: Callable[[], str | None] | None = None) -> int:
    """health_check: asked on every scheduler turn; a reason string stops the run like a fatal endpoint error."""
    started = time.monotonic()
    with fork_server.serving(opts):
        prepared = prepare(opts)
        sandbox = opts.sandbox_config()
        for line in limit_notices(sandbox):
            console.notice(line)
        try:
            if not opts.dry_run:  # the run directory is locked: what carries this run's tag was left by a killed runner
                reap(sandbox)
            missing_images = {} if _on_cluster(opts) else _missing_images(prepared.plan, sandbox)
            if opts.dry_run:
                return dry_run.report(prepared.plan, prepared.model, opts.batch_size, len(prepared.scan.done))
            outcome, previous = execute(prepared, sandbox, missing_images, started, health_check)
        finally:
            cleanup(sandbox)
        return finish(prepared, outcome, previous, started)  # the fork server's exit (0.1 s) after the summary


def run_local(opts: RunOptions) -> int:
    """Serve the small packaged model for the length of the run. It answers one request at a
    time, so more conversations in flight would only queue."""
    local_model.model_path()  # a clear usage error before anything starts
    if opts.concurrency > 1 or opts.num_workers != 1:
        console.notice("--model=local serves one request at a time: running with --num_workers=1 --concurrency=1")
    with local_model.serve() as server:
        return run(replace(opts, base_url=server.url, api_key="none", num_workers=1, concurrency=1),
                   health_check=server.problem)


def run_export(opts: RunOptions) -> int:
    if opts.export not in export.FORMATS:
        raise UsageError(f"--export must be one of {', '.join(export.FORMATS)}, got {opts.export!r}")
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


def prepare(opts: RunOptions) -> Prepared:
    """Check the flags, the key, the dataset and the run directory; plan; say what is missing."""
    check_options(opts)
    api_key = _api_key(opts)
    prefill = _prefill(opts.prefill_messages_file)
    check = _check_dataset(opts)
    run_dir = Path(opts.output_dir) / opts.run_name
    manifest = opts.manifest({"path": opts.dataset_file, "fingerprint": check.fingerprint, "prompts": check.valid,
                              "invalid_lines_skipped": check.error_count})
    if not opts.dry_run:
        store.lock_run_dir(run_dir)
    scan = _prepare_run_dir(run_dir, opts)
    if scan.torn:
        console.notice(f"ignored {len(scan.torn)} torn line(s) left by an interrupted run: {', '.join(scan.torn[:5])}")
    for note in scan.notes:
        console.notice(note)
    tools = opts.tool_settings(api_key)
    unavailable_tools = registry.unavailable_tools(tools)
    unavailable_sets = registry.unavailable_toolsets(unavailable_tools)
    prepared = Prepared(opts, run_dir, check, manifest, scan, opts.model_settings(api_key, prefill), tools,
                        unavailable_tools, unavailable_sets, Plan())
    prepared = replace(prepared, plan=plan_module.count(prepared.tasks(), scan.next_batch,
                                                        opts.docker_image if runs_images(opts.backend) else None))
    _say_what_is_missing(prepared)
    for line in opts.request_extras()[2]:
        console.notice(f"sending {line}")
    return prepared


def execute(prepared: Prepared, sandbox: SandboxConfig, missing_images: dict[str, str], started: float,
            health_check: Callable[[], str | None] | None) -> tuple[scheduler.RunEnd, float]:
    """Create or continue the run directory and run the plan; returns the outcome and earlier runs' seconds."""
    opts, run_dir = prepared.opts, prepared.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    if opts.overwrite:
        for child in store.entries(run_dir):
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    previous = store.read_checkpoint(run_dir).get("duration_seconds_total", 0.0)
    store.write_json(run_dir / "manifest.json", {**prepared.manifest, "updated_at": scheduler.now()})
    auto = opts.num_workers == "auto"  # Ray actors as the cluster's CPUs hold, each up to --concurrency
    config = WorkerConfig(prepared.model, sandbox, prepared.tools, prepared.unavailable_tools,
                          worker_share(opts.concurrency, 1 if auto else opts.num_workers), opts.require_reasoning,
                          opts.verbose, opts.cache_dir, opts.verify_timeout)
    workers = None if auto else min(opts.num_workers, prepared.plan.remaining)
    if opts.executor == "processes" or not prepared.plan.remaining:  # nothing to run: no worker, no Ray cluster
        pool = ProcessPool(workers or 0, config)
    else:
        from trajgen.ray_executor import make_executor
        pool = make_executor(opts.executor, workers, config, opts.ray_address, opts.worker_cpus, opts.worker_memory,
                             tuple(prepared.plan.images), opts.require_toolsets)
    limits = scheduler.Limits(opts.run_name, opts.batch_size, opts.concurrency, opts.verbose, opts.max_cost,
                              opts.max_total_tokens, health_check)
    cache = journal.Cache(opts.cache_dir) if opts.cache_dir else None
    if cache:
        cache.open()
    run = scheduler.Scheduler(prepared.plan, pool, limits, run_dir, missing_images, previous, started)
    end = run.execute(prepared.tasks(), on_exit=lambda: cleanup(sandbox))
    if cache:
        cache.trim(int(opts.cache_max_mb * 2**20))
    return end, previous


def finish(prepared: Prepared, outcome: scheduler.RunEnd, previous: float, started: float) -> int:
    """Merge, write statistics.json, show the summary; the exit status says how the run ended."""
    opts, check = prepared.opts, prepared.check
    stats = merge.merged_statistics(prepared.run_dir, opts.keep_hallucinated, opts.require_verified, {
        "run_name": opts.run_name, "model": opts.model, "distribution": opts.distribution,
        "total_prompts": check.valid, "samples_per_prompt": opts.samples_per_prompt, "batch_size": opts.batch_size,
        "remaining_not_run": outcome.not_run, "invalid_lines_skipped": check.error_count,
        "duration_seconds": round(time.monotonic() - started, 3),
        "duration_seconds_total": round(previous + time.monotonic() - started, 3),
    })
    store.write_json(prepared.run_dir / merge.STATISTICS, stats)
    console.summary(stats)
    if outcome.fatal:
        console.stopped(f"the run was stopped: {outcome.fatal}. Fix it, then resume with:")
        return 1
    if outcome.interrupted:
        console.stopped("interrupted; resume with:", error=False)
        return 130
    if outcome.budget:
        console.stopped(f"stopped: {outcome.budget}; {outcome.not_run} prompt(s) not run. Resume with:", error=False)
        return 3
    return 1 if outcome.failed else 0


def _api_key(opts: RunOptions) -> str:
    api_key = opts.api_key or os.environ.get("OPENROUTER_API_KEY") or os.environ.get("OPENAI_API_KEY")
    if api_key:
        return api_key
    if opts.base_url == DEFAULT_BASE_URL:
        raise UsageError("no API key: set OPENROUTER_API_KEY (or OPENAI_API_KEY) or pass --api_key")
    return "none"  # local servers take any key


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


def _check_dataset(opts: RunOptions) -> dataset.DatasetCheck:
    check = dataset.check(opts.dataset_file, opts.max_samples)
    if check.error_count:
        shown = "\n  ".join(check.errors)
        more = f"\n  ... and {check.error_count - len(check.errors)} more" if check.error_count > len(check.errors) else ""
        if not opts.skip_invalid:
            raise UsageError(f"{check.error_count} bad line(s) in the dataset, nothing was run "
                             f"(--skip_invalid runs without them):\n  {shown}{more}")
        console.notice(f"skipping {check.error_count} bad line(s):\n  {shown}{more}")
    if check.valid == 0:
        raise UsageError(f"{opts.dataset_file}: no prompts to run")
    return check


def _prepare_run_dir(run_dir: Path, opts: RunOptions) -> store.Scan:
    """Refuse to clobber, check a resumed run's settings, and scan what is already done."""
    exists = bool(store.entries(run_dir))
    if exists and not opts.resume and not opts.overwrite:
        raise UsageError(f"run directory {run_dir} already exists: pass --resume to continue it or --overwrite to start again")
    if not exists or opts.overwrite:
        return store.Scan()
    manifest_path = run_dir / "manifest.json"
    if manifest_path.exists() and not opts.force:
        changed = opts.changed_since(store.read_json(manifest_path))
        if changed:
            raise UsageError(f"the run's settings changed ({'; '.join(changed)}); pass --force to resume anyway")
    return store.scan(run_dir)


def _say_what_is_missing(prepared: Prepared) -> None:
    """Name, once, every sampled toolset or tool that cannot be offered, and images the backend ignores."""
    opts, plan, unavailable_sets = prepared.opts, prepared.plan, prepared.unavailable_sets
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
    if opts.backend == "apptainer" and not _on_cluster(opts) and plan.images and (problem := apptainer_problem()):
        raise UsageError(f"the apptainer backend cannot run here: {problem}")


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
