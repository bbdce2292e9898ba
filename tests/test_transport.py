"""The chat calls' HTTP/1.1 client against real sockets on 127.0.0.1: servers that answer the way real
endpoints and proxies do (chunked, closing, informational replies, a kept-alive connection closed
while idle), TLS with a certificate the system store is told to trust, and a CONNECT proxy."""
from __future__ import annotations

import asyncio
import base64
import shutil
import ssl
import subprocess

import pytest

from tests.conftest import arun
from trajgen import transport

OK = b'{"ok": true}'


async def _serve(handler, tls: ssl.SSLContext | None = None):
    """A server on 127.0.0.1 running `handler(head, reader, writer)` for each request it reads."""
    heads: list[bytes] = []

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), b"0"))
                await reader.readexactly(length)
                heads.append(head)
                if await handler(head, reader, writer) == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", 0, ssl=tls)
    return server, server.sockets[0].getsockname()[1], heads


def _answer(reply: bytes, close: bool = False):
    async def handler(head, reader, writer):
        writer.write(reply)
        await writer.drain()
        return "close" if close else None
    return handler


def test_bodies_by_length_chunked_and_closing_and_informational_replies_skipped():
    async def scenario():
        results = {}
        for name, reply in {
            "length": b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n" + OK,
            "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;x=1\r\n{\"ok\"\r\n7\r\n: true}\r\n0\r\nX-T: 1\r\n\r\n",
            "early hints": b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 12\r\n\r\n" + OK,
        }.items():
            server, port, heads = await _serve(_answer(reply))
            client = transport.Client(f"http://127.0.0.1:{port}/v1/chat/completions?x=1", 2)
            first = await client.post(b"{}", {"Authorization": "Bearer k"})
            second = await client.post(b"{}", {"Authorization": "Bearer k"})
            results[name] = (first.status, first.body, second.body, len(heads))
            client.close()
            server.close()
        server, port, heads = await _serve(_answer(b"HTTP/1.1 500 Oops\r\nConnection: close\r\nRetry-After: 3\r\n\r\nboom", close=True))
        client = transport.Client(f"http://127.0.0.1:{port}/v1/chat/completions", 2)
        closing = await client.post(b"{}", {})
        server.close()
        return results, closing, heads[0]

    results, closing, head = arun(scenario())
    assert results == {"length": (200, OK, OK, 2), "chunked": (200, OK, OK, 2), "early hints": (201, OK, OK, 2)}
    assert (closing.status, closing.body, closing.headers["retry-after"]) == (500, b"boom", "3")
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n") and b"\r\nAccept-Encoding: identity\r\n" in head


def test_a_kept_alive_connection_the_server_closed_is_replaced_and_a_broken_reply_is_an_error():
    async def scenario():
        served = []

        async def once_then_close(head, reader, writer):  # answers, then closes while the client holds it idle
            served.append(1)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n" + OK)
            await writer.drain()
            return "close"

        server, port, heads = await _serve(once_then_close)
        client = transport.Client(f"http://127.0.0.1:{port}/v1", 1)
        bodies = [(await client.post(b"{}", {})).body for _ in range(3)]
        server.close()

        async def cut(head, reader, writer):  # promises 50 bytes, sends 12, closes
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n" + OK)
            await writer.drain()
            return "close"

        broken, broken_port, _ = await _serve(cut)
        with pytest.raises(asyncio.IncompleteReadError):
            await transport.Client(f"http://127.0.0.1:{broken_port}/v1", 1).post(b"{}", {})
        garbage, garbage_port, _ = await _serve(_answer(b"SSH-2.0-OpenSSH\r\n\r\n"))
        with pytest.raises(transport.ProtocolError):
            await transport.Client(f"http://127.0.0.1:{garbage_port}/v1", 1).post(b"{}", {})
        broken.close()
        garbage.close()

        async def answer_then_cut(head, reader, writer):  # the second answer: a head, then the connection ends
            if len(cut_heads) == 1:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n" + OK)
                await writer.drain()
                return None
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n")
            await writer.drain()
            return "close"

        cutting, cut_port, cut_heads = await _serve(answer_then_cut)
        client = transport.Client(f"http://127.0.0.1:{cut_port}/v1", 1)
        assert (await client.post(b"{}", {})).body == OK
        with pytest.raises(asyncio.IncompleteReadError):  # the server answered: the request is not sent again
            await client.post(b"{}", {})
        cutting.close()
        return bodies, len(served), len(cut_heads)

    bodies, served, cut = arun(scenario())
    assert bodies == [OK] * 3 and served == 3  # each request sent once: the closed connection was never written to
    assert cut == 2


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(folder / "key.pem"),
                    "-out", str(folder / "cert.pem")], check=True, capture_output=True)
    return folder / "cert.pem", folder / "key.pem"


def test_tls_with_the_system_store_and_a_connect_proxy_with_basic_auth(certificate, monkeypatch):
    cert, key = certificate
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)

    async def scenario():
        server, port, heads = await _serve(_answer(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n" + OK), tls)
        untrusted = transport.Client(f"https://127.0.0.1:{port}/v1/chat/completions", 1)
        with pytest.raises(ssl.SSLCertVerificationError):
            await untrusted.post(b"{}", {})
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # what a user's trust store would hold
        direct = await transport.Client(f"https://localhost:{port}/v1/chat/completions", 1).post(b"{}", {})
        tunnels = []

        async def proxy(reader, writer):  # a CONNECT proxy: one tunnel per connection
            head = await reader.readuntil(b"\r\n\r\n")
            tunnels.append(head)
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()

            async def pipe(src, dst):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
                dst.close()

            await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer), return_exceptions=True)

        relay = await asyncio.start_server(proxy, "127.0.0.1", 0)
        relay_port = relay.sockets[0].getsockname()[1]
        client = transport.Client(f"https://localhost:{port}/v1/chat/completions", 1,
                                  f"http://user:p%40ss@127.0.0.1:{relay_port}")
        tunnelled = [(await client.post(b"{}", {})).body for _ in range(2)]
        client.close()
        relay.close()
        server.close()
        return direct.body, tunnelled, tunnels, heads

    direct, tunnelled, tunnels, heads = arun(scenario())
    assert direct == OK and tunnelled == [OK, OK]
    assert len(tunnels) == 1  # the tunnel is kept alive like any connection
    auth = base64.b64encode(b"user:p@ss").decode()
    assert tunnels[0].startswith(b"CONNECT localhost:") and f"Proxy-Authorization: Basic {auth}".encode() in tunnels[0]
    assert all(b"Proxy-Authorization" not in h for h in heads)  # the proxy's credentials never reach the endpoint


def test_plain_http_through_a_proxy_sends_the_whole_url_and_an_https_proxy_is_refused():
    async def scenario():
        server, port, heads = await _serve(_answer(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n" + OK))
        client = transport.Client("http://api.example:8080/v1/chat/completions", 1, f"http://u:p@127.0.0.1:{port}")
        body = (await client.post(b"{}", {})).body
        server.close()
        return body, heads[0]

    body, head = arun(scenario())
    assert body == OK and head.startswith(b"POST http://api.example:8080/v1/chat/completions HTTP/1.1\r\n")
    assert b"Host: api.example:8080\r\n" in head and b"Proxy-Authorization: Basic " in head
    with pytest.raises(ValueError, match="https:// proxy"):
        transport.Client("https://api.example/v1", 1, "https://proxy.example:3128")
