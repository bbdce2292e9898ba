"""End to end with the modal backend: the CLI (in process, `inline`; a real one where a runner is killed)
and the real modal SDK (1.6.4) against the local stand-in of tests/standins/modal_server.py, not Modal
itself. The stand-in serves Modal's gRPC API and task command router on 127.0.0.1 and runs each sandbox
as a container on the private Docker engine (always without network: a label records whether the
backend asked Modal to block it)."""
from __future__ import annotations

import subprocess
import uuid

from tests.conftest import call, kill_group, read_jsonl, think, tool_outputs, write_jsonl
from tests.support.inline import stopped_if_it_hangs, when
from tests.test_hardening import _wait_for

pytest_plugins = ["tests.dockerd", "tests.standins.modal_fixture"]

RUN_TAG = "modal-standin.tag.trajgen.run"  # the docker label the stand-in gives a sandbox's trajgen.run tag


def _run_tag(runs) -> str:
    """The label of this test's run's sandboxes (other runs share the engine)."""
    return f"{RUN_TAG}={runs.run_id()}"


def _rows(path) -> dict[str, dict]:
    return {r["conversations"][1]["value"]: r for r in read_jsonl(path / "trajectories.jsonl")}


def test_modal_run_uses_each_rows_image_and_cwd_and_resume_retries_a_missing_image(
        inline, scripted_server, modal_standin, busybox_image):
    later = f"trajgen-modal-later-{uuid.uuid4().hex[:8]}:1"  # missing at first, then made: resume retries it
    server = scripted_server({"default": [
        call("write_file", path="note.txt", content="from the model"),
        call("terminal", command="pwd; cat note.txt; echo; hostname"),
        think("done"),
    ]})
    write_jsonl(inline.cwd / "prompts.jsonl", [
        {"prompt": "in app", "image": busybox_image, "cwd": "/app"},
        {"prompt": "in srv", "docker_image": busybox_image, "cwd": "/srv/work"},
        {"prompt": "later", "image": later},
    ])
    inline.env.update(modal_standin.env)
    args = inline.args(server, terminal_backend="modal")
    done = inline.run(*args)
    assert done.returncode == 1, done.stderr  # the missing image fails its prompt; the others go on
    assert f"{later} is unavailable" in done.stderr and "Traceback" not in done.stderr
    rows = _rows(inline.run_dir())
    assert set(rows) == {"in app", "in srv"}
    app, srv = tool_outputs(rows["in app"])[1], tool_outputs(rows["in srv"])[1]
    assert app["output"].startswith("/app\nfrom the model\n") and srv["output"].startswith("/srv/work\nfrom the model\n")
    assert app["output"].split("\n")[2] != srv["output"].split("\n")[2]  # two sandboxes, one per prompt
    assert rows["in app"]["tool_stats"]["terminal"] == {"count": 1, "success": 1, "failure": 0}
    failures = read_jsonl(inline.run_dir() / "failures.jsonl")
    assert [(f["error_class"], f["prompt_index"]) for f in failures] == [("ImageUnavailable", 2)]
    assert "later" not in [r["prompt"] for r in server.requests()]  # no API call was paid for it
    assert modal_standin.containers(_run_tag(inline)) == []

    subprocess.run(["docker", "tag", busybox_image, later], check=True)
    try:
        again = inline.run(*args, "--resume")
    finally:
        subprocess.run(["docker", "rmi", later], capture_output=True)
    assert again.returncode == 0, again.stderr
    rows = _rows(inline.run_dir())
    assert set(rows) == {"in app", "in srv", "later"}
    assert tool_outputs(rows["later"])[1]["output"].startswith("/workspace\nfrom the model\n")
    assert modal_standin.containers(_run_tag(inline)) == []


