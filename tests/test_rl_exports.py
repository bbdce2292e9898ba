"""The RL exports (skyrl, atropos, verifiers) follow the server's tokens position by position, and
statistics.json counts the samples and their breaks.

One whole run in process (tests/support/inline.py) against the scripted server, two samples of each
prompt; its rows are then given token ids as a server shaped like vLLM would have sent them (the
runner's own --token_ids is issue 48's part A): each character one token, a completion's characters
as "model" ids (>= MODEL) whose logprob is a function of the id, so that which positions are trained
and what logprob each carries can be read off the exported ids alone. One row's second call drops
the start of its first completion (a template leaving out reasoning): a second sample. A resume merges
the rows again, then each export is written by the CLI's own code.

The packages' types could not be loaded here: atroposlib 0.4.0 and verifiers 0.4.0 install without
torch but bring ~30 packages into the shared environment (verifiers downgrades mcp), and skyrl-train
needs Python 3.12 (skyrl 0.3.0 pulls torch and CUDA). The records are checked against the types'
source instead:
- SkyRL `GeneratorOutput`: NovaSky-AI/SkyRL skyrl-train/skyrl_train/generators/base.py (commit 297e467);
- Atropos `ScoredDataGroup`: atroposlib 0.4.0 atroposlib/envs/base.py (a TypedDict that pydantic, as
  Atropos's API server validates it, requires every key of);
- verifiers `TrajectoryStep` and `TrajectoryStepTokens`: verifiers 0.3.1 verifiers/legacy/types.py.
"""
from __future__ import annotations

import pytest
import orjson

from tests.conftest import read_jsonl, write_jsonl
from trajgen import samples, store

MODEL = 1_000_000  # ids at and above it are the model's own tokens (completions)
PROMPTS = {"use a tool": "tools", "just answer": "plain"}
SCRIPT = {"prompts": {
    "use a tool": [{"content": "look", "reasoning": "a tool tells",
                    "tool_calls": [{"name": "terminal", "arguments": {"command": "echo hi"}}]},
                   {"content": "it said hi", "reasoning": "done"}],
    "just answer": [{"content": "an answer", "reasoning": "easy"}],
}}
BROKEN = ("tools", 1)  # the row (dataset id, sample) whose second call drops two ids of its first completion
SKYRL = {"prompt_token_ids", "response_ids", "rewards", "loss_masks", "stop_reasons", "rollout_metrics",
         "rollout_logprobs", "trajectory_ids", "is_last_step", "sampling_masks"}  # GeneratorOutput
ATROPOS = {"tokens", "masks", "scores", "advantages", "ref_logprobs", "messages", "generation_params",
           "inference_logprobs", "group_overrides", "overrides", "images", "distill_token_ids", "distill_logprobs"}
VERIFIERS_STEP = {"prompt", "completion", "response", "tokens", "reward", "advantage", "is_truncated",
                  "trajectory_id", "extras"}
VERIFIERS_TOKENS = {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "completion_logprobs",
                    "overlong_prompt", "is_truncated", "routed_experts"}


def logprob(token: int) -> float:
    return -(token - MODEL) / 1000


def _text(text: str, model: bool = False) -> list[int]:
    return [ord(c) + (MODEL if model else 0) for c in text]


def _said(message: dict) -> str:
    return (message.get("content") or "") + orjson.dumps(message.get("tool_calls") or []).decode() + "</>"


def _message(message: dict) -> list[int]:
    if message["role"] == "assistant":
        return _text("<assistant>") + _text(_said(message), model=True)
    return _text(f"<{message['role']}>{message['content']}</>")


def _key(row: dict) -> tuple[str, int]:
    return row["metadata"]["id"], row["metadata"]["sample_index"]


