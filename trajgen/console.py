"""Everything the user sees: the progress bar, start-of-run notices and the summary tables."""
from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from trajgen.model import UNKNOWN


class _Stdout(Console):
    def on_broken_pipe(self) -> None:
        """The reader of stdout is gone (a `| tee` stopped with the run): what is left to say goes on
        stderr, and the run ends with its own exit status (rich's own handling exits with 1 at once)."""
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)  # so that the interpreter's last flush does not fail too
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


out = _Stdout(highlight=False)
err = Console(stderr=True, highlight=False)


SECRET_FLAGS = ("--api_key", "--vision_api_key", "--user_api_key", "--judge_api_key", "--summary_api_key")
KEY_VARIABLES = "OPENROUTER_API_KEY (or OPENAI_API_KEY)"


def invocation() -> list[str]:
    """The interpreter and the script as the user ran them, so that a printed command works pasted
    in the directory they ran it from: `python` when that is this interpreter on PATH."""
    for name in ("python", "python3"):
        found = shutil.which(name)
        if found and os.path.abspath(found) == os.path.abspath(sys.executable):
            return [name, sys.argv[0]]
    return [sys.executable, sys.argv[0]]


def resume_command() -> str:
    """The command line that continues this run, shell-quoted and without keys (it ends up in
    terminals, CI logs and shell history): the keys come from the environment or are added back."""
    args, dropped, drop_next = [], [], False
    for arg in sys.argv[1:]:
        name = "--" + arg.lstrip("-").split("=", 1)[0].replace("-", "_")
        if drop_next:
            drop_next = False
        elif name in SECRET_FLAGS:
            dropped.append(name)
            drop_next = "=" not in arg  # `--api_key KEY`: the key is the next word
        elif name not in ("--resume", "--overwrite"):
            args.append(arg)
    command = shlex.join([*invocation(), *args, "--resume"])
    if not dropped:
        return command
    ways = [f"set {KEY_VARIABLES} or give --api_key again"] if "--api_key" in dropped else []
    ways += [f"give {name} again" for name in dropped if name != "--api_key"]
    return f"{command}  # without the key: {'; '.join(ways)}"


def error(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)


def stopped(message: str, error: bool = True, failures: str = "") -> None:
    """Why the run stopped, what failed (`failures_line`), then the command that resumes it on a line
    of its own, ready to paste."""
    prefix = "[bold red]error:[/] " if error else ""
    said = f"{escape(failures)}\n" if failures else ""
    err.print(f"{said}{prefix}{escape(message)}\n  {escape(resume_command())}", soft_wrap=True)


FILTERS = (  # the merge's filters: statistics.json's count, what its rows did, the flag that keeps them
    ("filtered_no_reasoning", "had no reasoning", "--require_reasoning=False"),
    ("filtered_hallucinated", "called a tool that was not offered", "--keep_hallucinated"),
    ("filtered_not_passed", "did not pass their verify command", "--require_verified=False"),
)


def not_kept_line(stats: dict) -> str:
    """When trajectories.jsonl kept fewer than half the finished samples: why, and the flag that keeps
    them; empty otherwise. A filter acts at the merge only, so changing it costs no request."""
    finished = stats["ok"] + stats["discarded"]["total"]
    if not finished or 2 * stats["kept"] >= finished:
        return ""
    why = [f"{stats[name]} {what} ({flag} keeps them; rerun with --resume to merge again, no request)"
           for name, what, flag in FILTERS if stats.get(name)]
    why += [f"{n} discarded ({reason})" for reason, n in stats["discarded"]["by_reason"].items()]
    return f"kept {stats['kept']} of {finished}: {', '.join(why)}"


def failures_line(stats: dict, run_dir: Path) -> str:
    """How many prompts failed, why, and where they are listed; empty when none failed."""
    failed = stats["failed"]
    if not failed["total"]:
        return ""
    why = ", ".join(f"{name} {count}" for name, count in failed["by_class"].items())
    return f"{failed['total']} prompt(s) failed ({why}); each is listed with its error in {run_dir / 'failures.jsonl'}"


