"""Named toolset distributions and the per-prompt sampler.

Each distribution gives every toolset an independent chance of being offered to a prompt.
Sampling is seeded per prompt (run seed + prompt identity), so a rerun or a resume draws the
same toolsets and worker processes never share one random stream.
"""
from __future__ import annotations

import json
import os
import random
from collections.abc import Collection
from dataclasses import dataclass, replace

from trajgen.suggest import did_you_mean

TOOLSETS = ("web", "vision", "image_gen", "terminal", "file", "browser")


@dataclass(frozen=True)
class Distribution:
    name: str
    description: str
    chances: dict[str, int]  # toolset -> percent chance of being offered


def _d(name: str, description: str, **chances: int) -> Distribution:
    return Distribution(name, description, chances)


DISTRIBUTIONS: dict[str, Distribution] = {
    d.name: d
    for d in [
        _d("default", "all tools that can run here, always",
           web=100, vision=100, image_gen=100, terminal=100, file=100, browser=100),
        _d("image_gen", "image generation with vision and web", image_gen=90, vision=90, web=55, terminal=45),
        _d("research", "web research with vision", web=90, browser=70, vision=50, terminal=10),
        _d("science", "research with web, terminal, file, browser",
           web=94, terminal=94, file=94, vision=65, browser=50, image_gen=15),
        _d("development", "terminal and file, occasional web", terminal=80, file=80, web=30, vision=10),
        _d("safe", "everything but the terminal", web=80, browser=70, vision=60, image_gen=60),
        _d("balanced", "all equally", web=50, vision=50, image_gen=50, terminal=50, file=50, browser=50),
        _d("minimal", "web only", web=100),
        _d("terminal_only", "terminal and file", terminal=100, file=100),
        _d("terminal_web", "terminal and file with web", terminal=100, file=100, web=100),
        _d("creative", "image generation and vision", image_gen=90, vision=90, web=30),
        _d("reasoning", "research-heavy, few tools", web=90, file=60, terminal=20),
        _d("browser_use", "browser with search and vision", browser=100, web=80, vision=70),
        _d("browser_only", "browser only", browser=100),
        _d("browser_tasks", "browser-focused", browser=97, vision=12, terminal=15),
        _d("terminal_tasks", "terminal-focused",
           terminal=97, file=97, web=97, browser=75, vision=50, image_gen=10),
        _d("mixed_tasks", "browser, terminal, file", browser=92, terminal=92, file=92, web=35, vision=15, image_gen=15),
    ]
}


def check(distribution: Distribution, known: tuple[str, ...]) -> None:
    """ValueError (one line) unless every entry is a known toolset with a chance in 1..100."""
    for toolset, percent in distribution.chances.items():
        if toolset not in known:
            raise ValueError(unknown_toolset(toolset, known))
        if type(percent) is not int or not 0 < percent <= 100:
            raise ValueError(f"{toolset}={percent!r}: chances are integers 1 to 100")


def unknown_toolset(name: str, known: tuple[str, ...]) -> str:
    """Why `name` is no toolset: a misspelling, or an MCP server without (or not in) the --mcp_config."""
    servers = [k for k in known if k not in TOOLSETS]
    near = did_you_mean(name, known)
    if near:
        return f"unknown toolset {name!r}{near} (toolsets: {', '.join(known)})"
    if not servers:
        return f"unknown toolset {name!r}: MCP servers need --mcp_config (built-in toolsets: {', '.join(TOOLSETS)})"
    return (f"unknown toolset {name!r}: neither built in ({', '.join(TOOLSETS)}) nor a server of --mcp_config "
            f"({', '.join(servers)})")


for _builtin in DISTRIBUTIONS.values():
    check(_builtin, TOOLSETS)


def get_distribution(name: str) -> Distribution:
    if name not in DISTRIBUTIONS:
        raise KeyError(_unknown_distribution(name))
    return DISTRIBUTIONS[name]


def _unknown_distribution(name: str) -> str:
    return (f"unknown distribution {name!r}{did_you_mean(name, DISTRIBUTIONS)} "
            f"(valid: {', '.join(DISTRIBUTIONS)}, or a JSON file)")


def resolve(name: str, toolsets: list[str], known: tuple[str, ...]) -> Distribution:
    """What the run samples: exactly `toolsets` when given, else a named distribution or a JSON
    file of {toolset: percent}, checked against `known` (built-in and MCP toolsets); ValueError else."""
    if toolsets:
        wanted = Distribution("--toolsets", "the toolsets given", {t: 100 for t in toolsets})
        check(wanted, known)
        return wanted
    if name in DISTRIBUTIONS:
        return DISTRIBUTIONS[name]
    if not name.endswith(".json") and not os.path.isfile(name):
        raise ValueError(_unknown_distribution(name))
    try:
        with open(name, "rb") as f:
            chances = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"distribution {name}: {getattr(e, 'strerror', None) or e}") from None
    if not isinstance(chances, dict) or not chances:
        raise ValueError(f'distribution {name}: must be a non-empty JSON object of toolset chances, e.g. {{"terminal": 100, "git": 50}}')
    loaded = Distribution(name, "from a file", chances)
    try:
        check(loaded, known)
    except ValueError as e:
        raise ValueError(f"distribution {name}: {e}") from None
    return loaded


def without(distribution: Distribution, left_out: Collection[str]) -> Distribution:
    """`distribution` never offering the `left_out` toolsets."""
    return replace(distribution, chances={t: p for t, p in distribution.chances.items() if t not in left_out})


def sample_toolsets(distribution: Distribution, seed: int, prompt_key: str) -> list[str]:
    """Flip each toolset independently; if none came up, offer the most probable one."""
    rng = random.Random(f"{seed}:{prompt_key}")
    chosen = [t for t, percent in distribution.chances.items() if rng.random() * 100 < percent]
    if not chosen:
        chosen = [max(distribution.chances, key=distribution.chances.__getitem__)]
    return chosen
