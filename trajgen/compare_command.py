"""--compare, and the end of a --models run: compare run directories, write comparison.json and
comparison.html, print the comparison as tables; with --view, serve it instead."""
from __future__ import annotations

from pathlib import Path

from rich.table import Table

from trajgen import compare, console, store
from trajgen.errors import UsageError
from trajgen.options import RunOptions, as_list
from trajgen.viewer import comparison

JSON, HTML = "comparison.json", "comparison.html"


def run(opts: RunOptions) -> int:
    if opts.models:
        raise UsageError("--compare compares finished runs and --models makes new ones: give one of them")
    paths = [run for p in as_list(opts.compare) for run in runs_in(Path(p))]
    if opts.view:
        found, runs = compare.compare(paths)
        return comparison.serve(found, runs, opts.view_port)
    write(paths, Path(opts.compare_out or "."))
    return 0


def runs_in(path: Path) -> list[Path]:
    """The run directory `path`, or the runs of a --models invocation in it (in its order)."""
    if not path.is_dir():
        raise UsageError(f"--compare {path}: no such run directory")
    if (path / "manifest.json").exists() or not (path / JSON).exists():
        return [path]
    return [path / Path(run["run_dir"]).name for run in store.read_json(path / JSON).get("runs", [])]


def write(paths: list[Path], out: Path) -> dict:
    """Compare, write both files into `out`, print the tables; returns comparison.json's content."""
    found, runs = compare.compare(paths)
    out.mkdir(parents=True, exist_ok=True)
    store.write_json(out / JSON, found)
    store.atomic_write(out / HTML, comparison.comparison_page(found, runs).encode())
    show(found)
    console.out.print(f"wrote {out / JSON} and {out / HTML}")
    return found


def show(found: dict) -> None:
    """The comparison as rich tables: the figures per run, then each pair."""
    for warning in found["warnings"]:
        console.notice(warning)
    figures = found["runs"]
    for i, run in enumerate(figures):  # whole, whatever the width: the table's columns are only numbered
        console.out.print(f"{comparison.run_label(i, run)} (model {run['model']})", markup=False, highlight=False,
                          soft_wrap=True)
    table = Table(title=f"Comparison over {found['shared_prompts']} shared prompts")
    table.add_column("", no_wrap=True)
    for i in range(len(figures)):
        table.add_column(str(i), justify="right", overflow="fold")  # a long model name wraps, never cut
    for label, cells in comparison.figure_rows(figures):
        table.add_row(label, *cells)
    console.out.print(table)
    for pair in found["pairs"]:
        console.out.print(comparison.pair_label(pair, figures), markup=False, highlight=False, soft_wrap=True)
        paired = Table(show_header=False)
        paired.add_column(style="bold", overflow="fold")
        paired.add_column(justify="right", overflow="fold")
        for label, value in comparison.pair_rows(pair):
            paired.add_row(label, value)
        console.out.print(paired)
        if pair["note"]:
            console.notice(pair["note"])
