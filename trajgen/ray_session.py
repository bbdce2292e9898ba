"""Ray for one run: a cluster joined, or a private local instance started, and left as it was found."""
from __future__ import annotations

import logging
import math
import os
import secrets
import shutil
import signal
import tempfile
from typing import Any

import ray

LOCAL_TOKEN = secrets.token_hex(32)  # a local instance's auth token: one per process, as Ray caches the first it reads
# the actors run asyncio's own event loop, as the pool's workers do, not uvloop (Ray's choice wherever it is
# installed): uvloop starts each process with fork() and runs Python's after-fork hooks in the child, costly in
# a large threaded actor, and able to hang it for good (a child waiting for a lock another thread held at the fork).
# A private instance's actors inherit it from this process, so they start in the workers Ray has already
# started (sooner than workers made for a runtime environment); a cluster's actors get it from theirs.
ACTOR_ENV = {"RAY_USE_UVLOOP": "0"}


class RaySession:
    """The connection to Ray, and what a private instance changed here (its files, our environment)."""

    def __init__(self) -> None:
        self.temp_dir: str | None = None  # Ray's session files, for an instance we started
        self.saved_env: dict[str, str | None] = {}  # variables to restore after a local instance

    def connect(self, address: str | None, cpus_needed: float) -> None:
        """Join `address`, or start a private local instance: on loopback only, its files in a temp dir,
        room for `cpus_needed` whatever the core count, token auth with a fresh token in the
        environment (nothing written to ~/.ray; Ray turns token auth on itself, before it reads the mode),
        no usage statistics sent to Ray's makers (on by default, even without the dashboard), and the
        actors' environment (ACTOR_ENV) in ours, for the processes Ray starts to inherit.
        The actors print nothing (their events carry the logs), so nothing streams their output here."""
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        options: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING,
                                   "log_to_driver": False}
        if address is None:
            self.temp_dir = tempfile.mkdtemp(prefix="trajgen-ray-")
            ours = {"RAY_AUTH_TOKEN": LOCAL_TOKEN, "RAY_USAGE_STATS_ENABLED": "0", **ACTOR_ENV}
            self.saved_env = {name: os.environ.get(name) for name in ("RAY_AUTH_MODE", *ours)}
            for name, value in ours.items():
                os.environ.setdefault(name, value)
            logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
            cpus = max(os.cpu_count() or 1, math.ceil(cpus_needed))
            options.update(address="local", num_cpus=cpus, _temp_dir=self.temp_dir, _node_ip_address="127.0.0.1")
        else:
            options["address"] = address
        try:
            ray.init(**options)
        finally:
            for sig, handler in handlers.items():  # ray.init takes SIGTERM; the parent owns the signals
                signal.signal(sig, handler)

    def disconnect(self) -> None:
        """Leave Ray (stopping it if we started it) and put our environment back."""
        ray.shutdown()
        for name, value in self.saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self.saved_env = {}
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None