def test_modal_sandboxes_are_isolated(inline, scripted_server, modal_standin, busybox_image):
    """No network, none of our secrets, no other prompt's files, and a timed-out command's whole tree killed."""
    server = scripted_server({"prompts": {
        "owner": [call("write_file", path="secret-owner.txt", content="mine"), {**think("done"), "gate": "owner"}],
        "neighbour": [{**call("terminal", command="env; find / -name 'secret-*' 2>/dev/null; "
                                                 "echo end"), "gate": "written"},
                      call("terminal", command="setsid sleep 4251 & (sleep 4252 &); echo begun; sleep 4253", timeout=2),
                      call("terminal", command="ps -o args | grep -c '[s]leep 425'"),
                      {**think("done"), "gate": "owner"}],  # both sandboxes stay until the test looks
    }})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": p, "image": busybox_image} for p in ("owner", "neighbour")])
    inline.env.update(modal_standin.env, OPENAI_API_KEY="sk-in-the-runner-env")
    blocked = []  # the sandboxes with no network, counted while both are up

    def look_then_let_go() -> None:
        blocked.append(len(modal_standin.containers(_run_tag(inline), "modal-standin.network=blocked")))
        server.open_gate("owner")

    with (stopped_if_it_hangs(180),
          when(lambda: any(r["prompt"] == "owner" and r["turn"] > 0 for r in server.requests()),  # its file is written
               lambda: server.open_gate("written"), timeout=180),
          when(lambda: any(r["prompt"] == "neighbour" and r["turn"] > 2 for r in server.requests()), look_then_let_go,
               timeout=180)):
        done = inline.run(*inline.args(server, terminal_backend="modal"))
    assert blocked == [2]  # no network was asked for
    assert done.returncode == 0, done.stderr
    probe, timed_out, survivors = tool_outputs(_rows(inline.run_dir())["neighbour"])
    lines = probe["output"].splitlines()
    assert "dummy-key" not in probe["output"] and "sk-in-the-runner-env" not in probe["output"]
    assert {line.split("=")[0] for line in lines if "=" in line} >= {"LANG", "TERM"}
    assert not any("secret-" in line for line in lines) and lines[-1] == "end"
    assert "begun" in timed_out["output"] and "timed out after 2 s" in timed_out["error"]
    assert survivors["output"] == "0\n"  # no sleep outlived its call, setsid or not


def test_resume_terminates_the_sandboxes_a_killed_runner_left(cli, scripted_server, modal_standin, busybox_image):
    """kill -9 cleans nothing up; the next invocation of the same run does, before it starts any."""
    server = scripted_server({"default": [call("terminal", command="echo up"), {**think("done"), "gate": "held"}]})
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": f"p{i}", "image": busybox_image} for i in range(2)])
    cli.env.update(modal_standin.env)
    args = cli.args(server, terminal_backend="modal")
    first = cli.start(*args)
    _wait_for(lambda: len(modal_standin.containers(_run_tag(cli))) == 2)  # both prompts have a sandbox; both held
    _wait_for(lambda: sum(r["turn"] > 0 for r in server.requests()) == 2)  # and ran their command
    kill_group(first)
    assert len(modal_standin.containers(_run_tag(cli))) == 2
    server.open_gate("held")
    done = cli.run(*args, "--resume")
    assert done.returncode == 0, done.stderr
    assert "deprecat" not in done.stderr.lower()  # the environment-wide listing by tag is quiet
    assert len(read_jsonl(cli.run_dir() / "trajectories.jsonl")) == 2
    assert modal_standin.containers(_run_tag(cli)) == []


def test_without_modal_credentials_the_run_stops_on_one_line(inline, scripted_server, modal_standin, busybox_image,
                                                             monkeypatch):
    server = scripted_server({"default": [think("done")]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "p", "image": busybox_image}])
    inline.env.update(modal_standin.env)
    del inline.env["MODAL_TOKEN_ID"], inline.env["MODAL_TOKEN_SECRET"]  # the stand-in's address, and no token
    # the SDK as a new runner finds it: no client authenticated, no app looked up by an earlier run in this process
    monkeypatch.setattr("modal.client._Client._client_from_env", None)
    monkeypatch.setattr("trajgen.sandbox.modal_sandbox._apps", {})
    done = inline.run(*inline.args(server, terminal_backend="modal"))
    assert done.returncode == 1
    assert f"error: Modal cannot build image {busybox_image}: AuthError: Token missing" in done.stderr
    assert "nothing was sent" in done.stderr and "Traceback" not in done.stderr
    assert server.requests() == [] and not (inline.run_dir() / "failures.jsonl").exists()  # not a failed prompt: no run
