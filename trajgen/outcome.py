"""A prompt's final state, decided in one place: ok, discarded or failed, with the reason.

The worker decides it when the conversation ends; the parent decides it for prompts that never
reached a worker (an image that cannot be pulled) or whose worker died. The store writes it
as it is: ok rows to the batch files, discarded and failed to their side records.
"""
from __future__ import annotations

import enum
import traceback
from dataclasses import dataclass, field

import openai

from trajgen import errors, llm
from trajgen.work import Task

OURS = (errors.FatalAPIError, errors.PromptTimeout, errors.ImageUnavailable, errors.WorkerCrashed, errors.RunStopped,
        errors.ProviderError, errors.MalformedResponse, errors.NoNodeCanServe)


class Status(enum.Enum):
    OK = "ok"  # a row for the batch files
    DISCARDED = "discarded"  # a finished conversation the quality filter rejects; resume does not retry it
    FAILED = "failed"  # no usable conversation; resume retries it


@dataclass(frozen=True)
class PromptOutcome:
    key: str
    prompt_index: int
    batch_num: int
    status: Status
    row: dict | None = None  # the rendered row (ok and discarded)
    reason: str | None = None  # why it was discarded, or the error's class when it failed
    message: str | None = None  # the error, in one line
    traceback: str | None = None  # only for an error nobody foresaw
    files: dict[str, bytes] = field(default_factory=dict)  # what the row's tools made, by path in the run directory


def decide(task: Task, row: dict | None = None, error: BaseException | None = None,
           require_reasoning: bool = True, files: dict[str, bytes] | None = None) -> PromptOutcome:
    """The outcome of a conversation that returned `row` or raised `error`."""
    base = (task.key, task.prompt_index, task.batch_num)
    if error is not None:
        reason, message = (type(error).__name__, str(error)) if isinstance(error, OURS) else llm.describe(error)
        foreseen = isinstance(error, (*OURS, openai.APIError))
        trace = None if foreseen else "".join(traceback.format_exception(error))
        return PromptOutcome(*base, Status.FAILED, reason=reason, message=message, traceback=trace)
    if require_reasoning and not row["metadata"]["turns_with_reasoning"]:
        return PromptOutcome(*base, Status.DISCARDED, row=row, reason="no_reasoning", files=files or {})
    return PromptOutcome(*base, Status.OK, row=row, files=files or {})