def _with_token_ids(row: dict) -> dict:
    """The row as a vLLM-shaped server's ids would have made it: each call's prompt is the messages
    before its reply, then `<assistant>`; its completion the reply."""
    turns = row["conversations"]
    calls = [i for i, t in enumerate(turns) if t["from"] == "gpt"]
    for n, i in enumerate(calls):
        prompt = [t for turn in turns[:i] for t in _message(turn["message"])] + _text("<assistant>")
        if _key(row) == BROKEN and n == 1:
            first = sum(len(_message(turn["message"])) for turn in turns[:calls[0]]) + len("<assistant>")
            prompt = prompt[:first] + prompt[first + 2:]
        completion = _text(_said(turns[i]["message"]), model=True)
        turns[i]["tokens"] = {"prompt_ids": prompt, "prompt_source": "server", "completion_ids": completion,
                              "completion_source": "server", "completion_logprobs": [logprob(t) for t in completion],
                              "finish_reason": row["metadata"]["finish_reasons"][n],
                              "sampling": {"temperature": 0.7, "top_p": 1.0, "max_tokens": 512}}
    return row


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from tests.support.inline import Inline
    from tests.support.scripted_server import start_server

    tmp = tmp_path_factory.mktemp("rl")
    inline = Inline(tmp)
    server = start_server(SCRIPT)
    try:
        write_jsonl(tmp / "prompts.jsonl", [{"prompt": p, "id": i} for p, i in PROMPTS.items()])
        args = inline.args(server, samples_per_prompt=2, max_turns=3)
        done = inline.run(*args)
        assert done.returncode == 0, done.stderr
        plain = inline.run("--export=skyrl", "--run_name=run")  # the rows have no ids yet
        for _, path in store.batch_files(inline.run_dir()):
            rows = [_with_token_ids(row) for row in read_jsonl(path)]
            for row in rows:
                row["metadata"]["token_ids"] = {"server": {"kind": "vllm", "version": "0.11.0"}, "tokenizer": None,
                                                "logprob_mode": "server", "drift_turns": 0,
                                                **samples.fields([t["tokens"] for t in row["conversations"]
                                                                  if "tokens" in t])}
                if row["metadata"]["id"] == "tools":  # rewards and groups as issue 49 writes them
                    row["reward"] = float(row["metadata"]["sample_index"] == 0)
                    row["group"] = {"size": 2, "reward_mean": 0.5, "reward_std": 0.5,
                                    "advantage": 1.0 if row["reward"] else -1.0}
            write_jsonl(path, rows)
        resumed = inline.run(*args, "--resume")
        assert resumed.returncode == 0, resumed.stderr
        for fmt in ("skyrl", "atropos", "verifiers"):
            exported = inline.run(f"--export={fmt}", "--run_name=run")
            assert exported.returncode == 0, exported.stderr
        yield inline, plain
    finally:
        server.stop()


def _rows(inline) -> dict[tuple[str, int], dict]:
    return {_key(row): row for row in read_jsonl(inline.run_dir() / "trajectories.jsonl")}


def _calls(row: dict) -> list[dict]:
    return [t["tokens"] for t in row["conversations"] if "tokens" in t]


def test_rows_without_token_ids_are_refused_in_one_line(run):
    inline, plain = run
    assert plain.returncode == 2
    assert "--token_ids" in plain.stderr and "--tokenizer" in plain.stderr
    assert len(plain.stderr.strip().splitlines()) == 1
    assert not list(inline.run_dir().glob(".export_skyrl*"))  # nothing half-written left behind


def test_statistics_count_samples_per_row_and_breaks_by_cause(run):
    inline, _ = run
    rows = _rows(inline)
    assert [s["first_turn"] for s in rows[BROKEN]["metadata"]["token_ids"]["samples"]] == [0, 1]
    assert all(len(r["metadata"]["token_ids"]["samples"]) == 1 for key, r in rows.items() if key != BROKEN)
    stats = store.read_json(inline.run_dir() / "statistics.json")["token_ids"]
    assert stats["samples"] == {"rows": 4, "total": 5, "mean_per_row": 1.25, "max_per_row": 2}
    assert stats["breaks"] == {"reasoning_dropped": 1, "call_rerendered": 0, "context_changed": 0, "compacted": 0}


