"""web_search against a fake API of each provider, web_extract against a local site: all on 127.0.0.1.

The local site is on a loopback address, so tests that read it allow private URLs; the ones that
test the refusal do not, and check that the site got no request.

`local_site` and `fake_api` are also used by the browser, vision/image and end-to-end tests.
"""
from __future__ import annotations

import asyncio
import html
import json
import struct
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

import httpx
import model_tools
from trajgen.registry import REGISTRY, dispatch
from trajgen.tools import ToolContext, ToolSettings, web
from trajgen.tools.web import MAX_PAGE_CHARS, MAX_URLS, web_extract, web_search

PROVIDER_ENV = ("TAVILY_API_KEY", "EXA_API_KEY", "FIRECRAWL_API_KEY", "SEARXNG_URL", "TAVILY_BASE_URL",
                "EXA_BASE_URL", "FIRECRAWL_BASE_URL", "FAL_KEY", "FAL_BASE_URL", "FAL_MODEL")


def tiny_png() -> bytes:
    """A valid 1x1 PNG, made here so no file has to be shipped."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0\xff\x80\0")) + chunk(b"IEND", b"")


PNG = tiny_png()
INDEX = """<!doctype html><html><head><title>Local Test Site</title></head><body>
<article><h1>Welcome to the test site</h1>
<p>The quick brown fox lives on the loopback interface and reads every page twice.
This paragraph is long enough for an extractor to keep it as main content of the page.</p>
<p>Next, <a href="/form">open the form</a> to say hello.</p>
<p><img src="/cat.png" alt="A tiny cat"></p>
""" + "".join(f"<p>Filler paragraph {i} keeps the page taller than the window.</p>\n" for i in range(120)) + """
</article></body></html>"""
FORM = """<!doctype html><html><head><title>Greeting Form</title></head><body>
<h1>Say hello</h1>
<form action="/result" method="get"><label>Your name <input type="text" name="q"></label>
<button type="submit">Send</button></form></body></html>"""
# 2 GB held by the page's script (typed arrays, written so that their pages are really taken)
HOG = """<!doctype html><html><head><title>Hog</title></head><body><script>
const held = []; for (let i = 0; i < 256; i++) held.push(new Uint8Array(8 << 20).fill(1));
document.title = "held " + held.length;
</script></body></html>"""


class LocalSite:
    """A small website on 127.0.0.1, recording the headers of every request it gets."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        site = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                site.requests.append({"path": parts.path, "headers": {k.lower(): v for k, v in self.headers.items()}})
                status, content_type, body, location = site.route(parts.path, parse_qs(parts.query))
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def route(self, path: str, query: dict) -> tuple[int, str, bytes, str | None]:
        typed = html.escape(query.get("q", [""])[0])
        pages = {
            "/": (200, "text/html; charset=utf-8", INDEX.encode(), None),
            "/form": (200, "text/html; charset=utf-8", FORM.encode(), None),
            "/result": (200, "text/html; charset=utf-8",
                        f"<html><head><title>Result</title></head><body><p>You typed: {typed}</p></body></html>".encode(), None),
            "/cat.png": (200, "image/png", PNG, None),
            "/data.json": (200, "application/json", b'{"answer": 42}', None),
            "/big.txt": (200, "text/plain", b"x" * (3 * 1024 * 1024), None),
            "/hog": (200, "text/html; charset=utf-8", HOG.encode(), None),
            "/redirect": (302, "text/plain", b"", "/"),
            "/loop": (302, "text/plain", b"", "/loop"),
            "/to-file": (302, "text/plain", b"", "file:///etc/passwd"),
        }
        return pages.get(path, (404, "text/plain", b"not found", None))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def local_site() -> Iterator[LocalSite]:
    site = LocalSite()
    yield site
    site.close()


