"""Errors that decide a prompt's final state or stop the run.

A failed prompt records the class name of its error; resume retries it. Anything not listed
here that escapes a conversation fails the prompt as InternalError, with its traceback kept.
"""
from __future__ import annotations

import errno
import html
import json
import re
import socket
import ssl
from collections.abc import Mapping


class UsageError(Exception):
    """Bad flags or bad input: one line to the user, exit status 2, nothing written."""


class FatalAPIError(Exception):
    """The endpoint refuses us for every prompt (401, 402, 403): stop the run instead of burning the dataset."""


class EndpointUnreachable(FatalAPIError):
    """The endpoint cannot be reached at all (refused, a name that does not resolve, a TLS failure)
    and has never answered: the run stops at once and nothing is recorded as failed."""


class SideEndpointUnreachable(EndpointUnreachable):
    """A side model's endpoint (trajgen/roles.py) cannot be reached: the run stops at once, the message
    names the role's flag."""


class RunStopped(Exception):
    """The run stopped on a fatal error (the endpoint refused it, the local model server died) with the prompt in flight."""


class PromptTimeout(Exception):
    """The prompt ran past --prompt_timeout."""


class ImageUnavailable(Exception):
    """The prompt's container image could not be found or pulled."""


class WorkerCrashed(Exception):
    """The worker process running the prompt died."""


class NoNodeCanServe(Exception):
    """No node of the Ray cluster has what the prompt's tools need (a sandbox, a browser, an image)."""


class ProviderError(Exception):
    """The endpoint answered 200 with an `{"error": {...}}` object (OpenRouter does this for an upstream failure)."""

    def __init__(self, message: str, status: int | None):
        super().__init__(f"{message} (status {status})" if status else message)
        self.status = status


class MalformedResponse(Exception):
    """The endpoint answered 200 with something that is not a usable chat completion: a body that is
    not JSON, no `choices`, `choices: []`, a tool call without a function name or with ids that clash.
    `usage` is what that reply cost, when it said: it was paid for all the same."""

    def __init__(self, message: str, usage: dict | None = None):
        super().__init__(message)
        self.usage = usage or {}


class NotJSON(MalformedResponse):
    """The reply's body (or a streamed chunk) is not JSON: from an endpoint that has never answered,
    a web page or some other service, not a chat endpoint (the run stops); later, a glitch."""

    def __init__(self, what: str, body: bytes | bytearray):
        self.shown = summary(body)
        super().__init__(f"{what} is not JSON: {self.shown}")


class EmptyAnswer(MalformedResponse):
    """The reply has neither content nor tool calls: no answer to train on, and usually a glitch
    (a retry answers), so the prompt fails and --resume asks it again."""


class ReplyTooLarge(MalformedResponse):
    """The endpoint's reply is larger than --max_reply_mb: refused before more than the cap is held."""


class InternalError(Exception):
    """An error nobody foresaw ended the prompt (a bug of ours or of a tool): failures.jsonl names
    this class, with the original error in the message and its traceback kept for a report."""


class RowNotSerializable(InternalError):
    """The worker could not write the prompt's row as JSON; checked where the row is made, so the
    parent never meets a bad row."""


class Unwritable(Exception):
    """The run directory cannot be written: the run stops with every row already written kept, and
    `fix` says what to do before resuming."""

    def __init__(self, path, what: str, fix: str):
        super().__init__(f"{what} writing {path}")
        self.path, self.fix = path, fix


class DiskFull(Unwritable):
    """No space left on the device of the run directory."""

    def __init__(self, path):
        super().__init__(path, "no space left on the device", "free some space")


class ReadOnly(Unwritable):
    """The run directory turned read-only or forbidden under the run (a remount, chmod, chattr +i)."""

    def __init__(self, path, strerror: str):
        super().__init__(path, strerror.lower(), "make the run directory writable again")


