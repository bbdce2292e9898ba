"""--export=skyrl: one line per sample, the fields of SkyRL's `GeneratorOutput` (skyrl-train,
skyrl_train/generators/base.py) for that sample: a batch is the lines' fields as lists."""
from __future__ import annotations

from typing import Iterable, Iterator

from trajgen.conventions import rollouts

FILE = "export_skyrl.jsonl"


def records(rows: Iterable[dict]) -> Iterator[dict]:
    for row in rows:
        meta = row["metadata"]
        for sample in rollouts.sequences(row):
            yield {"prompt_token_ids": sample.prompt_ids, "response_ids": sample.response_ids,
                   "loss_masks": [int(t) for t in sample.trained], "rollout_logprobs": sample.logprobs,
                   "rewards": rollouts.reward(row),
                   "trajectory_ids": {"instance_id": meta["group_id"], "repetition_id": meta["sample_index"]},
                   "stop_reasons": sample.finish_reason, "is_last_step": sample.last}


def next_steps(path: str) -> list[str]:
    return ["SkyRL (docs/rl.md): a GeneratorOutput from a batch of lines,",
            "  from skyrl_train.generators.base import TrajectoryID",
            f"  lines = [json.loads(line) for line in open('{path}')]",
            "  output = {key: [line[key] for line in lines] for key in lines[0]} | {'rollout_metrics': None,",
            "            'trajectory_ids': [TrajectoryID(**line['trajectory_ids']) for line in lines]}"]
