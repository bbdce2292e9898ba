"""--model=local --token_ids: the packaged model's server (trajgen/local_server.py) sends vLLM's ids,
and the whole path runs on a real model with no key. The ids are checked with the model's own
tokenizer: each prompt is llama.cpp's tokens of the conversation as the chat template renders it,
each completion the tokens of the reply's text and the end of the turn."""
from __future__ import annotations

import pytest

from tests.conftest import read_jsonl, write_jsonl
from tests.test_local_model import LOCAL_FLAGS, _needs_local_model
from trajgen.local_model import model_path


def _rendered(messages: list[dict]) -> str:
    """llama-cpp-python's chatml-function-calling template without tools: its Jinja environment
    escapes each message's content as HTML."""
    from markupsafe import escape

    return "".join(f"<|im_start|>{m['role']}\n{escape(m['content'])}<|im_end|>\n" for m in messages) \
        + "<|im_start|>assistant\n"


@pytest.mark.slow
def test_a_local_run_keeps_the_ids_the_model_was_fed_and_sampled(inline):
    _needs_local_model()
    from llama_cpp import Llama

    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "Say hello in one word."}])
    # a simulated user on the same model answers once: a conversation of two model calls
    done = inline.run("--dataset_file=prompts.jsonl", "--run_name=run", *LOCAL_FLAGS, "--token_ids",
                      "--user_model=local", "--user_for_all", "--max_user_turns=1")
    assert done.returncode == 0, done.stderr
    assert "--token_ids: the endpoint sends vllm's token ids" in done.stderr  # the probe found the dialect
    [row] = read_jsonl(inline.run_dir() / "trajectories.jsonl")
    turns = row["conversations"]
    calls = [i for i, t in enumerate(turns) if t["from"] == "gpt"]
    assert len(calls) == 2

    llama = Llama(str(model_path()), vocab_only=True, verbose=False)
    end_of_turn = llama.tokenize(b"<|im_end|>", add_bos=False, special=True)
    for i in calls:
        ids = turns[i]["tokens"]
        assert (ids["prompt_source"], ids["completion_source"]) == ("server", "server")
        prompt = _rendered([t["message"] for t in turns[:i]])
        assert ids["prompt_ids"] == llama.tokenize(prompt.encode(), add_bos=False, special=True)
        completion, reply = ids["completion_ids"], turns[i]["message"]["content"]
        if ids["finish_reason"] == "stop":  # what it sampled: the reply, then the end of its turn
            assert completion[-len(end_of_turn):] == end_of_turn
            completion = completion[:-len(end_of_turn)]
        assert llama.detokenize(completion).decode() == reply and reply.strip()
        assert len(ids["completion_logprobs"]) == len(ids["completion_ids"])
        assert all(p <= 0 for p in ids["completion_logprobs"]) and any(p < 0 for p in ids["completion_logprobs"])

    # one sample while the second prompt extends the first call's prompt and completion, else two
    first, second = (turns[i]["tokens"] for i in calls)
    sequence = first["prompt_ids"] + first["completion_ids"]
    extends = second["prompt_ids"][:len(sequence)] == sequence
    assert row["metadata"]["token_ids"]["samples"] == ([{"first_turn": 0, "last_turn": 1}] if extends else
                                                       [{"first_turn": 0, "last_turn": 0},
                                                        {"first_turn": 1, "last_turn": 1}])
    assert len(row["metadata"]["token_ids"]["breaks"]) == (not extends)

    exported = inline.run("--export=verifiers", "--run_name=run")
    assert exported.returncode == 0, exported.stderr
    steps = read_jsonl(inline.run_dir() / "export_verifiers.jsonl")
    assert [(s["tokens"]["prompt_ids"], s["tokens"]["completion_ids"], s["tokens"]["completion_logprobs"])
            for s in steps] == [(t["prompt_ids"], t["completion_ids"], t["completion_logprobs"])
                                for t in (first, second)]