def test_skyrl_lines_follow_the_server_tokens_position_by_position(run):
    inline, _ = run
    rows, lines = _rows(inline), read_jsonl(inline.run_dir() / "export_skyrl.jsonl")
    assert len(lines) == 5  # one per sample
    for line in lines:
        assert set(line) <= SKYRL
        row = next(r for r in rows.values() if line["trajectory_ids"] == {
            "instance_id": r["metadata"]["group_id"], "repetition_id": r["metadata"]["sample_index"]})
        response = line["response_ids"]
        assert line["loss_masks"] == [int(t >= MODEL) for t in response]
        assert line["rollout_logprobs"] == [logprob(t) if t >= MODEL else 0.0 for t in response]
        assert all(t < MODEL for t in line["prompt_token_ids"][-len("<assistant>"):])
        assert line["rewards"] == row.get("reward")
        whole = [*line["prompt_token_ids"], *response]
        last = [c for c in _calls(row) if whole == [*c["prompt_ids"], *c["completion_ids"]]]
        assert last and line["stop_reasons"] == last[0]["finish_reason"]
        assert line["is_last_step"] == (last[0] is _calls(row)[-1])
    broken = [line for line in lines if line["trajectory_ids"] == {
        "instance_id": rows[BROKEN]["metadata"]["group_id"], "repetition_id": 1}]
    assert [line["is_last_step"] for line in broken] == [False, True]
    assert broken[0]["response_ids"] == _calls(rows[BROKEN])[0]["completion_ids"]


def test_atropos_lines_are_scored_groups_one_per_prompt(run):
    inline, _ = run
    rows, lines = _rows(inline), read_jsonl(inline.run_dir() / "export_atropos.jsonl")
    assert len(lines) == 2  # one per prompt: the tools group closed at its size, the plain one at the end
    skyrl = read_jsonl(inline.run_dir() / "export_skyrl.jsonl")  # the same samples, prompt and response apart
    for group in lines:
        assert set(group) == ATROPOS
        for tokens, masks, logprobs in zip(group["tokens"], group["masks"], group["inference_logprobs"], strict=True):
            prompt = next(len(line["prompt_token_ids"]) for line in skyrl
                          if [*line["prompt_token_ids"], *line["response_ids"]] == tokens)
            assert masks == [-100] * prompt + [t if t >= MODEL else -100 for t in tokens[prompt:]]
            assert logprobs == [1.0] * prompt + [logprob(t) if t >= MODEL else 1.0 for t in tokens[prompt:]]
    tools = next(g for g in lines if len(g["tokens"]) == 3)  # one sample of ("tools", 0), two of BROKEN
    assert sorted(tools["scores"]) == [0.0, 0.0, 1.0]
    # the group's GRPO advantage (trajgen/rewards.py): two rows rewarded 1 and 0, mean 0.5, population std 0.5
    assert [a[0] for a in tools["advantages"]] == [pytest.approx((0.5 if s else -0.5) / (0.5 + 1e-6))
                                                   for s in tools["scores"]]
    assert tools["messages"][0][-1]["role"] == "assistant" and all(m["reward"] is None for m in tools["messages"][0])
    plain = next(g for g in lines if len(g["tokens"]) == 2)
    assert plain["scores"] == [None, None] and plain["advantages"] is None  # nothing judged them
    assert tools["generation_params"] == {"temperature": 0.7, "top_p": 1.0, "max_tokens": 512}
    assert sum(len(_calls(r)) for r in rows.values()) == 6


