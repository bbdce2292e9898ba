"""End to end with the apptainer backend against a STAND-IN for the apptainer CLI
(tests/standins/apptainer: bubblewrap over image root filesystems exported from the private Docker
engine of tests/dockerd.py; Apptainer itself cannot be installed here). The runner is the CLI's
code in the test's process (`inline`), or the real CLI where a runner is killed; the model is the loopback
scripted server; runs are few and each carries several checks."""
from __future__ import annotations

import os
import subprocess

from tests.conftest import call, kill_group, read_jsonl, think, tool_outputs, write_jsonl
from tests.standins import STANDINS, builds, live_instances
from tests.support.inline import stopped_if_it_hangs, when
from tests.test_hardening import _one_line_error, _wait_for
from trajgen.sandbox import apptainer
from trajgen.sandbox.roots import UID_BASE, UID_COUNT

pytest_plugins = ["tests.dockerd", "tests.standins.fixtures"]

LATE = "127.0.0.1:1/trajgen-apptainer-late:1"  # missing at first; tagged in the engine before the resume
SECRET = "sk-apptainer-secret-42"
PROBE = "pwd; cat note.txt; echo; id -u; env; cat /proc/net/dev"


def _asked(server, prompt: str) -> int:
    """How many requests the server has had for `prompt`."""
    return sum(1 for r in server.requests() if r["prompt"] == prompt)


def test_apptainer_run_images_cwd_isolation_and_resume_of_a_missing_image(inline, scripted_server, apptainer_standin,
                                                                          busybox_image, docker_engine):
    server = scripted_server({"prompts": {
        "in app": [call("write_file", path="note.txt", content="from the model"), call("terminal", command=PROBE),
                   {**think("done"), "gate": "app-end"}],  # its instance stays up while "in srv" looks for its file
        "in srv": [{**call("terminal", command="pwd; find / -name note.txt 2>/dev/null; echo searched"),
                    "gate": "srv-go"}, think("done")],
        "timeout": [call("terminal", command="setsid sleep 4251 & (sleep 4252 &); echo begun; sleep 4253", timeout=2),
                    call("terminal", command="sleep 4242 & setsid sleep 4343 & (sleep 4444 &) ; echo started"),
                    call("terminal", command="ps -o args | grep -c '[s]leep 4'; grep Cap /proc/self/status; "
                                             "ulimit -t; chown 0 . 2>/dev/null; echo chown=$?"),
                    think("done")],
        "late": [call("terminal", command="cat /etc/passwd | head -1"), think("done")],
    }})
    write_jsonl(inline.cwd / "prompts.jsonl", [
        {"prompt": "in app", "image": busybox_image, "cwd": "/app"},
        {"prompt": "in srv", "docker_image": f"docker://{busybox_image}", "cwd": "/srv/work"},
        {"prompt": "timeout"},  # --docker_image
        {"prompt": "late", "image": LATE},
    ])
    inline.env.update(apptainer_standin, OPENAI_API_KEY=SECRET)
    args = inline.args(server, api_key=None, terminal_backend="apptainer", docker_image=busybox_image)
    built_before = len(builds(apptainer_standin))
    with (stopped_if_it_hangs(300),
          when(lambda: _asked(server, "in app") == 3, lambda: server.open_gate("srv-go")),  # wrote, probed, held
          when(lambda: _asked(server, "in srv") == 2, lambda: server.open_gate("app-end"))):
        first = inline.run(*args)
    stderr = first.stderr
    assert first.returncode == 1, stderr  # the missing image fails its prompt; the others go on
    assert f"image {LATE} is unavailable (cannot build image docker://{LATE}: FATAL:" in stderr
    rows = {r["conversations"][1]["value"]: r for r in read_jsonl(inline.run_dir() / "trajectories.jsonl")}
    assert set(rows) == {"in app", "in srv", "timeout"}
    [_, app] = tool_outputs(rows["in app"])
    lines = app["output"].splitlines()
    assert lines[:2] == ["/app", "from the model"]  # the row's cwd, the file tool's file
    assert UID_BASE <= int(lines[2]) < UID_BASE + UID_COUNT  # a uid of the prompt's own
    assert SECRET not in app["output"] and "API_KEY" not in app["output"] and "LANG=C.UTF-8" in lines
    interfaces = [line.split(":")[0].strip() for line in lines if ":" in line and "|" not in line and "=" not in line]
    assert interfaces == ["lo"]  # no network
    assert tool_outputs(rows["in srv"])[0]["output"] == "/srv/work\nsearched\n"  # the other prompt's file is invisible
    timed_out, started, probe = tool_outputs(rows["timeout"])
    assert timed_out["exit_code"] is None and "timed out after 2 s" in timed_out["error"] and "begun" in timed_out["output"]
    assert started["output"] == "started\n"
    lines = probe["output"].splitlines()
    assert lines[0] == "0"  # setsid or not, nothing a call started (on time or not) survived it
    caps = dict(line.split(":\t") for line in lines if line.startswith("Cap"))
    assert caps["CapEff"] == caps["CapPrm"] == "0000000000000000"
    assert "600" in lines and "chown=1" in lines  # CPU seconds limited per process; no privileges
    assert rows["in app"]["metadata"]["image"] == busybox_image
    failures = read_jsonl(inline.run_dir() / "failures.jsonl")
    assert [(f["error_class"], f["prompt_index"]) for f in failures] == [("ImageUnavailable", 3)]
    assert _asked(server, "late") == 0  # no API call was paid for it
    assert [n for n in live_instances() if n.startswith(f"trajgen-{inline.run_id()}-")] == []
    sif = [p for p in os.listdir(inline.cwd / "home/.cache/trajgen/sif") if p.endswith(".sif")]
    assert len(sif) == 1  # the busybox image, built once for both spellings and the default

    subprocess.run(["docker", "-H", docker_engine, "tag", busybox_image, LATE], check=True, capture_output=True)
    try:
        done = inline.run(*args, "--resume")
    finally:
        subprocess.run(["docker", "-H", docker_engine, "rmi", LATE], capture_output=True)
    assert done.returncode == 0, done.stderr
    rows = {r["conversations"][1]["value"]: r for r in read_jsonl(inline.run_dir() / "trajectories.jsonl")}
    assert tool_outputs(rows["late"])[0]["output"] == "root:x:0:0:root:/root:/bin/sh\n"
    assert builds(apptainer_standin)[built_before:] == [f"docker://{busybox_image}", f"docker://{LATE}"]