def eta(left: int, done: int, seconds: float) -> str:
    """Time to finish at the average pace so far: it grows while nothing comes back."""
    if not left:
        return "0:00:00"
    if not done:
        return "?"
    total = int(left * seconds / done)
    return f"{total // 3600}:{total // 60 % 60:02d}:{total % 60:02d}"


def notice(message: str) -> None:
    err.print(f"[yellow]note:[/] {escape(message)}", soft_wrap=True)


class RunProgress(Progress):
    """The progress bar, with a status line under it (the prompts retrying, and in flight)."""

    status = ""

    def get_renderables(self):
        yield from super().get_renderables()
        if self.status:
            yield Text(self.status, overflow="ellipsis", no_wrap=True)


def progress_bar() -> RunProgress:
    return RunProgress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]:.1f}/s"),
        TextColumn("[green]ok {task.fields[ok]}[/] [yellow]discarded {task.fields[discarded]}[/] "
                   "[red]failed {task.fields[failed]}[/]"),
        TimeElapsedColumn(),
        TextColumn("eta {task.fields[eta]}"),
        console=err,
        refresh_per_second=4,  # a person reads it; every redraw is CPU of the single writer
    )


def dollars(cost: float | None) -> str:
    return "n/a" if cost is None else f"${cost:.4f}"


def _rate(value: float) -> str:
    return f"{100 * value:.1f}%"


def overview_rows(stats: dict) -> list[tuple[str, str]]:
    """The run at a glance, from statistics.json: the terminal's summary and the viewer show these."""
    failed = stats["failed"]
    rows = [
        ("prompts in dataset", stats["total_prompts"]),
        ("ok (rows written)", stats["ok"]),
        ("kept in trajectories.jsonl", stats["kept"]),
        ("discarded", ", ".join(f"{k} {v}" for k, v in stats["discarded"]["by_reason"].items()) or 0),
        ("filtered (hallucinated tool)", stats["filtered_hallucinated"]),
        ("filtered (no reasoning)", stats["filtered_no_reasoning"]),
        ("filtered (verify not passed)", stats["filtered_not_passed"]),
        ("failed (resume retries)", ", ".join(f"{k} {v}" for k, v in failed["by_class"].items()) or 0),
        ("not yet run", stats["remaining_not_run"]),
        *([("rows of prompts no longer in the dataset", stats["records_not_in_dataset"])]
          if stats.get("records_not_in_dataset") else []),
        ("api calls", stats["api_calls"]),
        ("tokens prompt / completion / reasoning", tokens(stats["tokens"])),
        ("cost", dollars(stats["cost"])),
        *side_model_rows(stats),
        *latency_rows(stats),
        ("reasoning coverage", f"{stats['reasoning_statistics']['coverage_percent']}% of "
                               f"{stats['reasoning_statistics']['total_assistant_turns']} assistant turns"),
        ("duration (this run / total)",
         f"{stats['duration_seconds']:.1f} s / {stats['duration_seconds_total']:.1f} s"),
    ]
    return [(name, str(value)) for name, value in rows]


SIDE_MODELS = {"summary": "summaries", "user_simulator": "simulated user"}  # merge.SECTIONS; the judge: reward_rows


def side_model_rows(stats: dict) -> list[tuple[str, str]]:
    """What each side model cost, apart from the agent's calls; how the simulated user's episodes ended."""
    rows = []
    for section, name in SIDE_MODELS.items():
        if s := stats.get(section):
            cost = "n/a" if s["cost"] is None else f"${s['cost']:.4f}"
            rows.append((f"{name}: calls, tokens, cost", f"{s['calls']}, {tokens(s['tokens'])}, {cost}"))
    if episodes := (stats.get("user_simulator") or {}).get("ended_by"):
        rows.append(("episodes ended by", ", ".join(f"{k} {n}" for k, n in episodes.items())))
    return rows


def tokens(counts: dict) -> str:
    """Token totals as the summary shows them: n/a, never 0, when replies did not say their tokens."""
    if counts["prompt"] is None:
        unknown = counts[UNKNOWN]
        return f"n/a ({unknown} repl{'y' if unknown == 1 else 'ies'} without usage)"
    return " / ".join(str(counts[k]) for k in ("prompt", "completion", "reasoning"))


