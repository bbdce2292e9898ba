"""The messages between the parent and a worker: small frozen dataclasses, handled with `match`."""
from __future__ import annotations

import signal
from dataclasses import dataclass

from trajgen.model import Reply
from trajgen.outcome import PromptOutcome, Status
from trajgen.task import Task


STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})  # each stops a run the same way


# parent -> worker
@dataclass(frozen=True)
class Submit:
    task: Task


@dataclass(frozen=True)
class Cancel:
    """Cancel every conversation in flight; the worker answers Cancelled."""


@dataclass(frozen=True)
class Stop:
    """Cancel everything and exit."""


# worker -> parent
@dataclass(frozen=True)
class Finished:
    outcome: PromptOutcome


@dataclass(frozen=True)
class Replied:
    """A reply paid for: the parent journals it, so that resume does not pay for it again (not sent
    when its prompt's landed outcome goes in the same message: `without_landed_replies`)."""

    key: str
    turn: int
    request_hash: str
    reply: Reply
    role: str = "agent"  # whose call: the agent's, or a side model's (trajgen/roles.py), each numbering its own turns


@dataclass(frozen=True)
class Rerun:
    """A prompt starts again from its first turn (its Ray actor died), replaying the replies it was
    paid: the parent has counted them already, and its outcome will count them as replayed."""

    key: str


@dataclass(frozen=True)
class Throttled:
    """The endpoint answered 429: the parent halves how many conversations it admits."""


@dataclass(frozen=True)
class Retrying:
    """A prompt's model call failed and is retried after `wait` seconds (retry `attempt` of `retries`):
    the parent shows it under the progress bar until the prompt is answered or ends."""

    key: str
    cause: str  # "HTTP 500", "timeout", "connection error"
    attempt: int
    retries: int
    wait: float


@dataclass(frozen=True)
class Fatal:
    reason: str  # the endpoint refuses every prompt (401, 402, 403): the run stops
    unreachable: bool = False  # the endpoint never answered and cannot be reached: nothing is recorded as failed


@dataclass(frozen=True)
class Log:
    text: str


@dataclass(frozen=True)
class Notice:
    """Something the user should know that does not stop anything: said once per run per topic,
    whichever worker says it first."""

    topic: str
    text: str


@dataclass(frozen=True)
class Cancelled:
    pass


Event = Finished | Replied | Rerun | Throttled | Retrying | Fatal | Log | Notice | Cancelled


def without_landed_replies(events: list[Event]) -> list[Event]:
    """The events a worker sends in one message, less the replies of prompts whose outcome travels
    with them and lands (ok or discarded: resume never runs those again). Their rows carry those
    replies, and the parent would write the journal entries only to drop them at the next compaction;
    it counts their spend from the outcome's usage (scheduler._Spend)."""
    landed = {e.outcome.key for e in events if isinstance(e, Finished) and e.outcome.status is not Status.FAILED}
    if not landed:
        return events
    return [e for e in events if not (isinstance(e, Replied) and e.key in landed)]
