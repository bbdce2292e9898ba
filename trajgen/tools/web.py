"""The `web` toolset: `web_search` through a configured provider, `web_extract` of pages as markdown.

Every request is made by the runner, never by the sandbox. A provider's key goes only to that
provider; pages are fetched with no credentials at all (`trust_env=False` also keeps .netrc
logins and proxy settings out of requests to arbitrary sites). Each provider's base URL can be
overridden by an environment variable, for self-hosted instances and for tests.

Pages on loopback, private and link-local addresses are refused unless --allow_private_urls
(netguard): the URL and every redirect hop, which are followed here one by one for that, each
requested from the very address that was checked (so a DNS answer that changes after the check
cannot get through). HTML becomes markdown in a child process (html_text.py) that is killed past
HTML_TIMEOUT: no page can hold a worker for long. With
Firecrawl the page is fetched by Firecrawl, which follows redirects itself; the URL the model gave
is still checked, since a self-hosted Firecrawl may well sit inside the user's network.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Awaitable, Callable
from urllib.parse import urlsplit

from trajgen.sandbox.process import deadline
from trajgen.tools import ToolContext, ToolSettings, ToolSpec
from trajgen.tools.netguard import Verdict, check_host, check_url

if TYPE_CHECKING:  # imported where used: every worker imports this module for its schemas, and httpx's import is costly
    import httpx

DEFAULT_RESULTS = 5
MAX_RESULTS = 10
MAX_SNIPPET_CHARS = 1_000
MAX_URLS = 5
MAX_PAGE_BYTES = 2 * 1024 * 1024
MAX_PAGE_CHARS = 40_000
MAX_REDIRECTS = 5
HTML_TIMEOUT = 10.0
USER_AGENT = "Mozilla/5.0 (compatible; trajgen-web-extract/0.1)"
TEXT_TYPES = ("application/json", "application/xml", "application/xhtml+xml", "application/javascript")


def _fail(error: str) -> dict:
    return {"success": False, "error": error}


def _base(variable: str, default: str) -> str:
    return os.environ.get(variable, default).rstrip("/")


def _cut(value: object, limit: int) -> str:
    text = value if isinstance(value, str) else ""
    return text if len(text) <= limit else text[:limit] + " [...]"


def _hit(title: object, url: object, snippet: object) -> dict:
    return {"title": _cut(title, 300), "url": _cut(url, 2_000), "snippet": _cut(snippet, MAX_SNIPPET_CHARS)}


# --- search providers: each takes (client, query, limit) and returns [{title, url, snippet}] ---


async def _tavily(client: httpx.AsyncClient, query: str, limit: int) -> list[dict]:
    response = await client.post(
        _base("TAVILY_BASE_URL", "https://api.tavily.com") + "/search",
        headers={"Authorization": f"Bearer {os.environ['TAVILY_API_KEY']}"},
        json={"query": query, "max_results": limit},
    )
    response.raise_for_status()
    return [_hit(r.get("title"), r.get("url"), r.get("content")) for r in response.json()["results"]]


async def _exa(client: httpx.AsyncClient, query: str, limit: int) -> list[dict]:
    response = await client.post(
        _base("EXA_BASE_URL", "https://api.exa.ai") + "/search",
        headers={"x-api-key": os.environ["EXA_API_KEY"]},
        json={"query": query, "numResults": limit, "contents": {"text": {"maxCharacters": MAX_SNIPPET_CHARS}}},
    )
    response.raise_for_status()
    return [_hit(r.get("title"), r.get("url"), r.get("text")) for r in response.json()["results"]]


def _firecrawl_headers() -> dict:
    return {"Authorization": f"Bearer {os.environ['FIRECRAWL_API_KEY']}"}


async def _firecrawl(client: httpx.AsyncClient, query: str, limit: int) -> list[dict]:
    response = await client.post(
        _base("FIRECRAWL_BASE_URL", "https://api.firecrawl.dev") + "/v2/search",
        headers=_firecrawl_headers(), json={"query": query, "limit": limit},
    )
    response.raise_for_status()
    return [_hit(r.get("title"), r.get("url"), r.get("description")) for r in response.json()["data"]["web"]]


async def _searxng(client: httpx.AsyncClient, query: str, limit: int) -> list[dict]:
    """SearXNG has no result-count parameter and needs `json` among the instance's formats."""
    response = await client.get(os.environ["SEARXNG_URL"].rstrip("/") + "/search", params={"q": query, "format": "json"})
    response.raise_for_status()
    return [_hit(r.get("title"), r.get("url"), r.get("content")) for r in response.json()["results"][:limit]]


