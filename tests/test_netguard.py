"""netguard: which URLs web_extract and the browser may fetch, and the browser's SOCKS5 guard.

No test here sends anything beyond 127.0.0.0/8: private and metadata addresses are IP literals,
refused before any lookup or connection; the only names looked up are `localhost` (/etc/hosts) and
numeric forms of 127.0.0.1 that getaddrinfo parses without asking DNS (checked below); public
addresses are only ever passed to check_url, which makes no request.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket

import pytest

from trajgen.tools.netguard import Guard, check_url, is_public

PRIVATE = [
    "http://127.0.0.1:8080/", "http://localhost/", "http://LOCALHOST/admin", "http://[::1]/",
    "http://10.1.2.3/", "http://192.168.1.1/", "http://172.16.0.1/", "http://169.254.169.254/latest/meta-data/",
    "https://100.64.0.1/", "http://0.0.0.0:8080/", "http://224.0.0.251/", "http://240.0.0.1/",
    "http://[fc00::1]/", "http://[fd00:ec2::254]/", "http://[fe80::1]/", "http://[::]/", "http://[ff02::1]/",
    "http://[::ffff:127.0.0.1]/", "http://[::ffff:169.254.169.254]/",  # IPv4-mapped
    "http://[2002:a9fe:a9fe::]/", "http://[64:ff9b::a9fe:a9fe]/",  # 6to4 and NAT64 forms of 169.254.169.254
    "http://127.1/", "http://0x7f.1/", "http://2130706433/", "http://0177.0.0.1/",  # what inet_aton reads as 127.0.0.1
]
NUMERIC = ["127.1", "0x7f.1", "2130706433", "0177.0.0.1"]
NOT_HTTP = ["file:///etc/passwd", "ftp://example.com/", "javascript:alert(1)", "data:text/html,hi",
            "chrome://settings", "about:blank", "http:///no-host", "//example.com/", "example.com", "", "http://[::1"]


def run(coroutine):
    return asyncio.run(coroutine)


def test_numeric_hosts_are_parsed_without_dns():
    """The premise of the numeric cases above: getaddrinfo reads them itself, so no query leaves."""
    for host in NUMERIC:
        assert socket.getaddrinfo(host, None, flags=socket.AI_NUMERICHOST)[0][4][0] == "127.0.0.1"


@pytest.mark.parametrize("url", PRIVATE)
def test_private_addresses_are_refused_and_allowed_with_the_flag(url):
    reason = run(check_url(url, allow_private=False))
    assert reason.startswith("refused: ") and "--allow_private_urls" in reason and "\n" not in reason
    assert run(check_url(url, allow_private=True)) is None


def test_a_name_is_judged_by_what_it_resolves_to():
    assert "localhost (127.0.0.1)" in run(check_url("http://localhost:8080/", False))
    too_long = "a" * 64 + ".example"  # refused by the IDNA encoder before any lookup
    assert run(check_url(f"http://{too_long}/", False)).startswith(f"refused: cannot resolve {too_long}")


@pytest.mark.parametrize("url", NOT_HTTP)
def test_other_schemes_are_refused_even_with_the_flag(url):
    for allow in (False, True):
        assert "is not an http(s) URL" in run(check_url(url, allow))


def test_public_addresses_are_accepted_without_a_request():
    """IP literals need no lookup, and check_url never connects: nothing is sent anywhere."""
    for url in ("http://93.184.215.14/", "https://93.184.215.14:8443/path?q=1", "http://[2606:4700:4700::1111]/",
                "http://[::ffff:93.184.215.14]/"):
        assert run(check_url(url, allow_private=False)) is None, url


def test_is_public_reads_addresses_inside_ipv6():
    for address in ("8.8.8.8", "2606:4700:4700::1111", "2002:808:808::", "64:ff9b::808:808"):
        assert is_public(ipaddress.ip_address(address)), address
    for address in ("::ffff:10.0.0.1", "::a9fe:a9fe", "::ffff:0:a9fe:a9fe", "2002:7f00:1::", "64:ff9b::a00:1",
                    "64:ff9b:1::808:808", "239.1.2.3", "ff0e::1", "100.100.100.200", "::", "::1"):
        assert not is_public(ipaddress.ip_address(address)), address


async def _socks_connect(proxy: str, host: str, port: int, literal: bool = False) -> int:
    """A minimal SOCKS5 client, as Chromium talks to the guard: the reply code of a CONNECT."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(proxy.rsplit(":", 1)[1]))
    writer.write(b"\x05\x01\x00")
    assert await reader.readexactly(2) == b"\x05\x00"
    target = b"\x01" + socket.inet_aton(host) if literal else b"\x03" + bytes([len(host)]) + host.encode()
    writer.write(b"\x05\x01\x00" + target + port.to_bytes(2, "big"))
    reply = await reader.readexactly(10)
    writer.close()
    return reply[1]


def test_guard_refuses_private_targets_before_connecting_and_resolves_each_host_once():
    async def main() -> None:
        accepted = []
        server = await asyncio.start_server(lambda r, w: (accepted.append(1), w.close()), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        guard = Guard()
        proxy = await guard.start()
        try:
            assert await _socks_connect(proxy, "127.0.0.1", port) == 2  # "not allowed by ruleset"
            assert await _socks_connect(proxy, "127.0.0.1", port, literal=True) == 2
            assert await _socks_connect(proxy, "localhost", port) == 2
            assert await _socks_connect(proxy, "169.254.169.254", 80) == 2
            assert accepted == []  # refused before any connection
            assert len(guard.refused) == 4 and "localhost (127.0.0.1)" in guard.refused[2]
            assert "169.254.169.254 is a loopback, private, link-local" in guard.refused[3]
            first = await guard.check("localhost")
            assert await guard.check("localhost") is first  # one verdict per host for the guard's life
            assert await Guard().check("localhost") is not first  # another prompt's guard asks again
        finally:
            await guard.close()
            server.close()

    run(main())
