"""Model calls: one connection pool per worker, one retry policy, and a signal when the endpoint throttles.

Retries: 429, 408, 409, 5xx, timeouts and connection errors are retried, up to `--max_retries`
times and within `--retry_budget` seconds per request, with jittered waits that grow by at least half each time and never wait
less than BACKOFF_BASE (a wave of prompts that failed together does not come back as a burst) and
never less than a Retry-After; `on_retry` hears of each wait. 401/402/403 stop the run, and so do a
404 and an endpoint out of reach (refused, unresolvable, TLS) before it has ever answered (the
model or the endpoint does not exist); other 4xx fail the prompt at once. A 200 whose body is
an error object is treated like the status it names; one that is not a completion is
MalformedResponse.
"""
from __future__ import annotations

import asyncio
import email.utils
import random
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Callable

import orjson

from trajgen import transport
from trajgen.errors import (APIConnectionError, APIStatusError, APITimeoutError, EndpointUnreachable, FatalAPIError,
                            MalformedResponse, ProviderError, status_error, unreachable_cause)
from trajgen.work import ModelSettings

BACKOFF_BASE = 1.0
BACKOFF_CAP = 30.0
RETRY_AFTER_CAP = 120.0
FATAL_STATUS = {401: "authentication failed", 402: "out of credits", 403: "access denied"}
OVERLOADED = (429, 503)  # the endpoint asks everyone to slow down, not just this request


class Endpoint:
    """One worker's connection pool to the chat endpoint, shared by all its conversations.

    Our own small HTTP/1.1 client (trajgen/transport.py), not the openai SDK nor aiohttp: both cost
    several times its CPU per call (bench/RESULTS.md, "The chat calls' HTTP client"). The errors
    keep the SDK's class names (trajgen/errors.py)."""

    def __init__(self, settings: ModelSettings, connections: int) -> None:
        self.url = f"{settings.base_url.rstrip('/')}/chat/completions"
        self.headers = {"Authorization": f"Bearer {settings.api_key}", "Content-Type": "application/json",
                        "Accept": "application/json"}
        self.timeout = settings.request_timeout
        self.connections = connections
        self.answered = False  # the endpoint has answered once: a later 404 is not a missing model
        self._client: transport.Client | None = None

    async def post(self, body: bytes) -> bytes:
        """The body of a 2xx reply to a serialized request, or the error for what happened."""
        if self._client is None:  # made on the loop that uses it
            proxy = env_proxy(self.url)
            try:
                self._client = transport.Client(self.url, self.connections, proxy)
            except ValueError as e:  # an https:// proxy in the environment: no request can go out
                raise FatalAPIError(f"cannot send through the proxy {proxy}: {e}") from None
        try:
            async with asyncio.timeout(self.timeout):
                response = await self._client.post(body, self.headers)
        except TimeoutError as e:
            raise APITimeoutError() from e
        except (OSError, asyncio.IncompleteReadError, transport.ProtocolError) as e:
            raise APIConnectionError() from e
        if not 200 <= response.status < 300:
            raise status_error(response.status, response.headers, response.body)
        return response.body

    async def close(self) -> None:
        if self._client is not None:
            self._client.close()


def env_proxy(url: str) -> str | None:
    """The proxy the environment names for `url` (HTTPS_PROXY, NO_PROXY, ...), looked up once per worker."""
    parts = urllib.parse.urlsplit(url)
    if urllib.request.proxy_bypass_environment(parts.hostname or ""):
        return None
    return urllib.request.getproxies_environment().get(parts.scheme)


def describe(error: BaseException) -> tuple[str, str]:
    """(error class, message) for a failed prompt, naming the root cause: a refused connection
    must not read as a timeout, which is how some transports report it."""
    causes, cause = [], error.__cause__ or error.__context__
    while cause is not None and len(causes) < 10:
        causes.append(cause)
        cause = cause.__cause__ or cause.__context__
    if isinstance(error, APIConnectionError) and any(
            isinstance(c, OSError) and not isinstance(c, TimeoutError) for c in causes):
        return APIConnectionError.__name__, f"cannot connect: {causes[-1]}"[:2000]
    message = str(error) + (f" ({causes[-1]})" if causes and str(causes[-1]) not in str(error) else "")
    return type(error).__name__, message[:2000]


def request_args(settings: ModelSettings, messages: list[dict], tools: list[dict] | None,
                 forbid_tools: bool = False) -> dict:
    """The body of one call as the endpoint receives it (the extra body merged in at the top level)."""
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
        args.update(settings.extra_body)
    return args


def request_body(settings: ModelSettings, messages: list[dict], tools: list[dict] | None,
                 forbid_tools: bool = False) -> bytes:
    """Serialized once by orjson: the SDK's typed `create` walks every message of the history in
    Python on every call, which cost more CPU than the rest of a turn."""
    return orjson.dumps(request_args(settings, messages, tools, forbid_tools))


