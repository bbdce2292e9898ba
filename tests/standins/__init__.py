"""Local stand-ins for runtimes that cannot run here (tests only), and helpers to inspect them."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

STANDINS = Path(__file__).resolve().parent


def live_instances() -> list[str]:
    listed = subprocess.run(["apptainer", "instance", "list", "--json"], capture_output=True, text=True, check=True)
    return [i["instance"] for i in json.loads(listed.stdout)["instances"]]


def builds(env: dict[str, str]) -> list[str]:
    """Every image the stand-in has built this session, in order."""
    log = Path(env["APPTAINER_STANDIN_STATE"]) / "builds"
    return log.read_text().splitlines() if log.exists() else []