def latency_rows(stats: dict) -> list[tuple[str, str]]:
    """Seconds per reply to the first byte, to the first token, of generation (median / p95), and stalls."""
    latency = stats.get("latency") or {}
    rows = [(f"{name} median / p95", f"{s['median']:.2f} s / {s['p95']:.2f} s")
            for key, name in (("first_byte", "first byte"), ("first_token", "first token"), ("generation", "generation"))
            if (s := latency.get(key)) and s["replies"]]
    return rows + [("stalls (calls asked again)", stats.get("stalls", 0))]


def verification_rows(stats: dict) -> list[tuple[str, str]]:
    """Verdicts, pass rates and pass@k, from statistics.json; none for a run without verify commands."""
    v = stats.get("verification") or {}
    samples = v.get("samples") or {}
    if not any(n for verdict, n in samples.items() if verdict != "unverified"):
        return []
    shown = lambda rate: "n/a" if rate is None else _rate(rate)  # noqa: E731
    rows = [
        ("samples", ", ".join(f"{k} {n}" for k, n in samples.items() if n)),
        ("errors by kind", ", ".join(f"{k} {n}" for k, n in v["errors_by_kind"].items()) or "0"),
        ("pass rate over judged samples", f"{shown(v['pass_rate_samples'])} of {v['samples_judged']}"),
        ("pass rate over prompts (any sample passed)", f"{shown(v['pass_rate_prompts'])} of {v['prompts_judged']}"),
    ]
    rows += [(f"pass@{k}", f"{shown(rate)} ({v['pass_at_k_prompts'][k]} prompts)") for k, rate in v["pass_at_k"].items()]
    return rows


def reward_rows(stats: dict) -> list[tuple[str, str]]:
    """Rewards, groups and the judge (its spend and its agreement with the checks), from statistics.json;
    none for a run without rewards."""
    r, j = stats.get("rewards") or {}, stats.get("judge") or {}
    rows = []
    if r.get("samples_rewarded"):
        rows.append(("mean reward", f"{r['mean_reward']:.4f} over {r['samples_rewarded']} samples"))
    if r.get("groups"):
        rows.append(("groups with zero spread (no signal)",
                     f"{r['groups_zero_spread']} of {r['groups']} ({_rate(r['zero_spread_share'])})"))
    if j.get("calls") or j.get("rows_judged") or j.get("errors"):
        cost = dollars(j["cost"])
        per_row = "" if j["cost_per_row"] is None else f", ${j['cost_per_row']:.6f} a row"
        rows += [("judge", f"{j['rows_judged']} rows judged, {j['errors']} errors, {j['calls']} calls"),
                 ("judge tokens / cost", f"{tokens(j['tokens'])}; {cost}{per_row}")]
    if agreement := j.get("agreement"):
        kappa = "n/a" if agreement["kappa"] is None else f"{agreement['kappa']:.3f}"
        rows.append(("judge vs checks (pass/pass, pass/fail, fail/pass, fail/fail)",
                     f"{agreement['check_passed_judge_passed']}, {agreement['check_passed_judge_failed']}, "
                     f"{agreement['check_failed_judge_passed']}, {agreement['check_failed_judge_failed']}; "
                     f"kappa {kappa}"))
    return rows


def summary(stats: dict) -> None:
    """The same numbers as statistics.json, as tables."""
    overview = Table(title=f"Run {stats['run_name']}: {stats['model']}", show_header=False)
    overview.add_column(style="bold")
    overview.add_column(justify="right")
    for name, value in overview_rows(stats):
        overview.add_row(name, value)
    out.print(overview)
    tools = Table(title="Tool usage (kept rows)")
    for column in ("tool", "calls", "success", "failure", "success rate"):
        tools.add_column(column, justify="left" if column == "tool" else "right")
    for name, s in stats["tool_statistics"].items():
        if s["count"]:
            tools.add_row(name, str(s["count"]), str(s["success"]), str(s["failure"]), _rate(s["success_rate"]))
    if tools.row_count:
        out.print(tools)
    checks = verification_rows(stats) + reward_rows(stats)
    if checks:
        table = Table(title="Verification and rewards (every finished sample)", show_header=False)
        table.add_column(style="bold")
        table.add_column(justify="right")
        for name, value in checks:
            table.add_row(name, value)
        out.print(table)
