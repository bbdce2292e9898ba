"""Model calls: one connection pool per worker, one retry policy, and a signal when the endpoint throttles.

Retries (tenacity): 429, 408, 409, 5xx, timeouts, stalls and connection errors are retried, up to `--max_retries`
times and within `--retry_budget` seconds per request, with jittered waits that grow by at least half each time and never wait
less than BACKOFF_BASE (a wave of prompts that failed together does not come back as a burst) and
never less than a Retry-After; `on_retry` hears of each wait. 401/402/403 stop the run. Before the
endpoint has ever answered, so does any answer a retry will not change, naming --base_url: a 404,
405 or 501, a 2xx body that is not JSON (a web page, some other service), a 400 that refuses a
second prompt alike (the first may be that prompt's own fault; a context length always is), and an
endpoint out of reach (refused, unresolvable, TLS); other 4xx fail the prompt at once. A 200 whose
body (or a streamed chunk) is an error object is treated like the status it names; one that is not
a completion is MalformedResponse (NotJSON when it is not JSON), and one larger than --max_reply_mb
is ReplyTooLarge.

A reply that has fully arrived is kept however its connection ends afterwards (a RST, a FIN short
of the chunked terminator, an end that does not come within END_GRACE): it was paid for, and asking
again would pay again. Fully arrived: a stream's `data: [DONE]`, or its finish reason and its usage;
an unstreamed body whose bytes parse as a whole JSON object (a Content-Length body that arrived
whole never meets a fault). A stream whose body ends cleanly after its finish reason stands too.
A body is read as an event stream when it says so or when it starts like one, whatever its
Content-Type.
"""
from __future__ import annotations

import asyncio
import email.utils
import functools
import ipaddress
import math
import os
import random
import re
import ssl
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Callable

import aiohttp
import certifi
import orjson
import tenacity

from trajgen import stream, token_ids
from trajgen.errors import (APIConnectionError, APIStatusError, APITimeoutError, EndpointUnreachable, FatalAPIError,
                            MalformedResponse, NotJSON, ProviderError, ReplyTooLarge, status_error, unreachable_cause)
from trajgen.task import ModelSettings

BACKOFF_BASE = 1.0
BACKOFF_CAP = 30.0
RETRY_AFTER_CAP = 120.0
FATAL_STATUS = {401: "authentication failed", 402: "out of credits", 403: "access denied"}
NEVER_ANSWERED = {**FATAL_STATUS, 400: "the request is refused", 404: "model or endpoint not found",
                  405: "method not allowed: no chat endpoint there", 501: "not implemented: no chat endpoint there"}
CONTEXT_LENGTH = re.compile(r"context.?(length|size|window)|maximum context|too many tokens", re.IGNORECASE)
OVERLOADED = (429, 503)  # the endpoint asks everyone to slow down, not just this request
CONNECT_TIMEOUT = 10.0  # seconds to connect, TLS handshake and proxy tunnel included (the openai SDK allows 5)
ERROR_BODY_LIMIT = 1 << 16  # bytes of a non-2xx body kept for its message
BOM = b"\xef\xbb\xbf"
EVENT_STARTS = (b"data:", b":", b"event:", b"id:", b"retry:")  # the first line of an event stream
BATCH_SECONDS = 0.1  # a trickling stream's socket is read at most this often once its first token is in
FAST_READ = 1 << 16  # a read this large: the reply is flowing fast, not trickling, and is read without a pause
END_GRACE = 1.0  # seconds the end of a stream's body may take once its reply is whole; then the connection is closed


class Stalled(TimeoutError):
    """No byte (chunk or comment) arrived for --stall_timeout seconds: the stream is abandoned and asked again."""