def test_resume_stops_the_instances_a_killed_runner_left(cli, scripted_server, apptainer_standin, busybox_image):
    """kill -9 cleans nothing up; the next invocation of the same run does, before it starts any."""
    server = scripted_server({"default": [call("terminal", command="echo up"), {**think("done"), "gate": "held"}]})
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": f"p{i}", "image": busybox_image} for i in range(2)])
    cli.env.update(apptainer_standin)
    args = cli.args(server, terminal_backend="apptainer")
    prefix = f"trajgen-{cli.run_id()}-"

    def instances() -> list[str]:
        return [name for name in live_instances() if name.startswith(prefix)]

    first = cli.start(*args)
    _wait_for(lambda: len(instances()) == 2 and _asked(server, "p0") == 2 and _asked(server, "p1") == 2)
    kill_group(first)
    assert len(instances()) == 2  # real instances outlive the CLI call that started them
    server.open_gate("held")
    done = cli.run(*args, "--resume")
    assert done.returncode == 0, done.stderr
    assert len(read_jsonl(cli.run_dir() / "trajectories.jsonl")) == 2
    assert instances() == []


def test_no_runtime_on_path_is_a_one_line_usage_error(inline, scripted_server):
    server = scripted_server({"default": [think()]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "p"}])
    path = ":".join(p for p in inline.env["PATH"].split(":") if p != str(STANDINS))
    apptainer.runtime.cache_clear()  # a runner looks on its PATH once, as this one would in a new process
    try:
        done = inline.run(*inline.args(server, terminal_backend="singularity"), env={"PATH": path})
    finally:
        apptainer.runtime.cache_clear()  # and the next run looks again
    assert done.returncode == 2
    assert "the apptainer backend cannot run here: neither apptainer nor singularity is on PATH" in _one_line_error(done)
    assert server.requests() == []
