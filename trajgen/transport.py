"""HTTP/1.1 POSTs to one endpoint over kept-alive connections: what a chat call needs, and no more.

aiohttp's client cost about 0.2 ms of CPU per call here, a fifth of the runner's whole cost per
call, and its import 0.2 s in every worker (bench/RESULTS.md). This one sends one request at a
time per connection over a pool of at most `connections` kept-alive connections; TLS trusts the
system's store (as aiohttp and the openai SDK's default transport do); a proxy from the
environment is used as aiohttp used it (CONNECT for https, the absolute URL for http, Basic auth
from its URL). A body is read by Content-Length, chunked, or up to the close of the connection.
No redirects, cookies or compression: an API endpoint needs none, and `Accept-Encoding: identity`
says so.
"""
from __future__ import annotations

import asyncio
import base64
import ssl
import urllib.parse
from dataclasses import dataclass

HEAD_LIMIT = 1 << 16  # bytes of a status line and its headers


class ProtocolError(Exception):
    """The other end does not speak HTTP/1.1 as it should."""


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]  # names lower-cased
    body: bytes


@dataclass(frozen=True)
class _Origin:
    host: str
    port: int
    tls: bool

    @classmethod
    def of(cls, url: str) -> "_Origin":
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url}")
        return cls(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), parts.scheme == "https")

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


class Client:
    """Requests to `url` (one endpoint), at most `connections` at once, through `proxy` if given."""

    def __init__(self, url: str, connections: int, proxy: str | None = None) -> None:
        self.origin = _Origin.of(url)
        parts = urllib.parse.urlsplit(url)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.proxy = _Origin.of(proxy) if proxy else None
        if self.proxy and self.proxy.tls:
            raise ValueError(f"an https:// proxy is not supported: {proxy}")
        proxy_auth = _basic(urllib.parse.urlsplit(proxy)) if proxy else None
        through_proxy = self.proxy is not None and not self.origin.tls  # plain http: the proxy gets the whole URL
        self._target = (urllib.parse.urlunsplit(parts._replace(netloc=self.origin.authority, fragment=""))
                        if through_proxy else path).encode()
        self._fixed = f"Host: {self.origin.authority}\r\nAccept-Encoding: identity\r\n".encode()
        if through_proxy and proxy_auth:
            self._fixed += f"Proxy-Authorization: {proxy_auth}\r\n".encode()
        self._connect_auth = proxy_auth if self.proxy and self.origin.tls else None
        self._tls = ssl.create_default_context() if self.origin.tls else None
        self._slots = asyncio.Semaphore(connections)
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, body: bytes, headers: dict[str, str]) -> Response:
        """The response; OSError, asyncio.IncompleteReadError or ProtocolError when the exchange broke.
        A kept-alive connection that breaks before a byte of the answer came back (the server closed
        it while idle, and never read the request) is replaced at once; once any answer came back,
        the request is not sent again here."""
        head = self._head(body, headers)
        async with self._slots:
            while True:
                reused, (reader, writer) = await self._connection()
                try:
                    try:
                        first = await _send(reader, writer, head + body)
                    except _Unanswered:
                        if reused:  # closed by the server while idle: try a new connection
                            writer.close()
                            continue
                        raise
                    response, keep = await _answer(reader, first)
                except BaseException:
                    writer.close()
                    raise
                if keep:
                    self._idle.append((reader, writer))
                else:
                    writer.close()
                return response

    def _head(self, body: bytes, headers: dict[str, str]) -> bytes:
        lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        return b"POST %s HTTP/1.1\r\n%s%sContent-Length: %d\r\n\r\n" % (self._target, self._fixed, lines.encode(), len(body))

    async def _connection(self) -> tuple[bool, tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        """(reused, the connection): an idle one still open, else a new one."""
        while self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return True, (reader, writer)
            writer.close()
        return False, await self._open()

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        origin = self.origin
        if self.proxy is None:
            return await asyncio.open_connection(origin.host, origin.port, ssl=self._tls, limit=HEAD_LIMIT,
                                                 server_hostname=origin.host if self._tls else None)
        reader, writer = await asyncio.open_connection(self.proxy.host, self.proxy.port, limit=HEAD_LIMIT)
        if not origin.tls:
            return reader, writer
        try:
            auth = f"Proxy-Authorization: {self._connect_auth}\r\n" if self._connect_auth else ""
            writer.write(f"CONNECT {origin.authority} HTTP/1.1\r\nHost: {origin.authority}\r\n{auth}\r\n".encode())
            await writer.drain()
            status, _, _ = await _read_head(reader)
            if status != 200:
                raise ConnectionRefusedError(f"the proxy {self.proxy.authority} refused the tunnel (HTTP {status})")
            await writer.start_tls(self._tls, server_hostname=origin.host)
        except BaseException:
            writer.close()
            raise
        return reader, writer

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle = []


def _basic(proxy: urllib.parse.SplitResult) -> str | None:
    if proxy.username is None:
        return None
    pair = f"{urllib.parse.unquote(proxy.username)}:{urllib.parse.unquote(proxy.password or '')}"
    return "Basic " + base64.b64encode(pair.encode()).decode()


class _Unanswered(ConnectionError):
    """The connection broke before a byte of the answer came back."""


async def _send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> tuple[int, bytes, dict[str, str]]:
    """Send the request; the head of the first thing that comes back."""
    try:
        writer.write(request)
        await writer.drain()
    except ConnectionError as e:
        raise _Unanswered(str(e)) from e
    try:
        return await _read_head(reader)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise
        raise _Unanswered("the connection ended before an answer") from e


async def _answer(reader: asyncio.StreamReader, first: tuple[int, bytes, dict[str, str]]) -> tuple[Response, bool]:
    """(the response, whether the connection can carry another request), from the first head on."""
    status, version, headers = first
    while status < 200:  # 1xx (103 Early Hints...): informational, the answer follows
        status, version, headers = await _read_head(reader)
    keep = version == b"HTTP/1.1" and "close" not in headers.get("connection", "").lower()
    if status in (204, 304):
        return Response(status, headers, b""), keep
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return Response(status, headers, await _read_chunked(reader)), keep
    if (length := headers.get("content-length")) is not None:
        if not length.isdigit():
            raise ProtocolError(f"Content-Length is not a number: {length[:50]!r}")
        return Response(status, headers, await reader.readexactly(int(length))), keep
    return Response(status, headers, await reader.read()), False  # delimited by the connection's end


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, bytes, dict[str, str]]:
    """(status, HTTP version, headers) of the next response on the connection."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise ProtocolError(f"a response head longer than {HEAD_LIMIT} bytes") from None
    status_line, *lines = raw[:-4].split(b"\r\n")
    version, _, rest = status_line.partition(b" ")
    code = rest[:3]
    if not version.startswith(b"HTTP/1.") or not code.isdigit():
        raise ProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.decode("latin-1").partition(":")
        if not colon:
            raise ProtocolError(f"a header line without a colon: {line[:80]!r}")
        name, value = name.strip().lower(), value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return int(code), version, headers


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size_line = await reader.readuntil(b"\r\n")
        try:
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise ProtocolError(f"a chunk size that is not hexadecimal: {size_line[:40]!r}") from None
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, up to the empty line
                pass
            return bytes(body)
        body += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise ProtocolError("a chunk not followed by CRLF")
