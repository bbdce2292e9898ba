"""--view and --report: check the flags, index the run directory once, then serve or write."""
from __future__ import annotations

from pathlib import Path

from trajgen import console, store
from trajgen.errors import UsageError
from trajgen.options import RunOptions
from trajgen.viewer import render, server
from trajgen.viewer.index import RunIndex
from trajgen.viewer.summary import not_kept, summarize


def run(opts: RunOptions) -> int:
    if opts.view and opts.report:
        raise UsageError("--view and --report: give one of them")
    flag = "--view" if opts.view else "--report"
    if opts.run_name is None:
        raise UsageError(f"{flag} needs --run_name (the run to look at)")
    if not 0 <= opts.view_port <= 65535:
        raise UsageError(f"--view_port must be a port number from 0 to 65535, got {opts.view_port!r}")
    run_dir = Path(opts.output_dir) / opts.run_name
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir}: no such run directory")
    index = RunIndex(run_dir)
    with console.err.status(f"indexing {run_dir}"):
        index.refresh()
    if opts.view:
        return server.serve(index, opts.view_port)
    target = run_dir / "report.html"
    store.atomic_write(target, render.report_html(summarize(index), not_kept(index)).encode())
    console.out.print(f"wrote {target}")
    return 0
