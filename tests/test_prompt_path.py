"""One prompt's path without back-and-forth: the row rendered once with everything it records, the request
built once per call, one way to give a child a deadline."""
from __future__ import annotations

import asyncio
import signal

import pytest

import model_tools
from tests.conftest import arun
from trajgen import agent, journal, verify
from trajgen.messages import Replied
from trajgen.model import Reply, ScriptedModel
from trajgen.sandbox.process import deadline
from trajgen.tools import ToolContext
from trajgen.task import ModelSettings, Task

# a request, and its hash as the journal computed it before the body was built once per call
JOURNALED = ModelSettings("m", "http://127.0.0.1:1/v1", "k", temperature=0.5, extra_body={"provider": {"order": ["a"]}})
MESSAGES = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
SCHEMAS = [{"type": "function", "function": {"name": "t", "parameters": {}}}]
OLD_HASH = "7cb135c6b44c0702abe1d840f41eb7cda6628de53c2484f37713c4a531f66ca8"

SETTINGS = ModelSettings(model="fake", base_url="http://127.0.0.1:1/v1", api_key="k")
TASK = Task(key="key-1", prompt_index=0, batch_num=0, prompt="say hi", image=None, cwd=None, extra={},
            toolsets_sampled=["terminal"], toolsets_offered=["terminal"], verify="test -f a")


async def _no_sandbox():
    raise AssertionError("a conversation without tool calls opens no sandbox")


def test_the_row_is_rendered_with_the_replayed_calls_the_stalls_and_the_check():
    tools = model_tools.offered_tools(["terminal"], {})
    conversation = arun(agent.run_conversation(TASK.prompt, ScriptedModel([Reply({"content": "hi"})]), SETTINGS,
                                               tools, [t.schema() for t in tools], ToolContext(sandbox=_no_sandbox)))
    check = verify.Check(verify.Verdict.PASSED, "test -f a", 0, 0.25)
    row = agent.render_row(TASK, conversation, SETTINGS, replayed=2, stalls=1, check=check)
    assert (row["metadata"]["usage"]["replayed"], row["metadata"]["usage"]["stalls"]) == (2, 1)
    assert row["verify"] == {"status": "passed", "command": "test -f a", "exit_code": 0, "seconds": 0.25,
                             "output": "", "error": None, "reward": None}


def test_a_journal_written_before_still_replays():
    entry = journal.entry(Replied("key-1", 0, OLD_HASH, Reply({"content": "from the journal"}, {"prompt_tokens": 3})))
    task = Task(key="key-1", prompt_index=0, batch_num=0, prompt="hi", image=None, cwd=None, extra={},
                toolsets_sampled=[], toolsets_offered=[], replay=(entry,))
    model = journal.JournalModel(ScriptedModel([]), JOURNALED, task, lambda event: None, None)  # asked: it fails
    reply = arun(model.complete(MESSAGES, SCHEMAS, True))
    assert reply.message["content"] == "from the journal" and model.replayed["turns"] == 1


class _Recorder:
    async def complete(self, messages, tools, forbid_tools, args=None):
        self.args = args
        return Reply({"content": "asked"})


def test_the_call_sends_the_body_the_journal_hashed():
    sent, recorder = [], _Recorder()
    task = Task(key="key-1", prompt_index=0, batch_num=0, prompt="hi", image=None, cwd=None, extra={},
                toolsets_sampled=[], toolsets_offered=[])
    arun(journal.JournalModel(recorder, JOURNALED, task, sent.append, None).complete(MESSAGES, SCHEMAS, True))
    [replied] = sent
    assert replied.request_hash == OLD_HASH == journal.request_hash(recorder.args)
    assert recorder.args["messages"] is MESSAGES and recorder.args["tool_choice"] == "none"


async def _talk_to_sleeper(timeout: float, on_start=lambda proc: None) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec("sleep", "60")
    on_start(proc)
    try:
        async with deadline(proc, timeout):
            await proc.wait()
    except TimeoutError:
        pass
    return proc


def test_a_child_past_its_deadline_is_killed_and_reaped():
    proc = arun(_talk_to_sleeper(0.1))
    assert proc.returncode == -signal.SIGKILL


def test_a_child_whose_caller_is_cancelled_is_killed_and_reaped():
    started = []

    async def cancelled() -> None:
        talk = asyncio.ensure_future(_talk_to_sleeper(3600, started.append))
        while not started:
            await asyncio.sleep(0.01)
        talk.cancel()
        with pytest.raises(asyncio.CancelledError):
            await talk

    arun(cancelled())
    assert started[0].returncode == -signal.SIGKILL
