"""The check of a finished sample: its row's `verify` command, run in the sample's own sandbox.

When the conversation ends, before the sandbox closes, every process of it (what its commands
left, its MCP servers and what they started) is killed, the model's final answer is written to FINAL_ANSWER in the work dir and the command runs
there in a clean room (CLEAN_ROOM), through the `Sandbox` protocol only, so every backend runs it
the same way (with the run's network setting and its own timeout). The work dir is what is
checked, as the model left it; nothing else of the conversation reaches the check: its HOME is a
new empty directory, its environment holds only the sandbox's own PATH and the names below
(no BASH_ENV, ENV or PYTHON* variable a command exported), and Python ignores user site-packages.
Exit 0 passes and any other exit fails, except 126 and 127: the shell saying the command could
not be run or found, an error of the check rather than of the model (a missing test runner must
not read as a model that failed). No exit within the timeout is a timeout; a sandbox that
cannot open, take the answer or run the command is an error. None of it fails the prompt.
"""
from __future__ import annotations

import enum
import math
import re
import shlex
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from trajgen.sandbox import Sandbox, SandboxError
from trajgen.sandbox.shell import PREFER_BASH

FINAL_ANSWER = ".trajgen/final_answer.txt"
OUTPUT_TAIL = 2000  # characters of the command's output a row keeps: the end, where test summaries are
NOT_RUN = {126: "not_executable", 127: "command_not_found"}  # what sh exits with when it cannot run a command
# $PATH here is the one the backend started the sandbox's shell with (fixed: no command can change it)
CLEAN_ROOM = ('home=$(mktemp -d) || exit 126; exec env -i HOME="$home" PATH="$PATH" LANG=C.UTF-8 TERM=dumb '
              "PYTHONNOUSERSITE=1 PYTHONUNBUFFERED=1 sh -c {prefer_bash} sh {command}")


class Verdict(enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    ERROR = "error"  # the check could not run; says nothing about the model
    TIMEOUT = "timeout"
    UNVERIFIED = "unverified"  # the row has no verify command


REWARD = {Verdict.PASSED: 1.0, Verdict.FAILED: 0.0, Verdict.TIMEOUT: 0.0}  # the rest: no reward (None)
GRADED = re.compile(r"reward:(.*)")  # the last line of a graded check's output


@dataclass(frozen=True)
class Check:
    verdict: Verdict
    command: str | None = None
    exit_code: int | None = None
    seconds: float | None = None
    output: str = ""  # the tail of what the command printed; for an error, why it could not run
    error: str | None = None  # the kind of error: sandbox, command_not_found, not_executable or malformed_reward
    reward: float | None = None  # a graded check's own reward (GRADED)

    def as_row(self) -> dict:
        return {"status": self.verdict.value, "command": self.command, "exit_code": self.exit_code,
                "seconds": self.seconds, "output": self.output, "error": self.error, "reward": self.reward}


UNVERIFIED = Check(Verdict.UNVERIFIED)


def status(row: dict) -> str:
    """The row's verdict; rows written before verification existed are unverified."""
    return (row.get("verify") or {}).get("status", Verdict.UNVERIFIED.value)


def reward(check: dict) -> float | None:
    """A check's reward (a row's `verify`): its graded number, else 1 passed, 0 failed or timed out, else none."""
    if check.get("reward") is not None:
        return check["reward"]
    return REWARD.get(Verdict(check.get("status", Verdict.UNVERIFIED.value)))


def graded(output: str) -> float | None | ValueError:
    """The number of a last line `reward: <number>`, None when the last line is not one, ValueError
    when it is one without a finite number."""
    lines = output.rstrip("\n").rsplit("\n", 1)
    found = GRADED.fullmatch(lines[-1].strip())
    if found is None:
        return None
    try:
        number = float(found.group(1))
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        return ValueError(f"the last line {lines[-1].strip()[:200]!r} is not `reward: <number>`")
    return number


async def run(command: str, final_answer: str, sandbox: Callable[[], Awaitable[Sandbox]], timeout: float) -> Check:
    """Open the sample's sandbox if the model never did, hand it the final answer, run the command."""
    started = time.monotonic()
    try:
        box = await sandbox()
        await box.end_processes()
        await box.write_file(FINAL_ANSWER, final_answer.encode())
        ran = time.monotonic()
        result = await box.run(clean_room(command), timeout)
    except (SandboxError, OSError) as e:
        return Check(Verdict.ERROR, command, None, _since(started), str(e)[-OUTPUT_TAIL:], "sandbox")
    seconds = _since(started)  # the whole check, the sandbox's start included
    output = result.output[-OUTPUT_TAIL:]
    if result.exit_code is None:  # no exit: the backend stopped it at the timeout, or the sandbox failed
        if time.monotonic() - ran >= timeout:
            return Check(Verdict.TIMEOUT, command, None, seconds, output)
        why = "\n".join(part for part in (output, result.error) if part)
        return Check(Verdict.ERROR, command, None, seconds, why[-OUTPUT_TAIL:], "sandbox")
    if result.exit_code in NOT_RUN:
        return Check(Verdict.ERROR, command, result.exit_code, seconds, output, NOT_RUN[result.exit_code])
    number = graded(result.output)
    if isinstance(number, ValueError):
        return Check(Verdict.ERROR, command, result.exit_code, seconds, f"{output}\n{number}"[-OUTPUT_TAIL:],
                     "malformed_reward")
    return Check(Verdict.PASSED if result.exit_code == 0 else Verdict.FAILED, command, result.exit_code, seconds, output,
                 reward=number)


def clean_room(command: str) -> str:
    """`command` run by a shell with a fresh HOME and nothing of the conversation's environment."""
    return CLEAN_ROOM.format(prefer_bash=shlex.quote(PREFER_BASH), command=shlex.quote(command))


def _since(started: float) -> float:
    return round(time.monotonic() - started, 3)
