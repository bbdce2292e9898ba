"""The process the pool's workers fork from (multiprocessing's fork server), for the length of a run.

It imports the workers' modules once (a worker of its own would: 0.3 CPU-s each). This module
imports nothing of the run's, so that the CLI can start the fork server before it imports them
itself: the two imports then run side by side, and the workers are ready when the run's
preparation is done rather than 0.2 s after.

A signal sent to the runner's process group (what `timeout`, systemd and Slurm send) is the
parent's to act on: the fork server starts with the stop signals blocked and keeps them so, and
each worker it forks handles them itself (trajgen/workers.py).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
from multiprocessing import forkserver, resource_tracker
from typing import Iterator

from trajgen.options import RunOptions

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})  # each stops a run the same way


def start(opts: RunOptions) -> None:
    """Start it for a run whose workers fork from it, unless it is running. A resume may find
    nothing left to run: its fork server starts with its first worker, if any."""
    if opts.forks_workers:
        mp.get_context("forkserver").set_forkserver_preload(["__main__", "trajgen.workers"])
        if not opts.resume:
            ensure_running()


def ensure_running() -> None:
    """Start the fork server unless it runs, with the stop signals blocked, which it keeps for good
    and its workers inherit until they have their handlers. No signal to this process is lost:
    they are delivered here once the server has started."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        resource_tracker.ensure_running()  # ignores SIGINT and SIGTERM, then unblocks them here: block again
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


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
