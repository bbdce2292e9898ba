"""The process pool with a real worker process, against the loopback scripted server."""
from __future__ import annotations

from tests.conftest import think
from trajgen.messages import Finished
from trajgen.outcome import Status
from trajgen.process_pool import ProcessPool
from trajgen.sandbox import SandboxConfig
from trajgen.task import ModelSettings, Task, WorkerConfig
from trajgen.tools import ToolSettings


def test_a_cancel_hands_back_the_outcomes_already_in_the_pipe(scripted_server):
    server = scripted_server({"default": [think()]})
    config = WorkerConfig(model=ModelSettings("test-model", server.url, "key", max_retries=0), sandbox=SandboxConfig(),
                          tools=ToolSettings(), unavailable_tools={}, concurrency=1)
    pool = ProcessPool(1, config)
    pool.start()
    try:
        pool.submit(Task(key="k0", prompt_index=0, batch_num=0, prompt="a prompt", image=None, cwd=None, extra={},
                         toolsets_sampled=[], toolsets_offered=[]))
        assert pool.poll(0) == []  # handed to the worker; its answer needs a request to the server
        assert pool.workers[0].conn.poll(60)  # the worker's events wait in the pipe, unread
        events = pool.cancel()
    finally:
        pool.close()
    assert [(e.outcome.key, e.outcome.status) for e in events if isinstance(e, Finished)] == [("k0", Status.OK)]
    assert pool.inflight == 0
