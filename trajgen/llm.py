"""Model calls: one client per worker, one retry policy, and a signal when the endpoint throttles.

Retries: 429 and 503 honour Retry-After; other 5xx, timeouts and connection errors back off
exponentially with full jitter. 401/402/403 stop the run. Other 4xx fail the prompt at once.
"""
from __future__ import annotations

import asyncio
import email.utils
import random
import time
from typing import Callable

import openai
from openai._constants import DEFAULT_CONNECTION_LIMITS

from trajgen.errors import FatalAPIError
from trajgen.work import ModelSettings

BACKOFF_BASE = 0.5
BACKOFF_CAP = 30.0
RETRY_AFTER_CAP = 120.0
FATAL_STATUS = {401: "authentication failed", 402: "out of credits", 403: "access denied"}


def make_client(settings: ModelSettings, connections: int) -> openai.AsyncOpenAI:
    """One client per worker so connections are reused across all its conversations.

    aiohttp underneath: with a hundred requests in flight, httpx's connection pool costs about
    ten times the CPU per request (bench/RESULTS.md)."""
    limits = type(DEFAULT_CONNECTION_LIMITS)(max_connections=connections, max_keepalive_connections=connections)
    http = openai.DefaultAioHttpClient(limits=limits, timeout=settings.request_timeout)
    return openai.AsyncOpenAI(base_url=settings.base_url, api_key=settings.api_key, max_retries=0,
                              timeout=settings.request_timeout, http_client=http)


def describe(error: BaseException) -> tuple[str, str]:
    """(error class, message) for a failed prompt, naming the root cause: a refused connection
    must not read as a timeout, which is how some transports report it."""
    causes, cause = [], error.__cause__ or error.__context__
    while cause is not None and len(causes) < 10:
        causes.append(cause)
        cause = cause.__cause__ or cause.__context__
    if isinstance(error, openai.APITimeoutError) and any(
            isinstance(c, OSError) and not isinstance(c, TimeoutError) for c in causes):
        return openai.APIConnectionError.__name__, f"cannot connect: {causes[-1]}"[:2000]
    message = str(error) + (f" ({causes[-1]})" if causes and str(causes[-1]) not in str(error) else "")
    return type(error).__name__, message[:2000]


def request_args(settings: ModelSettings, messages: list[dict], tools: list[dict] | None,
                 forbid_tools: bool = False) -> dict:
    args: dict = {"model": settings.model, "messages": messages}
    if tools:
        args["tools"] = tools
        if forbid_tools:
            args["tool_choice"] = "none"
    for name in ("temperature", "top_p", "max_tokens", "reasoning_effort"):
        value = getattr(settings, name)
        if value is not None:
            args[name] = value
    if settings.extra_body:
        args["extra_body"] = settings.extra_body
    return args


def _retry_after(response) -> float | None:
    if response is None:
        return None
    if value := response.headers.get("retry-after-ms"):
        try:
            return float(value) / 1000
        except ValueError:
            pass
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        parsed = email.utils.parsedate_to_datetime(value)
        return max(0.0, parsed.timestamp() - time.time()) if parsed else None


def retry_wait(error: Exception, attempt: int) -> float | None:
    """Seconds to wait before the next try, or None when this error must not be retried."""
    if isinstance(error, openai.APIStatusError):
        status = error.status_code
        if status in FATAL_STATUS:
            raise FatalAPIError(f"{FATAL_STATUS[status]} (HTTP {status}): {error.message}") from error
        if status not in (408, 409, 429) and status < 500:
            return None
        hinted = _retry_after(error.response) if status in (429, 503) else None
        if hinted is not None:
            return min(hinted, RETRY_AFTER_CAP) + random.uniform(0, 0.1)
    elif not isinstance(error, (openai.APIConnectionError, openai.APITimeoutError)):
        return None
    return random.uniform(0, min(BACKOFF_CAP, BACKOFF_BASE * 2**attempt))


async def complete(
    client: openai.AsyncOpenAI,
    settings: ModelSettings,
    messages: list[dict],
    tools: list[dict] | None,
    on_throttle: Callable[[], None],
    forbid_tools: bool = False,
):
    """One chat completion, retried per the policy above."""
    args = request_args(settings, messages, tools, forbid_tools)
    for attempt in range(settings.max_retries + 1):
        try:
            return await client.chat.completions.create(**args)
        except (openai.APIStatusError, openai.APIConnectionError) as error:
            wait = retry_wait(error, attempt)
            if wait is None or attempt == settings.max_retries:
                raise
            if isinstance(error, openai.APIStatusError) and error.status_code == 429:
                on_throttle()
            await asyncio.sleep(wait)
    raise AssertionError("unreachable")