Search = Callable[["httpx.AsyncClient", str, int], Awaitable[list[dict]]]
PROVIDERS: list[tuple[str, str, Search]] = [  # (name, env var that enables it, search); first configured wins
    ("tavily", "TAVILY_API_KEY", _tavily),
    ("exa", "EXA_API_KEY", _exa),
    ("firecrawl", "FIRECRAWL_API_KEY", _firecrawl),
    ("searxng", "SEARXNG_URL", _searxng),
]


def _provider() -> tuple[str, Search] | None:
    for name, variable, search in PROVIDERS:
        if os.environ.get(variable):
            return name, search
    return None


def search_unavailable(settings: ToolSettings) -> str | None:
    if _provider() is None:
        return f"no search provider configured: set one of {', '.join(variable for _, variable, _ in PROVIDERS)}"
    return None


def _client(**options) -> httpx.AsyncClient:
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=10.0), **options)


def _api_error(provider: str, e: Exception) -> str:
    """A provider's failure in one line, never with a key in it (some APIs echo the key back)."""
    import httpx

    if isinstance(e, httpx.HTTPStatusError):
        message = f"{provider} answered HTTP {e.response.status_code}: {_cut(e.response.text, 300)}"
    elif isinstance(e, httpx.HTTPError):
        message = f"{provider} request failed: {type(e).__name__}: {e}"
    else:
        message = f"{provider} sent an unexpected response ({type(e).__name__}: {e})"
    for _, variable, _ in PROVIDERS:
        if secret := os.environ.get(variable):
            message = message.replace(secret, "***")
    return message


async def web_search(ctx: ToolContext, query: str, limit: int = DEFAULT_RESULTS) -> dict:
    """Its arguments' types and bounds were checked against its schema (trajgen/registry.py)."""
    if not query.strip():
        return _fail("`query` must be a non-empty string")
    chosen = _provider()
    if chosen is None:
        return _fail(search_unavailable(ctx.settings))
    name, search = chosen
    import httpx

    try:
        async with _client() as client:
            results = await search(client, query, limit)
    except (httpx.HTTPError, ValueError, LookupError, TypeError, AttributeError) as e:
        return _fail(_api_error(name, e))
    return {"success": True, "error": None, "provider": name, "results": results}


# --- page extraction ---


def _is_text(content_type: str) -> bool:
    return content_type.startswith("text/") or content_type in TEXT_TYPES or content_type.endswith(("+xml", "+json"))


class PageTooSlow(Exception):
    """The page's HTML could not be converted in time (or at all)."""


async def _html_to_markdown(html: bytes, url: str) -> tuple[str, str | None]:
    """html_text.convert in a child process, killed past HTML_TIMEOUT."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trajgen.tools.html_text", url, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        async with deadline(proc, HTML_TIMEOUT):
            out, _ = await proc.communicate(html)
    except TimeoutError:
        raise PageTooSlow(f"converting the page to text took longer than {HTML_TIMEOUT:g} s; not shown") from None
    if proc.returncode != 0:
        raise PageTooSlow("the page could not be converted to text")
    converted = json.loads(out)
    return converted["text"] or "", converted["title"]


def _page(url: str, final_url: str, title: str | None, content: str, truncated: bool) -> dict:
    cut = len(content) > MAX_PAGE_CHARS
    return {"url": url, "final_url": final_url, "title": title, "content": content[:MAX_PAGE_CHARS],
            "truncated": truncated or cut, "error": None}


async def _fetch(client: httpx.AsyncClient, url: str, allow_private: bool) -> dict:
    """One page through the runner: redirects followed up to a limit, each hop checked before it is
    requested, from the address that was checked; text types only, size capped."""
    import httpx

    target = httpx.URL(url)  # checked as httpx will read it
    for hop in range(MAX_REDIRECTS + 1):
        checked: list[str] = []

        async def lookup(host: str) -> Verdict:
            verdict = await check_host(host)
            checked[:] = verdict[0]
            return verdict

        if reason := await check_url(str(target), allow_private, lookup):
            return {"url": url, "error": f"redirected to {target}: {reason}" if hop else reason}
        async with client.stream("GET", **_pinned(target, checked)) as response:
            if not response.is_redirect:
                return await _read(url, str(target), response)
            target = target.join(response.headers["location"])
    return {"url": url, "error": f"more than {MAX_REDIRECTS} redirects"}


def _pinned(target: httpx.URL, addresses: list[str]) -> dict:
    """The request arguments that reach `target` at its first checked address (its Host and TLS name kept)."""
    if not addresses:  # --allow_private_urls: nothing was resolved, so nothing is pinned
        return {"url": target}
    return {"url": target.copy_with(host=addresses[0]), "headers": {"Host": target.netloc.decode("ascii")},
            "extensions": {"sni_hostname": target.host}}


async def _read(url: str, final_url: str, response: httpx.Response) -> dict:
    if response.status_code >= 400:
        return {"url": url, "error": f"HTTP {response.status_code}"}
    content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if not _is_text(content_type):
        return {"url": url, "error": f"content type {content_type or 'unknown'} is not text; not fetched"}
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > MAX_PAGE_BYTES:
            break
    truncated = len(body) > MAX_PAGE_BYTES
    data = bytes(body[:MAX_PAGE_BYTES])
    if content_type in ("text/html", "application/xhtml+xml"):
        content, title = await _html_to_markdown(data, final_url)
    else:
        content, title = data.decode(response.charset_encoding or "utf-8", "replace"), None
    return _page(url, final_url, title, content, truncated)


async def _scrape(client: httpx.AsyncClient, url: str) -> dict:
    """One page through Firecrawl's scrape endpoint (renders JavaScript; returns markdown)."""
    response = await client.post(
        _base("FIRECRAWL_BASE_URL", "https://api.firecrawl.dev") + "/v2/scrape", headers=_firecrawl_headers(),
        json={"url": url, "formats": ["markdown"], "onlyMainContent": True},
    )
    response.raise_for_status()
    data = response.json()["data"]
    metadata = data.get("metadata") or {}
    return _page(url, metadata.get("url") or metadata.get("sourceURL") or url, metadata.get("title"),
                 data.get("markdown") or "", False)


