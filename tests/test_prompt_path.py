"""One prompt's path without back-and-forth: the row rendered once with everything it records."""
from __future__ import annotations

import model_tools
from tests.conftest import arun
from trajgen import agent, verify
from trajgen.model import Reply, ScriptedModel
from trajgen.tools import ToolContext
from trajgen.task import ModelSettings, Task

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
                             "output": "", "error": None}