class Endpoint:
    """One worker's connection pool to the chat endpoint (aiohttp), shared by all its conversations.

    aiohttp, not httpx: httpx cost 1.2-3.5 ms of CPU a call here, past the runner's whole budget
    (bench/RESULTS.md). It brings http and https proxies, gzip, and timeouts for the connection
    (TCP, TLS handshake, proxy tunnel) apart from the silence of a stream and from the whole
    request; TLS trusts certifi, or SSL_CERT_FILE/SSL_CERT_DIR when set. The errors keep the
    openai SDK's class names (trajgen/errors.py); the SDK itself is not used (0.75 ms a call)."""

    def __init__(self, settings: ModelSettings, connections: int) -> None:
        self.url = f"{settings.base_url.rstrip('/')}/chat/completions"
        self.root = settings.base_url.rstrip("/").removesuffix("/v1")  # llama-server's /apply-template, /tokenize
        self.headers = {"Authorization": f"Bearer {settings.api_key}", "Content-Type": "application/json",
                        "Accept": "application/json"}  # streamed too, as the openai SDK sends it
        self.settings = settings
        self.connections = connections
        self.answered = False  # the endpoint has answered once: a later 404 is not a missing model
        self.refusal: str | None = None  # the first 400 before any answer, maybe that prompt's own fault
        self.proxy = env_proxy(self.url)
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        """Made on the loop that uses it, once per worker."""
        if self._session is None:
            if self.proxy and urllib.parse.urlsplit(self.proxy).scheme not in ("http", "https"):
                raise FatalAPIError(f"cannot send through the proxy {self.proxy}: only http:// and https:// proxies "
                                    "are supported")
            stall = self.settings.stall_timeout if self.settings.stream else None  # unstreamed: silent until done
            tls = any(u and u.startswith("https:") for u in (self.url, self.proxy))
            connector = aiohttp.TCPConnector(limit=self.connections, ssl=trust() if tls else True)
            self._session = aiohttp.ClientSession(
                connector=connector, headers=self.headers, trust_env=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT, sock_read=stall))
        return self._session

    async def call(self, body: bytes) -> Completion:
        """The completion of a serialized request with its timing, or the error for what happened."""
        session, sent = self._open(), time.monotonic()
        try:
            async with asyncio.timeout(self.settings.request_timeout):
                dialect = self.settings.token_ids
                prompt_ids = await self._prompt_ids(session, body) if dialect and dialect.prompt_from_tokenize else None
                async with session.post(self.url, data=body, proxy=self.proxy) as response:
                    head = time.monotonic()
                    if not 200 <= response.status < 300:
                        text = await _read(response, ERROR_BODY_LIMIT, truncate=True)
                        raise status_error(response.status, response.headers, text)
                    events, pieces = await _sniffed(response)
                    if events:
                        completion, first_token = await _events(response, pieces, self.settings)
                    else:  # not streamed, or an endpoint that ignores `stream`
                        body = await _read(response, self.settings.max_reply_bytes, pieces=pieces)
                        completion = parse_completion(body, tokens=dialect is not None)
                        first_token = None
        except aiohttp.ConnectionTimeoutError:
            raise APITimeoutError() from TimeoutError(
                f"no connection to {_origin(self.url)} within {CONNECT_TIMEOUT:g} s (TCP connect, TLS handshake or "
                f"proxy tunnel)")
        except aiohttp.SocketTimeoutError:
            raise APITimeoutError() from Stalled(f"stalled: no byte for {self.settings.stall_timeout:g} s (--stall_timeout)")
        except TimeoutError:
            raise APITimeoutError() from TimeoutError(
                f"the request took over {self.settings.request_timeout:g} s (--request_timeout)")
        except (aiohttp.ClientError, OSError) as e:  # refused, reset, cut, or not HTTP as it should be
            raise APIConnectionError() from e
        end = time.monotonic()
        first_token = first_token or end
        if prompt_ids is not None and completion.tokens is not None:
            completion = replace(completion, tokens={**completion.tokens, "prompt_ids": prompt_ids})
        return replace(completion, timing={"first_byte": round(head - sent, 4), "first_token": round(first_token - sent, 4),
                                           "generation": round(end - first_token, 4)})

    async def _prompt_ids(self, session: aiohttp.ClientSession, body: bytes) -> object:
        """llama-server's ids of this request's prompt, which its reply lacks: the request rendered by
        its own chat template (/apply-template), tokenized as its completions tokenize it (/tokenize,
        special tokens added and parsed). Asked first, so that a server without them costs no completion."""
        prompt = (await self._post(session, "/apply-template", body)).get("prompt")
        if not isinstance(prompt, str):
            raise MalformedResponse(f"{self.root}/apply-template sent no prompt: {str(prompt)[:200]}")
        request = orjson.dumps({"content": prompt, "add_special": True, "parse_special": True})
        return (await self._post(session, "/tokenize", request)).get("tokens")

    async def _post(self, session: aiohttp.ClientSession, path: str, body: bytes) -> dict:
        async with session.post(self.root + path, data=body, proxy=self.proxy) as response:
            if not 200 <= response.status < 300:
                text = await _read(response, ERROR_BODY_LIMIT, truncate=True)
                raise status_error(response.status, response.headers, text)
            return stream.json_object(await _read(response, self.settings.max_reply_bytes), f"{path}'s answer")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


