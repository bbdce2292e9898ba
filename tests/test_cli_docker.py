"""End to end with the docker backend: per-prompt containers from the rows' images, a missing
image failing only its prompts. Uses the private dockerd of tests/dockerd.py (no network)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

from tests.conftest import call, kill_group, read_jsonl, think, tool_outputs, write_jsonl
from tests.test_hardening import _wait_for

pytest_plugins = ["tests.dockerd"]


def _tool_output(row: dict, turn: int) -> dict:
    value = row["conversations"][turn]["value"]
    return json.loads(value.removeprefix("<tool_response>\n").removesuffix("\n</tool_response>"))["content"]


def test_docker_run_uses_each_rows_image_and_cwd(inline, scripted_server, docker_engine, busybox_image):
    server = scripted_server({"default": [
        call("write_file", path="note.txt", content="from the model"),
        call("terminal", command="pwd; cat note.txt; echo; hostname"),
        think("done"),
    ]})
    write_jsonl(inline.cwd / "prompts.jsonl", [
        {"prompt": "in app", "image": busybox_image, "cwd": "/app"},
        {"prompt": "in srv", "docker_image": busybox_image, "cwd": "/srv/work"},
        {"prompt": "gone", "image": "127.0.0.1:1/missing/image:1"},
    ])
    done = inline.run(*inline.args(server, terminal_backend="docker"), env={"DOCKER_HOST": docker_engine})
    assert done.returncode == 1, done.stderr  # the missing image fails its prompt; the others go on
    assert "127.0.0.1:1/missing/image:1 is unavailable" in done.stderr
    rows = {r["conversations"][1]["value"]: r for r in read_jsonl(inline.run_dir() / "trajectories.jsonl")}
    assert set(rows) == {"in app", "in srv"}
    app, srv = _tool_output(rows["in app"], 5), _tool_output(rows["in srv"], 5)
    assert app["output"].startswith("/app\nfrom the model\n") and srv["output"].startswith("/srv/work\nfrom the model\n")
    assert app["output"].split("\n")[2] != srv["output"].split("\n")[2]  # two containers, one per prompt
    assert rows["in app"]["tool_stats"]["terminal"] == {"count": 1, "success": 1, "failure": 0}
    assert rows["in app"]["metadata"]["image"] == busybox_image
    failures = read_jsonl(inline.run_dir() / "failures.jsonl")
    assert [(f["error_class"], f["prompt_index"]) for f in failures] == [("ImageUnavailable", 2)]
    assert "gone" not in [r["prompt"] for r in server.requests()]  # no API call was paid for it
    leftover = subprocess.run(["docker", "-H", docker_engine, "ps", "-aq", "--filter",
                               f"label=trajgen.run={inline.run_id()}"],
                              capture_output=True, text=True).stdout.split()
    assert leftover == []


def test_resume_removes_the_containers_a_killed_runner_left(cli, scripted_server, docker_engine, busybox_image):
    """kill -9 cleans nothing up; the next invocation of the same run does, before it starts any."""
    server = scripted_server({"default": [call("terminal", command="echo up"),
                                          {**think("done"), "gate": "held"}]})
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": f"p{i}", "image": busybox_image} for i in range(2)])
    cli.env["DOCKER_HOST"] = docker_engine
    args = cli.args(server, terminal_backend="docker")

    def containers(label: str) -> list[str]:
        return subprocess.run(["docker", "-H", docker_engine, "ps", "-aq", "--filter", f"label={label}"],
                              capture_output=True, text=True, check=True).stdout.split()

    first = cli.start(*args)
    _wait_for(lambda: len(containers(f"trajgen.run={cli.run_id()}")) == 2)  # both prompts ran their command; both held
    kill_group(first)
    left = containers(f"trajgen.run={cli.run_id()}")
    assert len(left) == 2
    server.open_gate("held")
    done = cli.run(*args, "--resume")
    assert done.returncode == 0, done.stderr
    assert len(read_jsonl(cli.run_dir() / "trajectories.jsonl")) == 2
    assert containers(f"trajgen.run={cli.run_id()}") == []


def test_terminal_and_file_calls_start_no_docker_process(inline, scripted_server, docker_engine, busybox_image,
                                                        bash_image):
    """Every call is an exec through the Engine API, one per call (busybox) or one loop per prompt (bash):
    a `docker` on PATH that logs itself is never run, not even for the run's reaping."""
    log = inline.cwd / "docker-calls.log"
    wrapper = inline.cwd / "bin" / "docker"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {log}\nexec {shutil.which("docker")} "$@"\n')
    wrapper.chmod(0o755)
    server = scripted_server({"default": [
        call("write_file", path="n.txt", content="one\n"),
        call("terminal", command="echo two >> n.txt; echo to-stderr >&2; echo to-stdout"),
        call("terminal", command="cat n.txt"),
        call("read_file", path="n.txt"),
        think("done"),
    ]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "sh", "image": busybox_image},
                                               {"prompt": "bash", "image": bash_image}])
    done = inline.run(*inline.args(server, terminal_backend="docker"),
                      env={"DOCKER_HOST": docker_engine, "PATH": f"{wrapper.parent}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr
    for row in read_jsonl(inline.run_dir() / "trajectories.jsonl"):
        wrote, merged, shown, read = tool_outputs(row)
        assert merged["output"] == "to-stderr\nto-stdout\n" and shown["output"] == "one\ntwo\n"
        assert "one\n" in read["content"] and wrote["success"]
    assert not log.exists(), log.read_text()


def test_an_engine_that_is_not_there_is_one_clear_line(inline, scripted_server, busybox_image, tmp_path):
    socket = tmp_path / "no-engine.sock"
    server = scripted_server({"default": [call("terminal", command="true"), think("done")]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "p", "image": busybox_image}])
    done = inline.run(*inline.args(server, terminal_backend="docker"), env={"DOCKER_HOST": f"unix://{socket}"})
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"error: cannot reach the Docker engine at unix://{socket}: No such file or directory; nothing was sent" in done.stderr
    assert server.requests() == [] and not (inline.run_dir() / "failures.jsonl").exists()  # stopped before any prompt
