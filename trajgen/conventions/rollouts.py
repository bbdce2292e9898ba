"""What the RL exports (skyrl, atropos, verifiers) share: a row's model calls with their token ids,
and each of its samples (`metadata.token_ids.samples`, trajgen/samples.py) as one token sequence,
position by position: the first call's prompt, then everything up to the last call's completion,
the completions marked as trained and carrying the server's logprobs."""
from __future__ import annotations

from dataclasses import dataclass

from trajgen import verify
from trajgen.conventions import openai
from trajgen.errors import UsageError


@dataclass(frozen=True)
class Call:
    """One model call of a row: its gpt turn's `tokens`, and the messages around it."""

    tokens: dict
    prompt: list[dict]  # the messages before its reply, as the row keeps them
    reply: dict


@dataclass(frozen=True)
class Sequence:
    """One sample: `prompt_ids`, then `response_ids` (the completions and the tokens between them)."""

    prompt_ids: list[int]
    response_ids: list[int]
    trained: list[bool]  # per response id: the model produced it in one of the sample's calls
    logprobs: list[float] | None  # per response id: the server's on trained ones, 0.0 elsewhere; None if retokenized
    calls: list[Call]
    last: bool  # the row's last sample

    @property
    def finish_reason(self):
        return self.calls[-1].tokens["finish_reason"]


def calls(row: dict) -> list[Call]:
    """The row's model calls; a UsageError names the way out when the run kept no token ids."""
    messages = openai.messages(row)
    found = [Call(turn["tokens"], messages[:i], messages[i])
             for i, turn in enumerate(row["conversations"]) if turn["from"] == "gpt" and "tokens" in turn]
    if not found or "samples" not in (row["metadata"].get("token_ids") or {}):
        raise UsageError(f"prompt {row['prompt_index']} has no token ids: the RL exports need a run made with "
                         "--token_ids (or --tokenizer=NAME_OR_PATH where the endpoint sends no ids)")
    return found


def sequences(row: dict) -> list[Sequence]:
    """The row's samples, each laid out over its last call's prompt + completion; a row whose ids do
    not extend within a sample (edited by hand) is refused, never exported as shifted data."""
    every = calls(row)
    samples = row["metadata"]["token_ids"]["samples"]
    out = []
    for n, sample in enumerate(samples):
        chosen = every[sample["first_turn"]:sample["last_turn"] + 1]
        if not chosen:
            raise _disagrees(row, n)
        prompt = chosen[0].tokens["prompt_ids"]
        whole = [*chosen[-1].tokens["prompt_ids"], *chosen[-1].tokens["completion_ids"]]
        trained = [False] * (len(whole) - len(prompt))
        logged = all(c.tokens["completion_logprobs"] is not None for c in chosen)
        logprobs = [0.0] * len(trained) if logged else None
        for call in chosen:
            ids, at = call.tokens["completion_ids"], len(call.tokens["prompt_ids"])
            if call.tokens["prompt_ids"] != whole[:at] or whole[at:at + len(ids)] != ids:
                raise _disagrees(row, n)
            trained[at - len(prompt):at - len(prompt) + len(ids)] = [True] * len(ids)
            if logprobs is not None:
                logprobs[at - len(prompt):at - len(prompt) + len(ids)] = call.tokens["completion_logprobs"]
        out.append(Sequence(prompt, whole[len(prompt):], trained, logprobs, chosen, n == len(samples) - 1))
    return out


def _disagrees(row: dict, n: int) -> UsageError:
    return UsageError(f"prompt {row['prompt_index']}: metadata.token_ids.samples[{n}] disagrees with the row's ids "
                      "(the row was edited?): it is not exported shifted")


def reward(row: dict) -> float | None:
    """The row's reward (issue 49's `reward` where the row has one, else its verify outcome's)."""
    return row["reward"] if "reward" in row else verify.REWARD.get(verify.Verdict(verify.status(row)))


def advantage(row: dict) -> float | None:
    """The row's advantage within its prompt group, where the run computed one (`group`)."""
    return (row.get("group") or {}).get("advantage")