class FakeAPI:
    """A JSON API on 127.0.0.1: each path answers its canned (status, body), and every request is recorded."""

    def __init__(self, routes: dict[str, tuple[int, object]]) -> None:
        self.routes, self.requests = routes, []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def answer(self, body: bytes | None) -> None:
                parts = urlsplit(self.path)
                api.requests.append({"method": self.command, "path": parts.path, "query": parse_qs(parts.query),
                                     "headers": {k.lower(): v for k, v in self.headers.items()},
                                     "json": json.loads(body) if body else None})
                status, payload = api.routes.get(parts.path, (404, {"error": "no such route"}))
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self.answer(None)

            def do_POST(self) -> None:
                self.answer(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_api() -> Iterator:
    """Factory: fake_api({path: (status, json)}) -> FakeAPI, stopped at the end of the test."""
    apis: list[FakeAPI] = []

    def start(routes: dict[str, tuple[int, object]]) -> FakeAPI:
        apis.append(FakeAPI(routes))
        return apis[-1]

    yield start
    for api in apis:
        api.close()


@pytest.fixture(autouse=True)
def no_provider_env(monkeypatch) -> None:
    """Only what a test sets: no provider key of the machine may leak in (or out)."""
    for name in PROVIDER_ENV:
        monkeypatch.delenv(name, raising=False)


def run(coroutine):
    return asyncio.run(coroutine)


def context(allow_private_urls: bool = True, **settings) -> ToolContext:
    """A prompt's context; private URLs allowed unless a test says otherwise (the local site is on 127.0.0.1)."""
    async def no_sandbox():
        raise AssertionError("web tools never open the sandbox")

    return ToolContext(sandbox=no_sandbox, settings=ToolSettings(allow_private_urls=allow_private_urls, **settings))


# --- web_extract ---


def test_web_extract_turns_a_local_page_into_markdown(local_site):
    result = run(web_extract(context(), urls=[local_site.url + "/"]))
    assert result["success"] is True and result["error"] is None
    page = result["results"][0]
    assert page["title"] in ("Local Test Site", "Welcome to the test site")  # trafilatura may prefer the h1
    assert page["final_url"] == local_site.url + "/"
    assert "# Welcome to the test site" in page["content"]
    assert "The quick brown fox lives on the loopback interface" in page["content"]
    assert f"[open the form]({local_site.url}/form)" in page["content"]  # links kept, made absolute
    assert "<p>" not in page["content"] and page["truncated"] is False


def test_web_extract_follows_redirects_up_to_a_limit(local_site):
    result = run(web_extract(context(), urls=[local_site.url + "/redirect", local_site.url + "/loop",
                                              local_site.url + "/to-file"]))
    moved, looped, to_file = result["results"]
    assert result["success"] is True  # one page of three came back
    assert moved["final_url"] == local_site.url + "/" and "quick brown fox" in moved["content"]
    assert looped["error"] == "more than 5 redirects"
    # every hop is checked, the flag notwithstanding: a redirect cannot reach a local file
    assert to_file["error"] == "redirected to file:/etc/passwd: refused: 'file:/etc/passwd' is not an http(s) URL"
    assert sum(r["path"] == "/loop" for r in local_site.requests) == 6  # the first request and 5 redirects


def test_web_extract_refuses_private_addresses_without_the_flag(local_site):
    port = local_site.server.server_port
    batches = [[f"http://127.0.0.1:{port}/", f"http://localhost:{port}/", f"http://[::1]:{port}/",
                f"http://127.1:{port}/", f"http://0.0.0.0:{port}/"],
               [f"http://[::ffff:127.0.0.1]:{port}/", f"http://2130706433:{port}/", "http://10.1.2.3/",
                "http://169.254.169.254/latest/meta-data/", "http://[fd00:ec2::254]/"]]
    for urls in batches:
        result = run(web_extract(context(allow_private_urls=False), urls=urls))
        assert result["success"] is False
        for page in result["results"]:
            assert page["error"].startswith("refused: ") and "--allow_private_urls" in page["error"], page
    assert "localhost (127.0.0.1)" in run(web_extract(context(allow_private_urls=False),
                                                      urls=[f"http://localhost:{port}/"]))["error"]
    assert local_site.requests == []  # refused before any request, not by a failed one


def test_web_extract_checks_every_redirect_hop_before_requesting_it():
    """A redirect from an allowed page to a private address is refused before the request.

    With the flag off an allowed page must be on a public address, and no test may reach one; so
    this drives `web._fetch`, web_extract's redirect loop, over httpx's MockTransport, which answers
    in-process: nothing is sent anywhere. Only the IP literal 93.184.215.14 is checked (no lookup),
    and its answer redirects to private addresses; the transport records what was requested.
    """
    requested: list[str] = []
    targets = {"/to-metadata": "http://169.254.169.254/latest/meta-data/", "/to-localhost": "http://localhost:8080/",
               "/to-ten": "//10.1.2.3/admin", "/to-public": "/page"}

    def answer(request: httpx.Request) -> httpx.Response:
        requested.append(str(request.url))
        if request.url.path in targets:
            return httpx.Response(302, headers={"Location": targets[request.url.path]})
        return httpx.Response(200, text="a public page", headers={"Content-Type": "text/plain"})

    async def fetch(path: str) -> dict:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await web._fetch(client, "http://93.184.215.14" + path, allow_private=False)

    metadata = run(fetch("/to-metadata"))
    assert metadata["error"].startswith("redirected to http://169.254.169.254/latest/meta-data/: refused: ")
    assert "localhost (127.0.0.1)" in run(fetch("/to-localhost"))["error"]
    assert run(fetch("/to-ten"))["error"].startswith("redirected to http://10.1.2.3/admin: refused: 10.1.2.3 is")
    allowed = run(fetch("/to-public"))  # an allowed hop is followed
    assert allowed["error"] is None and allowed["final_url"] == "http://93.184.215.14/page"
    assert requested == ["http://93.184.215.14" + p for p in ("/to-metadata", "/to-localhost", "/to-ten", "/to-public",
                                                              "/page")]


def test_web_extract_connects_to_the_address_it_checked(monkeypatch):
    """DNS rebinding: the name is resolved once, checked, and the request goes to that very address.

    The lookup answers a public address for the check; were the name resolved again it could be
    private. MockTransport records where the request really goes (nothing leaves the process)."""
    requested: list[tuple[str, str]] = []

    async def lookup(host: str):
        assert host == "rebind.example"
        return ["93.184.215.14"], None

    def answer(request: httpx.Request) -> httpx.Response:
        requested.append((str(request.url), request.headers["host"]))
        return httpx.Response(200, text="a public page", headers={"Content-Type": "text/plain"})

    async def fetch() -> dict:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await web._fetch(client, "http://rebind.example:8080/page", allow_private=False)

    monkeypatch.setattr(web, "check_host", lookup)
    page = run(fetch())
    assert page["error"] is None and page["final_url"] == "http://rebind.example:8080/page"
    assert requested == [("http://93.184.215.14:8080/page", "rebind.example:8080")]


def test_web_extract_reads_text_types_only_and_caps_size(local_site):
    result = run(web_extract(context(), urls=[local_site.url + "/cat.png", local_site.url + "/big.txt",
                                              local_site.url + "/data.json", local_site.url + "/missing"]))
    image, big, data, missing = result["results"]
    assert image["error"] == "content type image/png is not text; not fetched"
    assert big["error"] is None and big["truncated"] is True and len(big["content"]) == MAX_PAGE_CHARS
    assert json.loads(data["content"]) == {"answer": 42} and data["title"] is None
    assert missing["error"] == "HTTP 404"


def test_web_extract_fails_when_no_page_comes_back_and_checks_arguments(local_site):
    result = run(web_extract(context(), urls=[local_site.url + "/missing"]))
    assert result["success"] is False and result["error"] == f"{local_site.url}/missing: HTTP 404"
    refused = run(web_extract(context(), urls=["http://127.0.0.1:1/"]))  # nothing listens on port 1
    assert refused["success"] is False and "ConnectError" in refused["error"]
    single = run(web_extract(context(), urls=local_site.url + "/data.json"))  # a lone string is accepted
    assert single["success"] is True
    for bad in (None, [], [3], ["file:///etc/passwd"], ["chrome://settings"], ["/relative"],
                [local_site.url] * (MAX_URLS + 1)):
        outcome = run(web_extract(context(), urls=bad))
        assert outcome["success"] is False and outcome["error"], bad


def test_web_extract_sends_no_credentials_to_the_site(local_site, monkeypatch, tmp_path):
    monkeypatch.setenv("TAVILY_API_KEY", "tvly-secret")
    monkeypatch.setenv("HOME", str(tmp_path))  # a .netrc login for the site must not be used either
    (tmp_path / ".netrc").write_text("machine 127.0.0.1 login me password netrc-secret\n")
    monkeypatch.setenv("NETRC", str(tmp_path / ".netrc"))
    result = run(web_extract(context(api_key="run-secret"), urls=[local_site.url + "/"]))
    assert result["success"] is True
    headers = local_site.requests[-1]["headers"]
    assert "authorization" not in headers and "cookie" not in headers
    assert not any("secret" in value for value in headers.values())


def test_web_extract_uses_firecrawl_scrape_when_configured(local_site, fake_api, monkeypatch):
    api = fake_api({"/v2/scrape": (200, {"success": True, "data": {
        "markdown": "# Scraped\n\nRendered by Firecrawl.",
        "metadata": {"title": "Scraped page", "sourceURL": local_site.url + "/", "statusCode": 200}}})})
    monkeypatch.setenv("FIRECRAWL_API_KEY", "fc-test")
    monkeypatch.setenv("FIRECRAWL_BASE_URL", api.url)
    result = run(web_extract(context(), urls=[local_site.url + "/"]))
    assert result["success"] is True
    assert result["results"][0]["content"] == "# Scraped\n\nRendered by Firecrawl."
    assert result["results"][0]["title"] == "Scraped page"
    request = api.requests[0]
    assert request["headers"]["authorization"] == "Bearer fc-test"
    assert request["json"]["url"] == local_site.url + "/" and request["json"]["formats"] == ["markdown"]
    assert local_site.requests == []  # the runner itself fetched nothing


def test_web_extract_through_firecrawl_refuses_private_urls_too(local_site, fake_api, monkeypatch):
    """Firecrawl fetches the page from its side, but a self-hosted Firecrawl may sit inside the user's network."""
    api = fake_api({"/v2/scrape": (200, {"success": True, "data": {"markdown": "secret"}})})
    monkeypatch.setenv("FIRECRAWL_API_KEY", "fc-test")
    monkeypatch.setenv("FIRECRAWL_BASE_URL", api.url)  # the provider's own URL is the user's choice: not checked
    result = run(web_extract(context(allow_private_urls=False), urls=[local_site.url + "/", "http://169.254.169.254/"]))
    assert result["success"] is False and all(p["error"].startswith("refused: ") for p in result["results"])
    assert api.requests == [] and local_site.requests == []


# --- web_search ---

HITS = [("First result", "http://127.0.0.1/one", "About the first."), ("Second", "http://127.0.0.1/two", "More."),
        ("Third", "http://127.0.0.1/three", "Even more."), ("Fourth", "http://127.0.0.1/four", "And more.")]
PROVIDERS = {
    # provider: (path, response in the provider's own shape, check of the request)
    "tavily": ("/search", {"query": "fox", "response_time": 0.4, "answer": None, "images": [],
                           "results": [{"title": t, "url": u, "content": s, "score": 0.9} for t, u, s in HITS[:3]]},
               lambda r: r["method"] == "POST" and r["headers"]["authorization"] == "Bearer tavily-key"
               and r["json"] == {"query": "fox", "max_results": 3}),
    "exa": ("/search", {"requestId": "r1", "results": [{"id": u, "title": t, "url": u, "publishedDate": None, "text": s}
                                                      for t, u, s in HITS[:3]]},
            lambda r: r["method"] == "POST" and r["headers"]["x-api-key"] == "exa-key" and r["json"]["query"] == "fox"
            and r["json"]["numResults"] == 3 and r["json"]["contents"]["text"]["maxCharacters"] > 0),
    "firecrawl": ("/v2/search", {"success": True, "data": {"web": [{"url": u, "title": t, "description": s, "position": i}
                                                                   for i, (t, u, s) in enumerate(HITS[:3], 1)]}},
                  lambda r: r["method"] == "POST" and r["headers"]["authorization"] == "Bearer firecrawl-key"
                  and r["json"] == {"query": "fox", "limit": 3}),
    "searxng": ("/search", {"query": "fox", "number_of_results": 4, "answers": [], "suggestions": [],
                            "results": [{"url": u, "title": t, "content": s, "engine": "local"} for t, u, s in HITS]},
                lambda r: r["method"] == "GET" and r["query"] == {"q": ["fox"], "format": ["json"]}
                and "authorization" not in r["headers"]),
}
ENV = {"tavily": ("TAVILY_API_KEY", "tavily-key", "TAVILY_BASE_URL"), "exa": ("EXA_API_KEY", "exa-key", "EXA_BASE_URL"),
       "firecrawl": ("FIRECRAWL_API_KEY", "firecrawl-key", "FIRECRAWL_BASE_URL"), "searxng": ("SEARXNG_URL", None, None)}


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_web_search_speaks_each_providers_api(provider, fake_api, monkeypatch):
    path, response, request_is_right = PROVIDERS[provider]
    api = fake_api({path: (200, response)})
    key_env, key, base_env = ENV[provider]
    monkeypatch.setenv(key_env, key or api.url)
    if base_env:
        monkeypatch.setenv(base_env, api.url)
    assert model_tools.unavailable_tools(ToolSettings()).get("web_search") is None
    result = run(web_search(context(), query="fox", limit=3))
    assert result["success"] is True and result["provider"] == provider
    assert result["results"] == [{"title": t, "url": u, "snippet": s} for t, u, s in HITS[:3]]
    assert len(api.requests) == 1 and request_is_right(api.requests[0]), api.requests[0]


def test_web_search_is_unavailable_without_a_provider_and_reports_errors(fake_api, monkeypatch):
    reasons = model_tools.unavailable_tools(ToolSettings())
    assert all(name in reasons["web_search"] for name in ("TAVILY_API_KEY", "EXA_API_KEY", "FIRECRAWL_API_KEY", "SEARXNG_URL"))
    assert "web_extract" not in reasons and "web" not in model_tools.unavailable_toolsets(reasons)
    assert [t.name for t in model_tools.offered_tools(["web"], reasons)] == ["web_extract"]
    assert run(web_search(context(), query="fox"))["success"] is False

    api = fake_api({"/search": (401, {"detail": {"error": "Unauthorized: invalid API key wrong-key."}})})
    monkeypatch.setenv("TAVILY_API_KEY", "wrong-key")
    monkeypatch.setenv("TAVILY_BASE_URL", api.url)
    monkeypatch.setenv("SEARXNG_URL", "http://127.0.0.1:1")  # configured too, but Tavily comes first
    failed = run(web_search(context(), query="fox"))
    assert failed["success"] is False and failed["error"].startswith("tavily answered HTTP 401")
    assert "wrong-key" not in failed["error"] and "invalid API key ***" in failed["error"]  # echoed key masked
    api.routes["/search"] = (200, {"unexpected": True})
    assert "unexpected response" in run(web_search(context(), query="fox"))["error"]
    for bad in ({"query": ""}, {"query": 5}, {"query": "fox", "limit": 0}, {"query": "fox", "limit": "3"}):
        assert run(dispatch("web_search", json.dumps(bad), REGISTRY, context()))["success"] is False
