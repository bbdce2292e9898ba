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
COST_QUANTUM = Decimal("1e-12")  # dollars: finer than any reported cost, coarser than a float sum's error


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
        if any(spent_out for _, _, spent_out in _limits(opts, cost_left, tokens_left)):
            break
        console.out.rule(f"model {i + 1} of {len(models)}: {model}{_share(opts, cost_left, tokens_left)}")
        # with --resume, a model that has a run directory continues it and one never started starts
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
    if codes and codes[-1] in STOPPED:
        return codes[-1]
    done = [parent / n for n in names if (parent / n / "manifest.json").exists()]
    if len(done) >= 2 and not opts.dry_run:
        console.out.rule("comparison")
        compare_command.write(done, parent)
    budget = BUDGET in codes or bool(not_started)  # after a signal it has returned: a spend limit stopped it
    if budget:
        _say_spent(opts, spent)
    return 1 if 1 in codes else BUDGET if budget else max(codes)


def _dollars(cost: float) -> Decimal:
    """A float sum of reported costs as the decimal it stands for: 0.001 four times is 0.004, and
    0.009 less that leaves 0.005 (in floats, 0.004999999999999999)."""
    return Decimal(repr(cost)).quantize(COST_QUANTUM)


def _left(opts: RunOptions, spent: list[Spent]) -> tuple[Decimal | None, int | None]:
    """What the invocation's limits leave for the next model, in exact decimals."""
    cost = None if opts.max_cost is None else _dollars(opts.max_cost) - sum(s.cost for s in spent)
    tokens = None if opts.max_total_tokens is None else opts.max_total_tokens - sum(s.tokens for s in spent)
    return cost, tokens


def _limits(opts: RunOptions, cost_left: Decimal | None, tokens_left: int | None) -> list[tuple[str, str, bool]]:
    """Each limit given, as typed (`--max_cost=0.009`), what it leaves (`$0.005`), and whether it is reached."""
    limits = []
    if cost_left is not None:
        limits.append((f"--max_cost={_dollars(opts.max_cost).normalize():f}", f"${cost_left.normalize():f}",
                       cost_left <= 0))
    if tokens_left is not None:
        limits.append((f"--max_total_tokens={opts.max_total_tokens}", str(tokens_left), tokens_left <= 0))
    return limits


def _share(opts: RunOptions, cost_left: Decimal | None, tokens_left: int | None) -> str:
    """The limits the next model runs under, beside the invocation's."""
    limits = _limits(opts, cost_left, tokens_left)
    return f" ({' and '.join(f'{left} of {limit}' for limit, left, _ in limits)} left)" if limits else ""


def _say_spent(opts: RunOptions, spent: list[Spent]) -> None:
    """The invocation's spend line: the limits reached as typed, every model's share, the total."""
    cost_left, tokens_left = _left(opts, spent)
    reached = [limit for limit, _, spent_out in _limits(opts, cost_left, tokens_left) if spent_out]
    shares = "; ".join(f"{s.model} ${s.cost:.4f}, {s.tokens} tokens" for s in spent)
    console.stopped(f"stopped: {' and '.join(reached) or 'a spend limit'} reached; this invocation paid "
                    f"${sum(s.cost for s in spent):.4f}, {sum(s.tokens for s in spent)} tokens"
                    f"{f' over {len(spent)} model(s) ({shares})' if spent else ''}. Resume with:", error=False)