class APIError(Exception):
    """The chat endpoint failed a request. The classes are named as the openai SDK names them,
    so failures.jsonl reads as it would through the SDK; the workers never import it (a second of
    CPU per process)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class APIConnectionError(APIError):
    def __init__(self, message: str = "Connection error."):
        super().__init__(message)


class APITimeoutError(APIConnectionError):
    def __init__(self) -> None:
        super().__init__("Request timed out.")


class APIStatusError(APIError):
    """A reply with a status other than 2xx; `headers` carry Retry-After."""

    def __init__(self, message: str, status_code: int, headers: Mapping[str, str]):
        super().__init__(message)
        self.status_code, self.headers = status_code, headers


class BadRequestError(APIStatusError): ...
class AuthenticationError(APIStatusError): ...
class PermissionDeniedError(APIStatusError): ...
class NotFoundError(APIStatusError): ...
class ConflictError(APIStatusError): ...
class UnprocessableEntityError(APIStatusError): ...
class RateLimitError(APIStatusError): ...
class InternalServerError(APIStatusError): ...


STATUS_ERRORS: dict[int, type[APIStatusError]] = {
    400: BadRequestError, 401: AuthenticationError, 403: PermissionDeniedError, 404: NotFoundError,
    409: ConflictError, 422: UnprocessableEntityError, 429: RateLimitError,
}


def status_error(status: int, headers: Mapping[str, str], body: bytes) -> APIStatusError:
    """The error for a non-2xx reply, worded as the SDK words it: `Error code: 429 - {...}`; a body
    that is not JSON is summed up (an HTML page by its title), never pasted."""
    text = body.decode("utf-8", "replace").strip()
    try:
        detail = json.loads(text)
    except ValueError:
        detail = summary(body) if text else None
    message = f"Error code: {status}" + (f" - {detail}" if detail is not None else "")
    kind = STATUS_ERRORS.get(status) or (InternalServerError if status >= 500 else APIStatusError)
    return kind(message, status, headers)


TITLE = re.compile(rb"<title[^>]*>(.*?)</title", re.IGNORECASE | re.DOTALL)
SUMMARY_CHARS = 120


def summary(body: bytes | bytearray) -> str:
    """One line for a body that is not JSON: an HTML page by its title, text by its start (cut),
    anything else by its size; an error message never carries a web page."""
    head = bytes(body[:4096]).lstrip()
    if head[:1] == b"<":
        title = TITLE.search(head)
        name = " ".join(html.unescape(title.group(1).decode("utf-8", "replace")).split()) if title else ""
        return f'an HTML page "{_cut(name)}"' if name else f"an HTML page of {len(body):,} bytes"
    text = " ".join(bytes(body[:SUMMARY_CHARS * 4]).decode("utf-8", "replace").split())
    if text and text.isprintable() and "\ufffd" not in text:
        return f'"{_cut(text)}"' + (f" ({len(body):,} bytes)" if len(text) > SUMMARY_CHARS else "")
    return f"{len(body):,} bytes that are not text" if body else "an empty body"


def _cut(text: str) -> str:
    return text if len(text) <= SUMMARY_CHARS else text[:SUMMARY_CHARS - 1] + "…"


def unreachable_cause(error: BaseException) -> str | None:
    """Why no connection to the endpoint could be made, when a cause in `error`'s chain says so
    (refused, a name that does not resolve, a TLS failure); None for anything a retry may cure."""
    cause = error.__cause__ or error.__context__
    for _ in range(10):
        if cause is None:
            return None
        if isinstance(cause, OSError) and cause.errno == errno.ECONNREFUSED:
            return "connection refused"
        if isinstance(cause, socket.gaierror):
            return f"the host name does not resolve ({cause.strerror or cause})"
        if isinstance(cause, ssl.SSLCertVerificationError):
            cause = getattr(cause, "certificate_error", cause)  # aiohttp's wrapper holds the ssl module's error
            return f"TLS failure: the certificate is not accepted ({getattr(cause, 'verify_message', None) or cause})"
        if isinstance(cause, ssl.SSLError):
            return f"TLS failure ({cause.reason or cause})"
        cause = cause.__cause__ or cause.__context__
    return None
