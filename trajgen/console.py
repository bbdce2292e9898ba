"""Everything the user sees: the progress bar, start-of-run notices and the summary tables."""
from __future__ import annotations

import shlex
import sys

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from trajgen.distributions import DISTRIBUTIONS, TOOLSETS

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


SECRET_FLAGS = ("--api_key", "--vision_api_key")


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
    command = shlex.join(["python", "batch_runner.py", *args, "--resume"])
    return command + (f"  # give {' and '.join(dropped)} again, or set the key's environment variable" if dropped else "")


def error(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)


def stopped(message: str, error: bool = True) -> None:
    """Why the run stopped, then the command that resumes it on a line of its own, ready to paste."""
    prefix = "[bold red]error:[/] " if error else ""
    err.print(f"{prefix}{escape(message)}\n  {escape(resume_command())}", soft_wrap=True)


def notice(message: str) -> None:
    err.print(f"[yellow]note:[/] {escape(message)}", soft_wrap=True)


def distributions_table(mcp_toolsets: tuple[str, ...] = ()) -> Table:
    """The built-in distributions; `mcp_toolsets` (a config's servers) as columns a file or --toolsets can use."""
    table = Table(title="Toolset distributions (percent chance per toolset)")
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("description")
    for toolset in TOOLSETS:
        table.add_column(toolset, justify="right")
    for toolset in mcp_toolsets:
        table.add_column(toolset, justify="right")
    for d in DISTRIBUTIONS.values():
        table.add_row(d.name, d.description, *(str(d.chances.get(t, "")) for t in (*TOOLSETS, *mcp_toolsets)))
    if mcp_toolsets:
        table.caption = (f"MCP toolsets (--mcp_config): {', '.join(mcp_toolsets)}. Offer them with --toolsets "
                         f'or a --distribution JSON file, e.g. {{"terminal": 100, "{mcp_toolsets[0]}": 80}}')
    return table


def progress_bar() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]:.1f}/s"),
        TextColumn("[green]ok {task.fields[ok]}[/] [yellow]discarded {task.fields[discarded]}[/] "
                   "[red]failed {task.fields[failed]}[/]"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=err,
        refresh_per_second=4,  # a person reads it; every redraw is CPU of the single writer
    )


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
        ("filtered (verify not passed)", stats["filtered_not_passed"]),
        ("failed (resume retries)", ", ".join(f"{k} {v}" for k, v in failed["by_class"].items()) or 0),
        ("not yet run", stats["remaining_not_run"]),
        ("api calls", stats["api_calls"]),
        ("tokens prompt / completion / reasoning",
         " / ".join(str(stats["tokens"][k]) for k in ("prompt", "completion", "reasoning"))),
        ("cost", "n/a" if stats["cost"] is None else f"${stats['cost']:.4f}"),
        ("reasoning coverage", f"{stats['reasoning_statistics']['coverage_percent']}% of "
                               f"{stats['reasoning_statistics']['total_assistant_turns']} assistant turns"),
        ("duration (this run / total)",
         f"{stats['duration_seconds']:.1f} s / {stats['duration_seconds_total']:.1f} s"),
    ]
    return [(name, str(value)) for name, value in rows]


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
    checks = verification_rows(stats)
    if checks:
        table = Table(title="Verification (every finished sample)", show_header=False)
        table.add_column(style="bold")
        table.add_column(justify="right")
        for name, value in checks:
            table.add_row(name, value)
        out.print(table)
