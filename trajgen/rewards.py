"""A row's reward and its group's statistics, and what the merge counts of them.

A row keeps every signal (its check's `verify`, the judge's `judge`); `reward` is the one
--reward_from chooses, or null when that one does not exist. Groups (the samples of one prompt,
--samples_per_prompt) get GRPO's advantage (reward - mean) / (std + EPSILON) with the population
std, recomputed at every merge from the rows in the batch files.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from trajgen import store, verify
from trajgen.verify import Verdict

REWARD_FROM = ("verify", "judge", "min", "mean")
EPSILON = 1e-6
PASS_SCORE = 0.5  # a judge score at least this agrees with a passed check


def signals(row: dict) -> tuple[float | None, float | None]:
    """(the check's reward, the judge's score), each None where the row has none."""
    check = verify.reward(row["verify"]) if row.get("verify") else None
    judged = (row.get("judge") or {}).get("score")
    return check, judged


def chosen(row: dict, reward_from: str) -> float | None:
    """The row's reward: `verify` takes the check's (the judge's where the row has no check), `judge` the
    judge's, `min` and `mean` need both."""
    check, judged = signals(row)
    if reward_from == "verify":
        return judged if verify.status(row) == Verdict.UNVERIFIED.value else check
    if reward_from == "judge":
        return judged
    if check is None or judged is None:
        return None
    return min(check, judged) if reward_from == "min" else (check + judged) / 2


def reward_of(row: dict) -> float | None:
    """The row's `reward`; a row written before rewards were chosen has its check's."""
    return row["reward"] if "reward" in row else chosen(row, "verify")


def group_id(row: dict) -> str:
    return row["metadata"].get("group_id") or store.row_key(row)


def spread(rewards: list[float]) -> tuple[float, float]:
    """Mean and population standard deviation."""
    mean = math.fsum(rewards) / len(rewards)
    return mean, math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))


def group(rewards: list[float], reward: float | None) -> dict:
    """A row's `group`: over its group's rewarded samples; a row without a reward has no advantage."""
    if not rewards:
        return {"size": 0, "reward_mean": None, "reward_std": None, "advantage": None}
    mean, std = spread(rewards)
    advantage = None if reward is None else (reward - mean) / (std + EPSILON)
    return {"size": len(rewards), "reward_mean": mean, "reward_std": std, "advantage": advantage}


@dataclass
class Rewards:
    """Over the rows of the batch files: the rewards (by group unless `groups` is None: a run of one
    sample per prompt, whose ten million groups would take gigabytes), the judge's rows and errors,
    and the confusion of the check's pass or fail against the judge's score."""

    groups: dict[str, list[float]] | None = field(default_factory=dict)  # group id -> its rewards
    rewarded: int = 0
    reward_sum: float = 0.0
    judged: int = 0
    judge_errors: int = 0
    confusion: Counter = field(default_factory=Counter)  # (check passed, judge passed) -> rows

    def add(self, row: dict) -> None:
        reward = reward_of(row)
        if reward is not None:
            self.rewarded += 1
            self.reward_sum += reward
            if self.groups is not None:
                self.groups.setdefault(group_id(row), []).append(reward)
        self.judged += bool(row.get("judge"))
        self.judge_errors += bool(row.get("judge_error"))
        status, score = verify.status(row), (row.get("judge") or {}).get("score")
        if score is not None and status in (Verdict.PASSED.value, Verdict.FAILED.value, Verdict.TIMEOUT.value):
            self.confusion[(status == Verdict.PASSED.value, score >= PASS_SCORE)] += 1

    def statistics(self, calls: int, tokens: dict, cost: float | None) -> dict:
        """statistics.json's `rewards` and `judge` sections; `calls`, `tokens`, `cost`: what the judge was paid
        (merge.Tally.side)."""
        several = [g for g in (self.groups or {}).values() if len(g) > 1]
        flat = sum(1 for g in several if max(g) == min(g))
        return {
            "rewards": {
                "samples_rewarded": self.rewarded,
                "mean_reward": round(self.reward_sum / self.rewarded, 6) if self.rewarded else None,
                "groups": len(several), "groups_zero_spread": flat,
                "zero_spread_share": round(flat / len(several), 4) if several else None,
            },
            "judge": {
                "calls": calls, "tokens": tokens, "cost": cost,
                "rows_judged": self.judged, "errors": self.judge_errors,
                "cost_per_row": round(cost / self.judged, 6) if cost is not None and self.judged else None,
                "agreement": agreement(self.confusion),
            },
        }


def agreement(confusion: Counter) -> dict | None:
    """The check's pass or fail against the judge's score >= PASS_SCORE: the counts and Cohen's kappa."""
    total = sum(confusion.values())
    if not total:
        return None
    counts = {f"check_{'passed' if c else 'failed'}_judge_{'passed' if j else 'failed'}": confusion[(c, j)]
              for c in (True, False) for j in (True, False)}
    observed = (confusion[(True, True)] + confusion[(False, False)]) / total
    check_pass = (confusion[(True, True)] + confusion[(True, False)]) / total
    judge_pass = (confusion[(True, True)] + confusion[(False, True)]) / total
    expected = check_pass * judge_pass + (1 - check_pass) * (1 - judge_pass)
    kappa = None if expected == 1 else round((observed - expected) / (1 - expected), 4)
    return {**counts, "rows": total, "observed_agreement": round(observed, 4), "kappa": kappa}
