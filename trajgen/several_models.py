"""--models=a,b,c: the same dataset against several models in one invocation, then their comparison.

Each model is a run of its own in <output_dir>/<run_name>/<model>, resumable alone or with the
whole invocation, and the models run one after another with the same flags: each gets the full
--concurrency, each its own --max_cost and --max_total_tokens. The toolsets are sampled from the
seed and the prompt's key alone, so every model is offered the same toolsets for a prompt.
"""
from __future__ import annotations

import re
from dataclasses import fields, replace
from pathlib import Path

from trajgen import compare_command, console, run as run_module
from trajgen.errors import UsageError
from trajgen.options import RunOptions, as_list, check as check_options

INTERRUPTED, BUDGET = 130, 3
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
    for i, (model, name) in enumerate(zip(models, names)):
        console.out.rule(f"model {i + 1} of {len(models)}: {model}")
        code = run_module.main(replace(opts, model=model, models=None, output_dir=str(parent), run_name=name))
        codes.append(code)
        if code == INTERRUPTED:
            if models[i + 1:]:
                console.notice(f"not started: {', '.join(models[i + 1:])}")
            return code
    done = [parent / n for n in names if (parent / n / "manifest.json").exists()]
    if len(done) >= 2 and not opts.dry_run:
        console.out.rule("comparison")
        compare_command.write(done, parent)
    return 1 if 1 in codes else BUDGET if BUDGET in codes else max(codes)