@dataclass(frozen=True)
class Completion:
    """The parts of a 200 body the loop uses, as plain JSON values (no typed SDK objects: building
    and dumping them cost more CPU than the rest of a call)."""

    message: dict  # the first choice's message, without its null fields
    usage: object  # the usage object as sent (checked by the caller), None when absent
    model: object  # the `model` field as sent
    provider: object  # OpenRouter's `provider` field, when present


def parse_completion(body: bytes) -> Completion:
    """The completion in a 200 body, or the error it carries instead."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise MalformedResponse(f"the reply is not JSON: {body[:200]!r}") from None
    if not isinstance(data, dict):
        raise MalformedResponse(f"the reply is not a JSON object: {body[:200]!r}")
    if isinstance(error := data.get("error"), dict):
        code = error.get("code")
        status = int(code) if isinstance(code, (int, str)) and str(code).isdigit() else None
        raise ProviderError(str(error.get("message") or error)[:2000], status)
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise MalformedResponse("the reply has no choices" if choices is None else f"the reply has choices: {choices!r}"[:2000])
    if not isinstance(choices[0], dict) or not isinstance(choices[0].get("message"), dict):
        raise MalformedResponse(f"the reply's first choice has no message: {str(choices[0])[:200]}")
    message = {k: v for k, v in choices[0]["message"].items() if v is not None}
    return Completion(message, data.get("usage"), data.get("model"), data.get("provider"))


def _retry_after(headers) -> float | None:
    """Seconds the endpoint asks us to wait (Retry-After-Ms, Retry-After: seconds or a date)."""
    if value := headers.get("retry-after-ms"):
        try:
            return float(value) / 1000
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        parsed = email.utils.parsedate_to_datetime(value)
        return max(0.0, parsed.timestamp() - time.time()) if parsed else None


def status_of(error: Exception) -> int | None:
    """The HTTP status an error stands for: a real one, or the one an error object in a 200 names."""
    if isinstance(error, APIStatusError):
        return error.status_code
    if isinstance(error, ProviderError):
        return error.status
    return None


def backoff(previous: float) -> float:
    """Jittered, and growing by at least half each time: between 1.5 and 3 times the previous wait
    (the first between BACKOFF_BASE and three times it), capped. Pure decorrelated jitter can stay
    near BACKOFF_BASE for ten tries and give up inside a 20 s storm; with this floor, ten retries
    wait at least 100 s, so --max_retries's default rides out any outage --retry_budget allows."""
    low = max(BACKOFF_BASE, 1.5 * previous)
    return min(BACKOFF_CAP, random.uniform(low, 3 * max(BACKOFF_BASE, previous)))


def retry_wait(error: Exception, previous: float, answered: bool) -> float | None:
    """Seconds to wait before the next try, or None when this error must not be retried.
    `previous` is the last wait (0 before the first retry); `answered` says whether the endpoint
    has answered this worker before, which tells a missing model (404 at once) from a later 404."""
    status = status_of(error)
    if status is not None:
        if status in FATAL_STATUS or (status == 404 and not answered):
            what = FATAL_STATUS.get(status, "model or endpoint not found")
            raise FatalAPIError(f"{what} (HTTP {status}): {getattr(error, 'message', error)}") from error
        if status not in (408, 409, 429) and status < 500:
            return None
        hinted = _retry_after(error.headers) if status in OVERLOADED and isinstance(error, APIStatusError) else None
        return max(min(hinted or 0.0, RETRY_AFTER_CAP), backoff(previous))
    if isinstance(error, APIConnectionError):
        if not answered and (cause := unreachable_cause(error)):
            raise EndpointUnreachable(cause) from error
        return backoff(previous)
    return None


async def complete(
    endpoint: Endpoint,
    settings: ModelSettings,
    messages: list[dict],
    tools: list[dict] | None,
    on_throttle: Callable[[], None],
    forbid_tools: bool = False,
    on_retry: Callable[[Exception, int, int, float], None] | None = None,
) -> Completion:
    """One chat completion, retried per the policy above; `on_retry(error, attempt, max_retries, wait)`
    before each wait."""
    body = request_body(settings, messages, tools, forbid_tools)
    started, wait = time.monotonic(), 0.0
    for attempt in range(settings.max_retries + 1):
        try:
            completion = parse_completion(await endpoint.post(body))
            endpoint.answered = True
            return completion
        except (APIStatusError, APIConnectionError, ProviderError) as error:
            if status_of(error) in OVERLOADED:  # even on the last try: the scheduler must hear of it
                on_throttle()
            wait = retry_wait(error, wait, endpoint.answered)
            if wait is None or attempt == settings.max_retries or time.monotonic() - started + wait > settings.retry_budget:
                raise
            if on_retry is not None:
                on_retry(error, attempt + 1, settings.max_retries, wait)
            await asyncio.sleep(wait)
    raise AssertionError("unreachable")
