"""The workers' fork server: multiprocessing's, which imports the workers' modules once so that each
worker forks ready. The process pool starts it with its first worker unless the CLI already has
(modes.main), so that its imports overlap the CLI's own."""
from __future__ import annotations

import multiprocessing as mp
import signal
from multiprocessing import forkserver, resource_tracker

from trajgen.messages import STOP_SIGNALS

CONTEXT = mp.get_context("forkserver")


def start() -> None:
    """Start it unless it runs, with the stop signals blocked, which it keeps and its workers inherit
    until they have their handlers: a signal to the process group is the parent's to act on. No signal
    to this process is lost: it is delivered once the mask is back."""
    CONTEXT.set_forkserver_preload(["__main__", "trajgen.process_pool", "trajgen.worker"])
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        resource_tracker.ensure_running()  # unblocks SIGINT and SIGTERM on its way out: block them again
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