async def _extract_one(client: httpx.AsyncClient, url: str, firecrawl: bool, allow_private: bool) -> dict:
    import httpx

    try:
        if not firecrawl:
            return await _fetch(client, url, allow_private)
        if reason := await check_url(url, allow_private):
            return {"url": url, "error": reason}
        return await _scrape(client, url)
    # LookupError: a key, a charset; InvalidURL: a Location httpx cannot read
    except PageTooSlow as e:
        return {"url": url, "error": str(e)}
    except (httpx.HTTPError, httpx.InvalidURL, ValueError, LookupError, TypeError, AttributeError) as e:
        reason = _api_error("firecrawl", e) if firecrawl else f"{type(e).__name__}: {e}"
        return {"url": url, "error": reason}


async def web_extract(ctx: ToolContext, urls: object = None) -> dict:
    if isinstance(urls, str):
        urls = [urls]
    if not isinstance(urls, list) or not urls or not all(isinstance(u, str) for u in urls):
        return _fail("`urls` must be a non-empty list of URL strings")
    if len(urls) > MAX_URLS:
        return _fail(f"at most {MAX_URLS} URLs per call")
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return _fail(f"{url!r} is not an http(s) URL")
    firecrawl = bool(os.environ.get("FIRECRAWL_API_KEY"))
    if firecrawl:
        client = _client()
    else:
        client = _client(
            trust_env=False,  # redirects are followed by _fetch, which checks each hop
            headers={"User-Agent": USER_AGENT, "Accept": "text/html, text/plain;q=0.9, */*;q=0.5"},
        )
    async with client:
        pages = await asyncio.gather(*(_extract_one(client, url, firecrawl, ctx.settings.allow_private_urls)
                                       for url in urls))
    failed = [p for p in pages if p["error"]]
    error = "; ".join(f"{p['url']}: {p['error']}" for p in failed) if len(failed) == len(pages) else None
    return {"success": error is None, "error": error, "results": pages}


TOOLS = [
    ToolSpec(
        name="web_search",
        toolset="web",
        description="Search the web; returns up to `limit` results, each with title, URL and a snippet.",
        parameters={
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "What to search for."},
                "limit": {"type": "integer", "minimum": 1, "maximum": MAX_RESULTS,
                          "description": f"How many results (default {DEFAULT_RESULTS})."},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
        fn=web_search,
        unavailable=search_unavailable,
    ),
    ToolSpec(
        name="web_extract",
        toolset="web",
        description=(
            f"Read web pages (up to {MAX_URLS} URLs) and return each one's main content as markdown, "
            f"cut at {MAX_PAGE_CHARS} characters. Text pages only (HTML, plain text, JSON, XML)."
        ),
        parameters={
            "type": "object",
            "properties": {
                "urls": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": MAX_URLS,
                         "description": "http(s) URLs of the pages to read."},
            },
            "required": ["urls"],
            "additionalProperties": False,
        },
        fn=web_extract,
    ),
]
