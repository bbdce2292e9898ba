"""A prompt's final state, decided in one place: ok, discarded or failed, with the reason.

The worker decides it when the conversation ends; the parent decides it for prompts that never
reached a worker (an image that cannot be pulled) or whose worker died. The row is serialised
here, once, in the worker: a row that is not JSON fails its prompt where it was made, and the
parent writes the bytes as they are (ok rows to the batch files, discarded and failed to their
side records), so it never discovers a bad row and never encodes one again.
"""
from __future__ import annotations

import enum
import traceback
from dataclasses import dataclass, field


from trajgen import chat_calls, errors, store
from trajgen.model import no_usage
from trajgen.task import Task

OURS = (errors.FatalAPIError, errors.PromptTimeout, errors.ImageUnavailable, errors.WorkerCrashed, errors.RunStopped,
        errors.ProviderError, errors.MalformedResponse, errors.NoNodeCanServe)


class Status(enum.Enum):
    OK = "ok"  # a row for the batch files
    DISCARDED = "discarded"  # a finished conversation that is never training data (truncated); never retried
    FAILED = "failed"  # no usable conversation; resume retries it


@dataclass(frozen=True)
class PromptOutcome:
    key: str
    prompt_index: int
    batch_num: int
    status: Status
    row: bytes | None = None  # the rendered row as JSON (ok and discarded)
    usage: dict = field(default_factory=no_usage)  # what it paid: its row's, or, failed, that of the replies it got
    reason: str | None = None  # why it was discarded, or the error's class when it failed
    message: str | None = None  # the error, in one line
    traceback: str | None = None  # only for an error nobody foresaw
    files: dict[str, bytes] = field(default_factory=dict)  # what the row's tools made, by path in the run directory


def decide(task: Task, row: dict | None = None, error: BaseException | None = None, usage: dict | None = None,
           files: dict[str, bytes] | None = None) -> PromptOutcome:
    """The outcome of a conversation that returned `row` (and `files` for the run directory) or
    raised `error` after paying `usage` (a row's own usage unless `usage` says what it paid in all)."""
    base = (task.key, task.prompt_index, task.batch_num)
    data = None
    if error is None:
        usage = row["metadata"]["usage"] if usage is None else usage
        try:
            data = store.encode_row(row)
        except TypeError as e:
            error = errors.RowNotSerializable(f"the row cannot be written as JSON: {e}")
            error.__cause__ = e
    if error is not None:
        reason, message, trace = _named(error)
        return PromptOutcome(*base, Status.FAILED, usage=usage or no_usage(), reason=reason, message=message,
                             traceback=trace)
    if row.get("truncated"):  # tool calls cut by the token limit: never training data, and asking again pays again
        return PromptOutcome(*base, Status.DISCARDED, row=data, usage=usage, reason="truncated", files=files or {})
    return PromptOutcome(*base, Status.OK, row=data, usage=usage, files=files or {})


def _named(error: BaseException) -> tuple[str, str, str | None]:
    """(class, message, traceback): the class says what happened, never a Python internal such as
    KeyError; only an error nobody foresaw keeps its traceback."""
    if isinstance(error, OURS):
        return type(error).__name__, str(error), None
    if isinstance(error, errors.APIError):
        return (*chat_calls.describe(error), None)
    named = error if isinstance(error, errors.InternalError) else errors.InternalError(f"{type(error).__name__}: {error}")
    return type(named).__name__, str(named)[:2000], "".join(traceback.format_exception(error))
