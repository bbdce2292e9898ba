"""--models=a,b,c: the same dataset against several models in one invocation, then their comparison.

Each model is a run of its own in <output_dir>/<run_name>/<model>, resumable alone or with the
whole invocation, and the models run one after another with the same flags: each gets the full
--concurrency, and --max_cost and --max_total_tokens bound the invocation, each model getting what
the models before it left. The toolsets are sampled from the seed and the prompt's key alone, so
every model is offered the same toolsets for a prompt.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from decimal import Decimal
from pathlib import Path

from trajgen import compare_command, console, run as run_module, store
from trajgen.errors import UsageError
from trajgen.options import RunOptions, as_list, check as check_options

STOPPED, BUDGET = (130, 143), 3  # a signal (SIGINT or SIGHUP, SIGTERM); a spend limit
DEFAULT_MODEL = next(f.default for f in fields(RunOptions) if f.name == "model")
CENT_FRACTION = Decimal("1e-12")  # finer than any reported cost, coarser than a float sum's error


def directory(model: str) -> str:
    """A model's run directory name: its name with anything but letters, digits, `.`, `-` as `_`."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", model)


@dataclass(frozen=True)
class Spent:
    """What one model's run paid in this invocation."""

    model: str
    cost: Decimal
    tokens: int


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
    started = {n for n in names if store.entries(parent / n)}
    if started and not (opts.resume or opts.overwrite):
        raise UsageError(f"{parent} already holds runs of {', '.join(n for n in names if n in started)}: pass "
                         "--resume to continue them or --overwrite to start again")
    if opts.resume and not started and not opts.overwrite:
        raise UsageError(f"--resume: {parent} holds no run of these models to continue (check --run_name and "
                         "--output_dir, or leave out --resume to start them)")
    codes: list[int] = []
    spent: list[Spent] = []
    for i, (model, name) in enumerate(zip(models, names)):
        cost_left, tokens_left = _left(opts, spent)
        if (cost_left is not None and cost_left <= 0) or (tokens_left is not None and tokens_left <= 0):
            codes.append(BUDGET)
            break
        console.out.rule(f"model {i + 1} of {len(models)}: {model}{_share(opts, cost_left, tokens_left)}")
        # a model this invocation starts (never started, or the next after a stop) is a new run; the others resume
        ran = run_module.single(replace(opts, model=model, models=None, output_dir=str(parent), run_name=name,
                                        resume=opts.resume and name in started,
                                        max_cost=None if cost_left is None else float(cost_left),
                                        max_total_tokens=tokens_left))
        codes.append(ran.status)
        spent.append(Spent(model, _dollars(ran.paid_cost), ran.paid_tokens))
        if ran.status in STOPPED or ran.status == BUDGET:  # a spend limit reached cancels what was in flight
            break
    if not_started := models[len(codes):]:
        console.notice(f"not started: {', '.join(not_started)}")
    if codes[-1] in STOPPED:
        return codes[-1]
    done = [parent / n for n in names if (parent / n / "manifest.json").exists()]
    if len(done) >= 2 and not opts.dry_run:
        console.out.rule("comparison")
        compare_command.write(done, parent)
    if BUDGET in codes:
        _say_spent(opts, spent)
    return 1 if 1 in codes else BUDGET if BUDGET in codes else max(codes)


def _dollars(cost: float) -> Decimal:
    """A float sum of reported costs as the decimal it stands for: 0.001 four times is 0.004, and
    0.009 less that leaves 0.005 (in floats, 0.004999999999999999)."""
    return Decimal(repr(cost)).quantize(CENT_FRACTION)


def _left(opts: RunOptions, spent: list[Spent]) -> tuple[Decimal | None, int | None]:
    """What the invocation's limits leave for the next model, in exact decimals."""
    cost = None if opts.max_cost is None else _dollars(opts.max_cost) - sum(s.cost for s in spent)
    tokens = None if opts.max_total_tokens is None else opts.max_total_tokens - sum(s.tokens for s in spent)
    return cost, tokens


def _share(opts: RunOptions, cost_left: Decimal | None, tokens_left: int | None) -> str:
    """The limits the next model runs under, beside the invocation's as typed."""
    said = [f"${cost_left.normalize():f} of --max_cost={opts.max_cost}" if cost_left is not None else "",
            f"{tokens_left} of --max_total_tokens={opts.max_total_tokens}" if tokens_left is not None else ""]
    return f" ({' and '.join(s for s in said if s)} left)" if any(said) else ""


def _say_spent(opts: RunOptions, spent: list[Spent]) -> None:
    """The invocation's spend line: every model's share, against the limits as typed."""
    cost_left, tokens_left = _left(opts, spent)
    reached = ([f"--max_cost={opts.max_cost}"] if cost_left is not None and cost_left <= 0 else []) + (
        [f"--max_total_tokens={opts.max_total_tokens}"] if tokens_left is not None and tokens_left <= 0 else [])
    shares = "; ".join(f"{s.model} ${s.cost:.4f}, {s.tokens} tokens" for s in spent)
    console.stopped(f"stopped: {' and '.join(reached) or 'a spend limit'} reached; this invocation paid "
                    f"${sum(s.cost for s in spent):.4f}, {sum(s.tokens for s in spent)} tokens over "
                    f"{len(spent)} model(s) ({shares}). Resume with:", error=False)
