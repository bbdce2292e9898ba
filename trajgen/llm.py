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

import httpx
import openai

from trajgen.errors import FatalAPIError
from trajgen.work import ModelSettings

BACKOFF_BASE = 0.5
BACKOFF_CAP = 30.0
RETRY_AFTER_CAP = 120.0
FATAL_STATUS = {401: "authentication failed", 402: "out of credits", 403: "access denied"}


def make_client(settings: ModelSettings, connections: int) -> openai.AsyncOpenAI:
    """One client per worker so connections are reused across all its conversations."""
    http = httpx.AsyncClient(
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        timeout=httpx.Timeout(settings.request_timeout, connect=min(30.0, settings.request_timeout)),
    )
    return openai.AsyncOpenAI(base_url=settings.base_url, api_key=settings.api_key, max_retries=0, http_client=http)


def request_args(settings: ModelSettings, messages: list[dict], tools: list[dict] | None) -> dict:
    args: dict = {"model": settings.model, "messages": messages}
    if tools:
        args["tools"] = tools
    for name in ("temperature", "top_p", "max_tokens", "reasoning_effort"):
        value = getattr(settings, name)
        if value is not None:
            args[name] = value
    if settings.extra_body:
        args["extra_body"] = settings.extra_body
    return args


def _retry_after(response: httpx.Response | None) -> float | None:
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
):
    """One chat completion, retried per the policy above."""
    args = request_args(settings, messages, tools)
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
