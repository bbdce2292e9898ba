"""--dry_run: check the endpoint with one tiny request, price the run where the provider
publishes prices, and show what would run. Nothing else is spent and nothing is written."""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from dataclasses import replace

from rich.markup import escape
from rich.table import Table

from trajgen import chat_calls, console, errors, trajectory
from trajgen.plan import Plan
from trajgen.task import ModelSettings

# Per-call token counts assumed for the cost estimate (said in the output).
ASSUMED_PROMPT_TOKENS = 2000
ASSUMED_COMPLETION_TOKENS = 500
PROBE_TOKENS = 32  # enough for a reasoning model to start reasoning, or any other to finish "pong"


async def _probe(settings: ModelSettings) -> tuple[str | None, chat_calls.Completion | None]:
    """(None, the reply) when the endpoint answers a tiny request, else (why it does not, None), in
    the words the run would stop with."""
    endpoint = chat_calls.Endpoint(settings, connections=1)
    try:
        return None, await endpoint.call(chat_calls.request_body(replace(settings, max_tokens=PROBE_TOKENS),
                                                                 [{"role": "user", "content": "ping"}], None))
    except (errors.APIStatusError, errors.APIConnectionError, errors.ProviderError, errors.MalformedResponse) as e:
        cause = errors.unreachable_cause(e)
        return (f"cannot be reached: {cause}" if cause else chat_calls.unchanging(e)
                or f"does not answer ({type(e).__name__}: {getattr(e, 'message', e)})"), None
    finally:
        await endpoint.close()


def _reasoning(reply: chat_calls.Completion) -> str:
    """Whether the test reply reasoned: a model that does not would have every sample left out."""
    if trajectory.split_reasoning(reply.message)[0]:
        return "[green]in the test reply[/]"
    return "[yellow]none in the test reply[/]: samples without reasoning are not kept unless --require_reasoning=False"


def _prices(settings: ModelSettings) -> tuple[float, float] | None:
    """(USD per prompt token, per completion token) from the endpoint's /models, where it lists them (OpenRouter)."""
    try:
        request = urllib.request.Request(f"{settings.base_url.rstrip('/')}/models",
                                         headers={"Authorization": f"Bearer {settings.api_key}"})
        with urllib.request.urlopen(request, timeout=15) as response:
            listing = json.load(response)
        for model in listing.get("data", []):
            pricing = model.get("pricing") if model.get("id") == settings.model else None
            if pricing:
                return float(pricing["prompt"]), float(pricing["completion"])
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return None


def report(plan: Plan, settings: ModelSettings, batch_size: int, already_done: int) -> int:
    """Print the plan and the estimate; exit status 0 when the endpoint answered, else 1."""
    problem, reply = asyncio.run(_probe(settings))
    table = Table(title="Dry run: nothing was spent but one tiny request", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    calls_min, calls_max = plan.remaining, plan.remaining * (settings.max_turns + 1)
    rows = [
        ("endpoint", f"{settings.base_url} ({settings.model}): "
                     + (f"[red]{escape(problem)}[/]" if problem else "[green]answers[/]")),
        *([("reasoning", _reasoning(reply))] if reply else []),
        ("prompts to run", f"{plan.remaining} ({already_done} already done)"),
        ("batches", str(plan.batch_count(batch_size))),
        ("toolsets sampled", ", ".join(f"{t} {n}" for t, n in plan.sampled.most_common()) or "none"),
        ("images", ", ".join(f"{i} {n}" for i, n in plan.images.most_common()) or "none"),
        ("api calls", f"{calls_min} to {calls_max} (1 to max_turns+1 per prompt)"),
    ]
    prices = _prices(settings)
    if prices:
        per_call = prices[0] * ASSUMED_PROMPT_TOKENS + prices[1] * ASSUMED_COMPLETION_TOKENS
        rows.append(("cost estimate", f"${per_call * calls_min:.2f} to ${per_call * calls_max:.2f} at "
                                      f"~{ASSUMED_PROMPT_TOKENS} prompt + {ASSUMED_COMPLETION_TOKENS} completion tokens a call"))
    else:
        rows.append(("cost estimate", "the endpoint publishes no prices"))
    for name, value in rows:
        table.add_row(name, value)
    console.out.print(table)
    if problem:
        console.error(f"--base_url={settings.base_url} {problem}; check --base_url, --model and the key, "
                      "then run --dry_run again")
        return 1
    return 0
