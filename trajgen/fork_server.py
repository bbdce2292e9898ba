"""The process the pool's workers fork from (multiprocessing's fork server), for the length of a run.

It imports the workers' modules once (a worker of its own would: 0.3 CPU-s each). This module
imports nothing of the run's, so that the CLI can start the fork server before it imports them
itself: the two imports then run side by side, and the workers are ready when the run's
preparation is done rather than 0.2 s after.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
from multiprocessing import forkserver
from typing import Iterator

from trajgen.options import RunOptions


def start(opts: RunOptions) -> None:
    """Start it for a run whose workers fork from it, unless it is running. A resume may find
    nothing left to run: its fork server starts with its first worker, if any."""
    if opts.forks_workers:
        mp.get_context("forkserver").set_forkserver_preload(["__main__", "trajgen.workers"])
        if not opts.resume:
            forkserver.ensure_running()


@contextlib.contextmanager
def serving(opts: RunOptions) -> Iterator[None]:
    """Stopped with the run, so that no process of the run outlives it and its workers' CPU
    counts as the run's (getrusage, `time`)."""
    start(opts)
    try:
        yield
    finally:
        if opts.forks_workers:
            forkserver._forkserver._stop()  # multiprocessing has no public call for this; CPython's tests use it
