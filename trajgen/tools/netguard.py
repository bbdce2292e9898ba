"""Keep web_extract and the browser out of loopback, private and link-local networks.

Both fetch from the runner's network, at URLs the model chose and pages chose, so without a check a
prompt could read the user's internal services or a cloud metadata endpoint (169.254.169.254) into
its trajectory. A URL may be fetched when it is http(s) and every address its host resolves to is
globally routable; `allow_private` (--allow_private_urls) turns the address check off, not the scheme
check. Nothing is cached across prompts.

`check_url` is the check; web_extract runs it on the URL and on every redirect hop (httpx then
resolves the name again, so a DNS answer that changes in between is not caught there). `Guard` applies it
to everything one browser context connects to: it is that context's SOCKS5 proxy on 127.0.0.1, which
checks each host once, refuses it if any of its addresses is not public, and otherwise connects to
exactly the addresses it checked (so a DNS answer that changes after the check cannot get through).
A Playwright route cannot do this job: routes never see redirect hops, nor WebSockets.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Awaitable, Callable
from urllib.parse import urlsplit

CONNECT_TIMEOUT = 10.0
# IPv6 addresses whose last 32 bits are an IPv4 address: compatible, mapped, translated, NAT64
IPV4_IN_IPV6 = [ipaddress.ip_network(n) for n in ("::/96", "::ffff:0:0/96", "::ffff:0:0:0/96", "64:ff9b::/96")]
LOCAL_NAT64 = ipaddress.ip_network("64:ff9b:1::/48")  # NAT64 of the network's own choosing: never public
Verdict = tuple[list[str], str | None]  # the host's addresses, or why it is refused


def is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Globally routable and not multicast. An IPv6 address that carries an IPv4 one (IPV4_IN_IPV6,
    6to4) must pass for both."""
    if address.version == 6:
        if address in LOCAL_NAT64:
            return False
        embedded = address.sixtofour
        if any(address in network for network in IPV4_IN_IPV6):
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF)
        if embedded is not None and not is_public(embedded):
            return False
    return address.is_global and not address.is_multicast


async def check_host(host: str) -> Verdict:
    """What `host` resolves to (an IP literal is itself), or why it is refused: it does not resolve,
    or one of its addresses is not public."""
    try:
        addresses = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError, ValueError) as e:
            return [], f"refused: cannot resolve {host}: {e}"
        addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
    for address in addresses:
        if not is_public(address):
            where = host if str(address) == host else f"{host} ({address})"
            return [], (f"refused: {where} is a loopback, private, link-local or otherwise non-public address "
                        "(--allow_private_urls allows it)")
    return [str(a) for a in addresses], None


async def check_url(url: str, allow_private: bool,
                    lookup: Callable[[str], Awaitable[Verdict]] = check_host) -> str | None:
    """None when `url` may be fetched, else why not, in one line."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:  # e.g. an unclosed [IPv6 bracket
        host = None
    if host is None or parts.scheme not in ("http", "https"):
        return f"refused: {url[:200]!r} is not an http(s) URL"
    if allow_private:
        return None
    return (await lookup(host))[1]


class Guard:
    """One browser context's SOCKS5 proxy (see above). `refused` lists its refusals, in order."""

    def __init__(self) -> None:
        self.refused: list[str] = []
        self._verdicts: dict[str, asyncio.Future] = {}
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()  # both ends of every connection it relays

    async def check(self, host: str) -> Verdict:
        """check_host, run once per host for this guard's life (concurrent askers share the answer)."""
        if host not in self._verdicts:
            self._verdicts[host] = asyncio.ensure_future(check_host(host))
        return await asyncio.shield(self._verdicts[host])

    async def start(self) -> str:
        """The proxy's URL, for Playwright's `proxy` option (started at the first call)."""
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"socks5://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._open:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open.add(writer)
        upstream = None
        try:
            host, port = await _socks_request(reader, writer)
            addresses, reason = await self.check(host)
            if reason:
                self.refused.append(reason)
            for address in addresses:
                try:
                    upstream = await asyncio.wait_for(asyncio.open_connection(address, port), CONNECT_TIMEOUT)
                    break
                except (OSError, asyncio.TimeoutError):
                    continue
            # reply: succeeded, connection not allowed by ruleset, or connection refused
            writer.write(b"\x05" + (b"\x00" if upstream else b"\x02" if reason else b"\x05") + b"\x00\x01" + bytes(6))
            if upstream:
                self._open.add(upstream[1])
                await asyncio.gather(_pipe(reader, upstream[1]), _pipe(upstream[0], writer))
        except (asyncio.IncompleteReadError, OSError, ValueError):
            pass  # a client that went away, or one that speaks something else
        finally:
            for end in (writer, upstream[1]) if upstream else (writer,):
                self._open.discard(end)
                end.close()


async def _socks_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[str, int]:
    """The host and port of a SOCKS5 CONNECT request (RFC 1928), after agreeing on no authentication."""
    version, methods = await reader.readexactly(2)
    await reader.readexactly(methods)
    writer.write(b"\x05\x00")
    version, command, _, kind = await reader.readexactly(4)
    if version != 5 or command != 1 or kind not in (1, 3, 4):
        raise ValueError("not a SOCKS5 CONNECT request")
    if kind == 3:  # a name (Chromium sends names, leaving resolution to the proxy)
        host = (await reader.readexactly((await reader.readexactly(1))[0])).decode()
    else:
        family, size = (socket.AF_INET, 4) if kind == 1 else (socket.AF_INET6, 16)
        host = socket.inet_ntop(family, await reader.readexactly(size))
    return host.strip("[]"), int.from_bytes(await reader.readexactly(2), "big")


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction of a connection until it ends, then end it on the other side too."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.write_eof()
    except (OSError, RuntimeError):  # a reset, or the other side already closed
        writer.close()
