"""The live Ray worker actors of this machine's private test or bench instance, found by their title."""
from __future__ import annotations

from pathlib import Path


def actor_pids() -> list[int]:
    """The processes of the live worker actors (Ray titles them ray::_RayWorker[.method])."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(b"ray::_RayWorker"):
                pids.append(int(entry.name))
        except OSError:
            pass
    return sorted(pids)
