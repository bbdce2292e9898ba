"""The models beside the agent: a judge, a summarizer, a simulated user.

Each is asked through the agent's own client (retries, rate limits, the journal, the cache) and paid
like the agent's calls (the spend limits count them as they arrive), but counted apart: a row keeps
their usage under `metadata.side_usage[role]`, and its outcome's spend is the sum of all of them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from trajgen import journal
from trajgen.errors import EndpointUnreachable, FatalAPIError, SideEndpointUnreachable
from trajgen.model import Metered, ModelClient, Reply, add_usage, no_usage
from trajgen.task import ModelSettings

Role = Literal["agent", "judge", "summary", "user"]
ENDPOINT_FLAGS = {"judge": "--judge_base_url", "summary": "--summary_base_url", "user": "--user_base_url"}


def settings_for(run: ModelSettings, model: str | None, base_url: str | None, api_key: str | None) -> ModelSettings:
    """A side model's settings: the run's client settings (timeouts, retries, streaming) with its own
    model and endpoint; none of the agent's prompt, prefill, sampling or provider routing. The run's key
    goes only to the run's own endpoint (as --vision_api_key's does): another gets its own key or none."""
    same_model = model in (None, "", run.model)  # --price_per_mtok is the run's model's price
    base_url = base_url or run.base_url
    api_key = api_key or (run.api_key if base_url == run.base_url else "none")
    return replace(run, model=model or run.model, base_url=base_url, api_key=api_key,
                   system_prompt="", ephemeral_system_prompt="", prefill_messages=[], extra_body={},
                   reasoning_effort=None, temperature=None, top_p=None, max_tokens=None,
                   price_per_mtok=run.price_per_mtok if same_model else None)


class Named:
    """A side model whose endpoint's fatal errors name its role's flag: a user told that --base_url
    refuses them would look at the wrong endpoint."""

    def __init__(self, model: ModelClient, role: str, settings: ModelSettings):
        self.model, self.where = model, f"{ENDPOINT_FLAGS[role]}={settings.base_url}"

    async def complete(self, messages: list[dict], tools: list[dict], forbid_tools: bool,
                       args: dict | None = None) -> Reply:
        try:
            return await self.model.complete(messages, tools, forbid_tools, args)
        except EndpointUnreachable as e:
            raise SideEndpointUnreachable(f"{self.where} cannot be reached: {e}") from e
        except FatalAPIError as e:
            raise FatalAPIError(f"{self.where}: {e}") from e


@dataclass(frozen=True)
class SideModel:
    """One prompt's side model: `model` to ask, `paid` what its calls cost (a failed prompt counts it)."""

    model: journal.JournalModel
    paid: Metered


def side_usage(models: dict[str, SideModel]) -> dict:
    """The row's `metadata.side_usage`: per role, what was paid, replayed and how many calls were made."""
    return {role: {**side.paid.usage, "api_calls": side.model.turn, "replayed": side.model.replayed}
            for role, side in models.items()}


def paid(agent: Metered, models: dict[str, SideModel]) -> dict:
    """What a failed prompt paid: the agent's calls and every side model's."""
    total = {**agent.usage}
    for side in models.values():
        add_usage(total, side.paid.usage)
    return total


def prompt_usage(metadata: dict) -> dict:
    """What a row's prompt paid in all: the agent's usage plus every side model's, replays included
    (the scheduler subtracts them: scheduler.paid)."""
    sides = metadata.get("side_usage")
    if not sides:
        return metadata["usage"]
    total, replayed = {**no_usage(), **metadata["usage"]}, journal.empty_replayed()
    for usage in sides.values():
        add_usage(total, usage)
    for usage in (metadata["usage"], *sides.values()):
        for key, value in (usage.get("replayed") or {}).items():
            if value is not None:
                replayed[key] = (replayed[key] or 0) + value
    return {**total, "replayed": replayed}
