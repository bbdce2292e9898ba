"""Side models (trajgen/roles.py): journaled apart from the agent's calls, and paid for in the prompt's spend."""
from __future__ import annotations

import asyncio

import pytest

from trajgen import chat_calls, journal, roles
from trajgen.errors import EndpointUnreachable, FatalAPIError, SideEndpointUnreachable
from trajgen.messages import Replied
from trajgen.model import Metered, Reply, ScriptedModel
from trajgen.task import ModelSettings, Task

SETTINGS = ModelSettings(model="m", base_url="http://127.0.0.1:9/v1", api_key="k")
MESSAGES = [{"role": "user", "content": "score it"}]


def task(replay: tuple[dict, ...] = ()) -> Task:
    return Task(key="key-1", prompt_index=0, batch_num=0, prompt="p", image=None, cwd=None, extra={},
                toolsets_sampled=[], toolsets_offered=[], replay=replay)


def test_a_side_model_replays_only_its_own_role_and_journals_its_role():
    judge = roles.settings_for(SETTINGS, "judge-m", None, None)
    digest = journal.request_hash(chat_calls.request_args(judge, MESSAGES, [], False))
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "cost": 0.5}
    agent_entry = {"key": "key-1", "turn": 0, "hash": digest, "message": {"role": "assistant", "content": "agent's"},
                   "usage": usage}
    judge_entry = {**agent_entry, "role": "judge", "message": {"role": "assistant", "content": "judge's"}}
    sent: list = []
    scripted = ScriptedModel([Reply({"role": "assistant", "content": "paid"}, usage)])
    model = journal.JournalModel(Metered(scripted), judge, task((agent_entry, judge_entry)), sent.append, None, "judge")
    first = asyncio.run(model.complete(MESSAGES, [], False))
    second = asyncio.run(model.complete(MESSAGES, [], False))  # turn 1: journaled under no role, so asked
    assert (first.message["content"], second.message["content"]) == ("judge's", "paid")
    assert model.replayed["turns"] == 1 and len(scripted.requests) == 1
    (replied,) = sent
    assert isinstance(replied, Replied) and replied.role == "judge" and replied.turn == 1
    assert journal.entry(replied)["role"] == "judge"
    assert "role" not in journal.entry(Replied("key-1", 0, digest, first))  # the agent's entries are unchanged


def test_a_side_model_has_its_own_model_and_endpoint_and_none_of_the_agents_prompt():
    run = ModelSettings(model="m", base_url="http://a/v1", api_key="k", system_prompt="be brief", temperature=0.7,
                        extra_body={"provider": {"order": ["x"]}}, price_per_mtok=(1.0, 2.0))
    judge = roles.settings_for(run, "j", "http://b/v1", None)
    assert (judge.model, judge.base_url, judge.api_key) == ("j", "http://b/v1", "none")  # the run's key stays home
    assert roles.settings_for(run, "j", None, None).api_key == "k"
    assert roles.settings_for(run, "j", "http://b/v1", "kb").api_key == "kb"
    assert (judge.system_prompt, judge.temperature, judge.extra_body, judge.price_per_mtok) == ("", None, {}, None)
    assert roles.settings_for(run, None, None, None).price_per_mtok == (1.0, 2.0)  # the run's model, the run's price


def test_a_prompts_spend_is_its_agents_and_its_side_models_replays_included():
    metadata = {"usage": {"prompt_tokens": 10, "completion_tokens": 4, "reasoning_tokens": 0, "cost": 1.0,
                          "replayed": {"turns": 1, "prompt_tokens": 3, "completion_tokens": 1, "reasoning_tokens": 0,
                                       "cost": None}},
                "side_usage": {"judge": {"prompt_tokens": 7, "completion_tokens": 2, "reasoning_tokens": 0, "cost": 0.25,
                                         "api_calls": 1, "replayed": {"turns": 1, "prompt_tokens": 7,
                                                                      "completion_tokens": 2, "reasoning_tokens": 0,
                                                                      "cost": 0.25}}}}
    total = roles.prompt_usage(metadata)
    assert (total["prompt_tokens"], total["completion_tokens"], total["cost"]) == (17, 6, 1.25)
    assert total["replayed"] == {"turns": 2, "prompt_tokens": 10, "completion_tokens": 3, "reasoning_tokens": 0,
                                 "cost": 0.25}
    assert roles.prompt_usage({"usage": metadata["usage"]}) is metadata["usage"]  # no side model: the row's own


def test_a_side_models_fatal_errors_name_its_flag_not_the_runs():
    user = roles.settings_for(SETTINGS, "u", "http://127.0.0.1:9/v1", None)
    with pytest.raises(SideEndpointUnreachable, match=r"^--user_base_url=http://127.0.0.1:9/v1 cannot be reached: "):
        asyncio.run(roles.Named(ScriptedModel([EndpointUnreachable("connection refused")]), "user", user)
                    .complete(MESSAGES, [], False))
    with pytest.raises(FatalAPIError, match=r"^--judge_base_url=http://127.0.0.1:9/v1: invalid key"):
        asyncio.run(roles.Named(ScriptedModel([FatalAPIError("invalid key")]), "judge", user)
                    .complete(MESSAGES, [], False))