def test_verifiers_lines_are_one_step_per_model_call(run):
    inline, _ = run
    rows, lines = _rows(inline), read_jsonl(inline.run_dir() / "export_verifiers.jsonl")
    calls = [(key, n, c) for key, row in rows.items() for n, c in enumerate(_calls(row))]
    assert len(lines) == len(calls) == 6
    by_call = {(line["trajectory_id"], line["extras"]["turn"]): line for line in lines}
    keys = {key: row["metadata"]["prompt_key"] for key, row in rows.items()}
    for key, n, ids in calls:
        step = by_call[(keys[key], n)]
        assert set(step) == VERIFIERS_STEP and set(step["tokens"]) == VERIFIERS_TOKENS
        tokens = step["tokens"]
        assert (tokens["prompt_ids"], tokens["completion_ids"]) == (ids["prompt_ids"], ids["completion_ids"])
        assert tokens["prompt_mask"] == [0] * len(ids["prompt_ids"])
        assert tokens["completion_mask"] == [1] * len(ids["completion_ids"])
        assert tokens["completion_logprobs"] == [logprob(t) for t in ids["completion_ids"]]
        assert step["completion"][0]["role"] == "assistant" and step["prompt"][-1]["role"] in ("user", "tool")
        assert step["reward"] == rows[key].get("reward") and not step["is_truncated"]


def _row(calls: list[dict], logprobs: bool = True) -> dict:
    """A row written by hand: one user turn, then a gpt and a tool turn per call."""
    turns = [{"from": "human", "value": "q", "message": {"role": "user", "content": "q"}}]
    for n, ids in enumerate(calls):
        tokens = {**ids, "completion_logprobs": [logprob(t) for t in ids["completion_ids"]] if logprobs else None,
                  "finish_reason": "stop", "prompt_source": "server" if logprobs else "retokenized"}
        turns += [{"from": "gpt", "value": "", "message": {"role": "assistant", "content": f"a{n}"}, "tokens": tokens},
                  {"from": "tool", "value": "", "message": {"role": "tool", "tool_call_id": f"c{n}", "content": "r"}}]
    return {"prompt_index": 7, "conversations": turns[:-1], "tools": [],
            "metadata": {"prompt_key": "k", "group_id": "k", "sample_index": 0,
                         "token_ids": samples.fields([t["tokens"] for t in turns if "tokens" in t])}}


CALLS = [{"prompt_ids": [1, 2], "completion_ids": [MODEL + 3]},
         {"prompt_ids": [1, 2, MODEL + 3, 4], "completion_ids": [MODEL + 5, MODEL + 6]}]


def test_retokenized_rows_export_their_positions_without_logprobs():
    from trajgen.conventions import atropos, skyrl

    row = _row(CALLS, logprobs=False)
    [line] = skyrl.records([row])
    assert (line["response_ids"], line["loss_masks"]) == ([MODEL + 3, 4, MODEL + 5, MODEL + 6], [1, 0, 1, 1])
    assert line["rollout_logprobs"] is None and line["rewards"] is None  # nothing judged it
    [group] = atropos.records([row])
    assert group["inference_logprobs"] is None
    assert group["masks"] == [[-100, -100, MODEL + 3, -100, MODEL + 5, MODEL + 6]]


@pytest.mark.parametrize("samples_field", [
    [{"first_turn": 0, "last_turn": 1}, {"first_turn": 2, "last_turn": 2}],  # a turn the row does not have
    [{"first_turn": 0, "last_turn": 1}],  # over ids that do not extend: an edited row
])
def test_a_row_whose_samples_disagree_with_its_ids_is_refused_not_shifted(samples_field):
    from trajgen.conventions import skyrl
    from trajgen.errors import UsageError

    row = _row([CALLS[0], {**CALLS[1], "prompt_ids": [1, 9, MODEL + 3, 4]}] if len(samples_field) == 1 else CALLS)
    row["metadata"]["token_ids"]["samples"] = samples_field
    with pytest.raises(UsageError, match=r"prompt 7: metadata.token_ids.samples\[\d\] disagrees"):
        list(skyrl.records([row]))