@functools.cache
def trust() -> ssl.SSLContext:
    """certifi's roots, or the file or directory SSL_CERT_FILE / SSL_CERT_DIR name (as httpx and requests do)."""
    cafile, capath = os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")
    return ssl.create_default_context(cafile=cafile or (None if capath else certifi.where()), capath=capath)


async def _read(response: aiohttp.ClientResponse, limit: int, truncate: bool = False,
                pieces: AsyncIterator[bytes] | None = None) -> bytearray:
    """The (decoded) body, never holding more than `limit` bytes (and no second copy of them): past
    it, the start of it with `truncate`, else ReplyTooLarge. A body whose connection breaks after
    the last byte of its JSON stands: a chunked or close-delimited body has no other sign of its
    end, and the reply was paid for."""
    if not truncate and response.content_length is not None and response.content_length > limit:
        raise too_large(response.content_length, limit)
    body = bytearray()
    try:
        async for piece in pieces or response.content.iter_any():
            if len(body) + len(piece) > limit:
                if truncate:
                    body += piece[:limit - len(body)]
                    break
                raise too_large(len(body) + len(piece), limit)
            body += piece
    except (aiohttp.ClientError, OSError):
        if truncate or not _json_object(body):
            raise
    if body.startswith(BOM):
        del body[:len(BOM)]
    return body


def _json_object(body: bytearray) -> bool:
    try:
        return isinstance(orjson.loads(memoryview(body)[len(BOM):] if body.startswith(BOM) else body), dict)
    except orjson.JSONDecodeError:
        return False


async def _sniffed(response: aiohttp.ClientResponse) -> tuple[bool, AsyncIterator[bytes]]:
    """Whether the body is an event stream, and its pieces from the first: a stream served as
    text/plain or application/json is one all the same (the openai SDK reads it whatever its type),
    told apart from JSON by its first bytes."""
    pieces = response.content.iter_any()
    if response.content_type == "text/event-stream":
        return True, pieces
    head = b""
    async for piece in pieces:
        head += piece
        if not _undecided(head) or len(head) >= FAST_READ:
            break

    async def again() -> AsyncIterator[bytes]:
        if head:
            yield head
        async for piece in pieces:
            yield piece

    return head.removeprefix(BOM).lstrip().startswith(EVENT_STARTS), again()


def _undecided(head: bytes) -> bool:
    """Too few bytes yet to tell an event stream from JSON (blank, or the start of `data:`)."""
    start = head.removeprefix(BOM).lstrip()
    return BOM.startswith(head) or any(len(start) < len(e) and e.startswith(start) for e in EVENT_STARTS)


async def _events(response: aiohttp.ClientResponse, pieces: AsyncIterator[bytes],
                  settings: ModelSettings) -> tuple[Completion, float | None]:
    """A streamed reply assembled (stream.py), and when its first token came."""
    collector = token_ids.Collector() if settings.token_ids else None
    reader, assembly, size, first_token, resume = stream.EventReader(), stream.Assembly(tokens=collector), 0, None, None
    pause = min(BATCH_SECONDS, settings.stall_timeout / 2)  # never long enough to look like a stall
    ending = asyncio.timeout(None)  # once the reply is whole, the end of its body has END_GRACE to come
    try:
        async with ending:
            async for piece in pieces:
                size += len(piece)
                if size > settings.max_reply_bytes:
                    if assembly.complete:  # bytes after the reply: not read
                        break
                    raise too_large(size, settings.max_reply_bytes)
                for data in reader.feed(piece):
                    if assembly.add(data) and first_token is None:
                        first_token = time.monotonic()
                if assembly.complete and ending.when() is None:
                    ending.reschedule(asyncio.get_running_loop().time() + END_GRACE)
                if first_token is not None and len(piece) < FAST_READ and not assembly.ended:
                    if resume is not None:  # fired already, unless aiohttp resumed reading itself (a compressed body)
                        resume.cancel()
                    resume = _pause_reading(response, pause)
    except (aiohttp.ClientError, OSError):  # reset, cut, late (a stall, END_GRACE): only an incomplete reply is lost
        if not assembly.complete:
            raise
    finally:
        if resume is not None:
            resume.cancel()
    if not assembly.ended:  # a clean end after the finish reason: the body's own end, the reply stands
        raise APIConnectionError("the stream ended before the reply did (no [DONE], nor a finish reason)")
    return Completion(assembly.message(), assembly.usage, assembly.model, assembly.provider, assembly.finish_reason,
                      tokens=collector.found() if collector else None), first_token


