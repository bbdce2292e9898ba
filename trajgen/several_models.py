"""--models=a,b,c: the same dataset against several models in one invocation, then their comparison.

Each model is a run of its own in <output_dir>/<run_name>/<model>, resumable alone or with the
whole invocation, and the models run one after another with the same flags: each gets the full
--concurrency, and --max_cost and --max_total_tokens bound the invocation, each model getting what
the models before it left. The toolsets are sampled from the seed and the prompt's key alone, so
every model is offered the same toolsets for a prompt.
"""
from __future__ import annotations

import re
from dataclasses import fields, replace
from itertools import chain
from pathlib import Path

from trajgen import compare_command, console, run as run_module, store
from trajgen.scheduler import paid
from trajgen.errors import UsageError
from trajgen.options import RunOptions, as_list, check as check_options

STOPPED, BUDGET = (130, 143), 3  # a signal (SIGINT or SIGHUP, SIGTERM); a spend limit
DEFAULT_MODEL = next(f.default for f in fields(RunOptions) if f.name == "model")


def directory(model: str) -> str:
    """A model's run directory name: its name with anything but letters, digits, `.`, `-` as `_`."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", model)


def run(opts: RunOptions) -> int:
    models = as_list(opts.models)
    check_options(opts)
    if opts.model != DEFAULT_MODEL:
        raise UsageError("--model and --models: give one of them")
    if len(models) < 2 or len(set(models)) < len(models):
        raise UsageError(f"--models needs two or more different models, comma-separated; got {opts.models!r}")
    names = [directory(m) for m in models]
    if len(set(names)) < len(names):
        raise UsageError(f"--models: two models share a directory name ({', '.join(names)})")
    parent = Path(opts.output_dir) / opts.run_name
    if (parent / "manifest.json").exists():
        raise UsageError(f"{parent} is a run of one model; give --models runs a --run_name of their own")
    existing = [n for n in names if (parent / n).is_dir() and any((parent / n).iterdir())]
    if existing and not (opts.resume or opts.overwrite):
        raise UsageError(f"{parent} already holds runs of {', '.join(existing)}: pass --resume to continue them "
                         "or --overwrite to start again")
    codes: list[int] = []
    cost_left, tokens_left = opts.max_cost, opts.max_total_tokens
    for i, (model, name) in enumerate(zip(models, names)):
        if (cost_left is not None and cost_left <= 0) or (tokens_left is not None and tokens_left <= 0):
            console.notice(f"the spend limit is reached; not started: {', '.join(models[i:])}")
            codes.append(BUDGET)
            break
        console.out.rule(f"model {i + 1} of {len(models)}: {model}")
        limited = cost_left is not None or tokens_left is not None
        before = spent(parent / name) if limited else (0.0, 0)
        code = run_module.main(replace(opts, model=model, models=None, output_dir=str(parent), run_name=name,
                                       max_cost=cost_left, max_total_tokens=tokens_left))
        codes.append(code)
        if limited:
            after = spent(parent / name)
            cost_left = None if cost_left is None else cost_left - (after[0] - before[0])
            tokens_left = None if tokens_left is None else tokens_left - (after[1] - before[1])
        if code in STOPPED or code == BUDGET:  # a spend limit reached cancels what was in flight: the rest waits
            if models[i + 1:]:
                console.notice(f"not started: {', '.join(models[i + 1:])}")
            if code in STOPPED:
                return code
            break
    done = [parent / n for n in names if (parent / n / "manifest.json").exists()]
    if len(done) >= 2 and not opts.dry_run:
        console.out.rule("comparison")
        compare_command.write(done, parent)
    return 1 if 1 in codes else BUDGET if BUDGET in codes else max(codes)


def spent(run_dir: Path) -> tuple[float, int]:
    """(dollars, tokens) paid for the records of a run directory, counted as the scheduler counts
    them: before and after a model's run, the difference is what that run spent."""
    if not run_dir.is_dir():
        return 0.0, 0
    rows = (row for _, path in store.batch_files(run_dir) for _, row in store.read_lines(path, []))
    discarded = ((r.get("row") or {}) for r in store.read_records(run_dir / store.DISCARDED, []))
    usages = chain(((row.get("metadata") or {}).get("usage") for row in chain(rows, discarded)),
                   (r.get("usage") for r in store.read_records(run_dir / store.FAILURES, [])))
    cost, tokens = 0.0, 0
    for usage in usages:
        one = paid({"prompt_tokens": 0, "completion_tokens": 0, **(usage or {})})
        cost, tokens = cost + one[0], tokens + one[1]
    return cost, tokens
