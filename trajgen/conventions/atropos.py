"""--export=atropos: one line per prompt group (every sample of every row of a prompt), an Atropos
`ScoredDataGroup` (atroposlib 0.4.0, atroposlib/envs/base.py) with all its keys, as its trainer
reads the groups an environment sends. A group is written once it holds as many rows as its `group.size`
says (issue 49's reward groups), so only groups still open are held in memory; the others at the end."""
from __future__ import annotations

from typing import Iterable, Iterator

from trajgen.conventions import rollouts

FILE = "export_atropos.jsonl"
NOT_TRAINED = -100  # the mask where no loss is taken (elsewhere the mask is the token id)
NO_LOGPROB = 1.0  # inference_logprobs where not trained, as Atropos pads them


def records(rows: Iterable[dict]) -> Iterator[dict]:
    open_groups: dict[str, list[dict]] = {}
    for row in rows:
        rollouts.calls(row)  # refuses a row without ids before it is held
        group = open_groups.setdefault(row["metadata"]["group_id"], [])
        group.append(row)
        if len(group) == (row.get("group") or {}).get("size"):
            yield group_record(open_groups.pop(row["metadata"]["group_id"]))
    yield from map(group_record, open_groups.values())


def group_record(rows: list[dict]) -> dict:
    members = [(row, sample) for row in rows for sample in rollouts.sequences(row)]
    tokens = [[*s.prompt_ids, *s.response_ids] for _, s in members]
    advantages = [rollouts.advantage(row) for row, _ in members]
    logged = all(s.logprobs is not None for _, s in members)
    return {
        "tokens": tokens,
        "masks": [[NOT_TRAINED] * len(s.prompt_ids) + [t if trained else NOT_TRAINED
                                                       for t, trained in zip(s.response_ids, s.trained)]
                  for _, s in members],
        "scores": [rollouts.reward(row) for row, _ in members],
        "advantages": [[a] * len(t) for a, t in zip(advantages, tokens)] if None not in advantages else None,
        "ref_logprobs": None,
        "messages": [[{**m, "reward": None} for m in (*s.calls[-1].prompt, s.calls[-1].reply)] for _, s in members],
        "generation_params": members[0][1].calls[0].tokens.get("sampling"),
        "inference_logprobs": [[NO_LOGPROB] * len(s.prompt_ids)
                               + [p if trained else NO_LOGPROB for p, trained in zip(s.logprobs, s.trained)]
                               for _, s in members] if logged else None,
        "group_overrides": None, "overrides": None, "images": None,
        "distill_token_ids": None, "distill_logprobs": None,
    }


def next_steps(path: str) -> list[str]:
    return ["Atropos (docs/rl.md): each line is one ScoredDataGroup; send them to the trainer's API as environments do",
            f"  for line in open('{path}'):",
            "      requests.post('http://localhost:8000/scored_data', json=json.loads(line)).raise_for_status()",
            "rows nothing judged have null scores, which Atropos refuses: --export_outcome=passed,failed,timeout"]