def _pause_reading(response: aiohttp.ClientResponse, seconds: float) -> asyncio.TimerHandle | None:
    """Leave the connection unread for `seconds`: the chunks that arrive meanwhile wait in the kernel
    (over TLS, in its layer) and are handed on at once, one wake-up of aiohttp and of this call
    instead of one each (bench/RESULTS.md). The timer that resumes it, to cancel if the call ends first."""
    transport = response.connection.transport if response.connection is not None else None
    if transport is None:
        return None
    transport.pause_reading()
    return asyncio.get_running_loop().call_later(seconds, transport.resume_reading)


def too_large(size: int, limit: int) -> ReplyTooLarge:
    return ReplyTooLarge(f"the reply is larger than --max_reply_mb={limit / (1 << 20):g} "
                         f"({size:,} bytes or more); nothing past the cap was kept")


def _origin(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def env_proxy(url: str) -> str | None:
    """The proxy the environment names for `url` (HTTPS_PROXY, HTTP_PROXY, ALL_PROXY), unless
    NO_PROXY covers its host: a name, a domain suffix, an address or a CIDR range (10.0.0.0/8),
    as curl reads it (urllib's lookup, which aiohttp uses, ignores CIDR ranges)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    proxies = urllib.request.getproxies_environment()
    if _bypassed(host, proxies.get("no", "")):
        return None
    return proxies.get(parts.scheme) or proxies.get("all")


def _bypassed(host: str, no_proxy: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for entry in (e.strip().lower() for e in no_proxy.split(",")):
        if not entry:
            continue
        if entry == "*":
            return True
        if address is not None:
            try:
                if address in ipaddress.ip_network(entry.strip("[]"), strict=False):
                    return True
                continue
            except ValueError:
                pass
        name = entry.lstrip(".").split(":")[0]
        if host.lower() == name or host.lower().endswith("." + name):
            return True
    return False


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


def request_body(settings: ModelSettings, args: dict) -> bytes:
    """`args` (request_args) serialized once by orjson: the SDK's typed `create` walks every message of the
    history in Python on every call, which cost more CPU than the rest of a turn."""
    if settings.stream:  # not part of request_args: the journal's hash does not depend on it
        args |= {"stream": True, "stream_options": {"include_usage": True}}
    if settings.token_ids:  # nor these: a reply without ids is told apart by its Reply (trajgen/journal.py)
        args |= settings.token_ids.fields
    return orjson.dumps(args)


@dataclass(frozen=True)
class Completion:
    """The parts of a 200 body the loop uses, as plain JSON values (no typed SDK objects: building
    and dumping them cost more CPU than the rest of a call)."""

    message: dict  # the first choice's message, without its null fields
    usage: object  # the usage object as sent (checked by the caller), None when absent
    model: object  # the `model` field as sent
    provider: object  # OpenRouter's `provider` field, when present
    finish_reason: object = None  # the first choice's, as sent ("length": cut by max_tokens)
    timing: dict = field(default_factory=dict)  # seconds to the first byte, to the first token, of generation
    tokens: dict | None = None  # with --token_ids: the ids and logprobs as sent, unchecked (token_ids.Collector)


def parse_completion(body: bytes | bytearray, tokens: bool = False) -> Completion:
    """The completion in a 200 body, or the error it carries instead; with `tokens`, its ids and logprobs."""
    data = stream.json_object(body, "the reply")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise MalformedResponse("the reply has no choices" if choices is None else f"the reply has choices: {choices!r}"[:2000])
    if not isinstance(choices[0], dict) or not isinstance(choices[0].get("message"), dict):
        raise MalformedResponse(f"the reply's first choice has no message: {str(choices[0])[:200]}")
    message = {k: v for k, v in choices[0]["message"].items() if v is not None}
    collector = token_ids.Collector() if tokens else None
    if collector:
        collector.take(data, choices[0])
    return Completion(message, data.get("usage"), data.get("model"), data.get("provider"),
                      choices[0].get("finish_reason"), tokens=collector.found() if collector else None)


def _retry_after(headers) -> float | None:
    """Seconds the endpoint asks us to wait (Retry-After-Ms, Retry-After: seconds or a date), or
    None when it asks nothing we can read (`soon`, `nan`, `inf`, a negative number): the backoff
    alone decides then."""
    if (seconds := _seconds(headers.get("retry-after-ms"))) is not None:
        return seconds / 1000
    value = headers.get("retry-after")
    if not value:
        return None
    if (seconds := _seconds(value)) is not None:
        return seconds
    try:
        parsed = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):  # what the date parser raises for other text
        return None
    return max(0.0, parsed.timestamp() - time.time())


def _seconds(value: str | None) -> float | None:
    """A header's number of seconds, when it is one a wait can be: finite and not negative."""
    try:
        seconds = float(value or "nan")
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


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


def unchanging(error: Exception) -> str | None:
    """What an endpoint that has never answered said that no retry will change, or None: a status
    that refuses every request alike (not a context length: that prompt alone is too long), or a
    2xx body that is not JSON. An error object in a 200 is not one: the endpoint speaks the API."""
    if isinstance(error, NotJSON):
        return f"answered with {error.shown}, not JSON: no chat endpoint there"
    if not isinstance(error, APIStatusError) or error.status_code not in NEVER_ANSWERED:
        return None
    status = error.status_code
    if status == 400 and CONTEXT_LENGTH.search(error.message):
        return None
    said = error.message.removeprefix(f"Error code: {status}").removeprefix(" - ")
    return f"answered HTTP {status} ({NEVER_ANSWERED[status]})" + (f": {said}" if said else "")


def retry_wait(error: Exception, previous: float, answered: bool) -> float | None:
    """Seconds to wait before the next try, or None when this error must not be retried.
    `previous` is the last wait (0 before the first retry); `answered` says whether the endpoint
    has answered this worker before: one out of reach that never answered stops the run."""
    status = status_of(error)
    if status is not None:
        if status in FATAL_STATUS:
            said = getattr(error, "message", error)
            raise FatalAPIError(f"{FATAL_STATUS[status]} (HTTP {status}): {said}") from error
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
    on_stall: Callable[[], None] = lambda: None,
    on_retry: Callable[[Exception, int, int, float], None] | None = None,
    args: dict | None = None,
) -> Completion:
    """One chat completion, retried per the policy above (tenacity); `on_stall` hears of every stalled
    try, `on_retry(error, attempt, max_retries, wait)` of each wait. `args`: the request_args of the
    other arguments, when the caller built them already (the journal, to hash them)."""
    body = request_body(settings, request_args(settings, messages, tools, forbid_tools) if args is None else args)

    def retried(error: BaseException) -> bool:
        if not endpoint.answered and (cause := unchanging(error)):
            if status_of(error) != 400 or endpoint.refusal == error.message:
                raise FatalAPIError(f"--base_url={settings.base_url} {cause}") from error
            endpoint.refusal = error.message  # maybe this prompt's own fault (an image too large)
        return isinstance(error, (APIStatusError, APIConnectionError, ProviderError))

    def heard(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception()
        if status_of(error) in OVERLOADED:  # even on the last try: the scheduler must hear of it
            on_throttle()
        if isinstance(error.__cause__, Stalled):
            on_stall()

    def wait(state: tenacity.RetryCallState) -> float:
        """An error never retried waits forever: past any --retry_budget, so it is raised as it is."""
        seconds = retry_wait(state.outcome.exception(), state.upcoming_sleep, endpoint.answered)
        return math.inf if seconds is None else seconds

    def told(state: tenacity.RetryCallState) -> None:
        if on_retry is not None:
            on_retry(state.outcome.exception(), state.attempt_number, settings.max_retries, state.upcoming_sleep)

    retrying = tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception(retried), after=heard, wait=wait, before_sleep=told, reraise=True,
        stop=tenacity.stop_after_attempt(settings.max_retries + 1) | tenacity.stop_before_delay(settings.retry_budget))
    completion = await retrying(endpoint.call, body)
    endpoint.answered = True
    return completion
