"""--dry_run: check the endpoint with one tiny request, price the run where the provider
publishes prices, and show what would run. Nothing else is spent and nothing is written.

The same request (`probe`) tells, before a run spends anything, whether its spend limits can
apply: whether the endpoint reports a cost and token counts (`unmeasured`)."""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace

from rich.markup import escape
from rich.table import Table

from trajgen import chat_calls, console, errors, token_ids, trajectory
from trajgen.model import UNKNOWN, reply_usage
from trajgen.plan import Plan
from trajgen.task import ModelSettings

# Per-call token counts assumed for the cost estimate (said in the output).
ASSUMED_PROMPT_TOKENS = 2000
ASSUMED_COMPLETION_TOKENS = 500
PROBE_TOKENS = 32  # enough for a reasoning model to start reasoning, or any other to finish "pong"


@dataclass(frozen=True)
class Probe:
    """The endpoint's answer to a tiny request: why there is none, or its reply and the reply's usage."""

    problem: str | None = None
    reply: chat_calls.Completion | None = None
    usage: dict = field(default_factory=dict)


def probe(settings: ModelSettings, tokens: int = 1, retried: bool = False) -> Probe:
    """One request of `tokens`; `retried`: under the run's retry policy (before a run, whose calls would be)."""
    return asyncio.run(_probe(replace(settings, max_tokens=tokens), retried))


async def _probe(settings: ModelSettings, retried: bool) -> Probe:
    endpoint = chat_calls.Endpoint(settings, connections=1)
    ping = [{"role": "user", "content": "ping"}]
    try:
        if retried:
            completion = await chat_calls.complete(endpoint, settings, ping, None, on_throttle=lambda: None)
        else:
            body = chat_calls.request_body(settings, chat_calls.request_args(settings, ping, None))
            completion = await endpoint.call(body)
        return Probe(reply=completion, usage=reply_usage(completion.usage, settings.price_per_mtok))
    except (errors.APIStatusError, errors.APIConnectionError, errors.ProviderError, errors.MalformedResponse,
            errors.FatalAPIError) as e:
        cause = errors.unreachable_cause(e)
        return Probe(f"cannot be reached: {cause}" if cause else chat_calls.unchanging(e)
                     or f"does not answer ({type(e).__name__}: {getattr(e, 'message', e)})")
    finally:
        await endpoint.close()


@dataclass(frozen=True)
class TokenDialect:
    """What the probe found of the endpoint's token ids: the settings that ask for them, or why not
    (`status`: 1 when the endpoint does not answer, 2 when it sends no ids), in one line either way."""

    said: str
    settings: ModelSettings | None = None
    status: int = 0


def token_dialect(settings: ModelSettings) -> TokenDialect:
    """--token_ids: one tiny request asks in every dialect at once; a second one, in the dialect its
    reply spoke, goes the way every call of the run will (streamed or not; llama-server's prompt
    ids from /tokenize) and must bring ids that pass the check every reply gets."""
    first = probe(replace(settings, token_ids=token_ids.Dialect(token_ids.PROBE), stream=False), retried=True)
    if first.problem and first.problem.startswith("answered HTTP 400"):  # it refuses the fields that ask for ids
        return TokenDialect(token_ids.MISSING.format(what=f"it refused the request for them: {first.problem}"),
                            status=2)
    if first.problem:
        return TokenDialect(f"the endpoint does not answer ({first.problem}); no prompt was sent", status=1)
    kind = token_ids.kind_of(first.reply.tokens)
    if kind is None:
        return TokenDialect(token_ids.MISSING.format(what=token_ids.missing(first.reply.tokens)), status=2)
    dialect = token_ids.Dialect(kind, _version(settings))
    asking = replace(settings, token_ids=dialect, stream=settings.stream and dialect.streams)
    second = probe(asking, retried=True)
    try:
        if second.problem:
            raise errors.MalformedResponse(second.problem)
        token_ids.checked(second.reply.tokens, {})
    except errors.MalformedResponse as e:
        return TokenDialect(f"--token_ids: the endpoint speaks {kind}'s dialect but a call asking for ids fails "
                            f"({e}); use --tokenizer=NAME_OR_PATH instead, or leave --token_ids out", status=2)
    said = f"--token_ids: the endpoint sends {kind}'s token ids" + (f" (version {dialect.version})"
                                                                     if dialect.version else "")
    if settings.stream and not dialect.streams:
        said += "; SGLang refuses them on streamed calls, so every call of this run goes unstreamed"
    return TokenDialect(said, asking)


def _version(settings: ModelSettings) -> str | None:
    """The server's version where it tells it: /version (vLLM, SGLang), /props's build_info (llama-server)."""
    root = settings.base_url.rstrip("/").removesuffix("/v1")
    for path, key in (("/version", "version"), ("/props", "build_info")):
        try:
            request = urllib.request.Request(root + path, headers={"Authorization": f"Bearer {settings.api_key}"})
            with urllib.request.urlopen(request, timeout=15) as response:
                found = json.load(response).get(key)
        except (urllib.error.URLError, OSError, ValueError, AttributeError):
            continue
        if isinstance(found, str) and found:
            return found[:100]
    return None


def _reasoning(reply: chat_calls.Completion) -> str:
    """Whether the test reply reasoned: a model that does not would have every sample left out."""
    if trajectory.split_reasoning(reply.message)[0]:
        return "[green]in the test reply[/]"
    return "[yellow]none in the test reply[/]: samples without reasoning are not kept unless --require_reasoning=False"


def unmeasured(usage: dict, max_cost: float | None, max_total_tokens: int | None) -> str | None:
    """Why a spend limit could never be reached against replies like the probe's, in one line."""
    if max_total_tokens is not None and usage.get(UNKNOWN):
        return ("--max_total_tokens: the endpoint's replies carry no token counts (usage), so the limit could never "
                "apply; some servers send them with --stream=False; or leave the limit out")
    if max_cost is not None and usage.get("cost") is None:
        if usage.get(UNKNOWN):
            return ("--max_cost: the endpoint's replies carry no cost and no token counts (usage) to price, so the "
                    "limit could never apply; some servers send the counts with --stream=False; or leave the limit out")
        return ("--max_cost: the endpoint reports no cost (usage.cost: OpenRouter does, vLLM and OpenAI do not); "
                "state its prices with --price_per_mtok=INPUT,OUTPUT (dollars per million tokens), or leave the "
                "limit out")
    return None


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


def report(plan: Plan, settings: ModelSettings, batch_size: int, already_done: int, max_cost: float | None = None,
           max_total_tokens: int | None = None) -> int:
    """Print the plan and the estimate; exit status 0 when the endpoint answered, 1 when it did not, 2 when a
    spend limit could never apply to its replies."""
    answer = probe(settings, PROBE_TOKENS)
    problem, reply = answer.problem, answer.reply
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
    if refused := unmeasured(answer.usage, max_cost, max_total_tokens):
        console.error(refused)
        return 2
    return 0
