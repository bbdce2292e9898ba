"""The viewer's HTTP server: the static page and a small JSON API over the index, on 127.0.0.1.

Single process, the stdlib's threading server, one lock around the index. The index is brought
up to date with the files at most once a second, so a run that is still going shows what has
landed. Every response carries a strict Content-Security-Policy; requests naming another host
are refused (a web page elsewhere cannot reach the viewer through DNS rebinding), and so is every
request without the token of the printed URL, as Jupyter does: any local user can reach
127.0.0.1, and must not read through the viewer the rows that the run files' mode 0600 keeps from them.
"""
from __future__ import annotations

import hmac
import secrets
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qsl, urlsplit

import orjson

from trajgen import console
from trajgen.merge import Filtering
from trajgen.viewer import conversation, render
from trajgen.viewer.index import RunIndex
from trajgen.viewer.query import STATUSES, Filters, Pager, reason, status
from trajgen.viewer.summary import read_filtering, summarize

POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
          "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
STATIC = {"/": ("index.html", "text/html; charset=utf-8"),
          "/app.js": ("app.js", "text/javascript; charset=utf-8"),
          "/app.css": ("app.css", "text/css; charset=utf-8")}
REFRESH_SECONDS = 1.0


class Viewer:
    """The index and what is derived from it, cached until the index changes."""

    def __init__(self, index: RunIndex):
        self.index = index
        self.pager = Pager(index)
        self.lock = threading.Lock()
        self._refreshed = time.monotonic()
        self._summary: tuple[tuple, dict] = ((), {})

    def fresh(self) -> None:
        if time.monotonic() - self._refreshed >= REFRESH_SECONDS:
            self.index.refresh()
            self._refreshed = time.monotonic()

    def filtering(self) -> Filtering:
        return read_filtering(self.index.run_dir, self.index)

    def summary(self) -> dict:
        stats_file = self.index.run_dir / "statistics.json"
        stamp = (self.index.version, stats_file.stat().st_mtime_ns if stats_file.exists() else 0)
        if self._summary[0] != stamp:
            found = summarize(self.index)
            entries = self.index.entries
            self._summary = (stamp, {
                "html": render.summary_html(found), "live": found.live, "title": found.stats["run_name"],
                "facets": {
                    "status": list(STATUSES),
                    "tool": sorted({t for e in entries for t in e.tools}),
                    "toolset": sorted({t for e in entries for t in e.toolsets_offered}),
                    "failed_class": sorted({e.reason for e in entries if e.kind == "failed" and e.reason}),
                },
            })
        return self._summary[1]

    def entries(self, params: dict[str, str]) -> dict:
        filters = self.filtering()
        start = _int(params.get("start"), 0)
        matched, page = self.pager.page(Filters.from_params(params), filters, start, _int(params.get("limit"), 100))
        return {"matched": matched, "total": len(self.index.entries), "start": start,
                "entries": [{"key": e.key, "prompt_index": e.prompt_index, "id": e.dataset_id,
                             "status": status(e, filters), "reason": reason(e, filters), "preview": e.preview,
                             "tools": list(e.tools), "turns": e.turns, "tokens": e.tokens,
                             "partial": e.partial, "hallucinated": e.hallucinated} for e in page]}

    def entry(self, key: str) -> dict | None:
        position = self.index.by_key.get(key)
        if position is None:
            return None
        found = self.index.entries[position]
        return conversation.view(found, self.index.read(found), self.filtering(), self.index.run_dir)


def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


class BaseHandler(BaseHTTPRequestHandler):
    """Answers only requests naming its own host and carrying the viewer's token (in the URL, or in
    the cookie the first such answer sets), every answer under the viewer's policy."""

    server_version = "trajgen-viewer"
    port_box: list[int]
    server: _Server

    def log_message(self, format, *args) -> None:  # quiet: the terminal shows only the URL
        pass

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        if code == HTTPStatus.OK and self._token_in_url():  # the page's own requests (script, style, data) carry it
            self.send_header("Set-Cookie", f"{self._cookie_name()}={self.server.token}; Path=/; HttpOnly; "
                                           "SameSite=Strict")
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Security-Policy", POLICY)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, obj, code: int = 200) -> None:
        self._send(code, orjson.dumps(obj), "application/json")

    def _allowed(self) -> bool:
        """Its own host and its token, or a 403 sent."""
        if self.headers.get("Host") not in (f"127.0.0.1:{self.port_box[0]}", f"localhost:{self.port_box[0]}"):
            self._send(HTTPStatus.FORBIDDEN, b"forbidden host", "text/plain")
            return False
        if not (self._token_in_url() or self._token_in_cookie()):
            self._send(HTTPStatus.FORBIDDEN, b"forbidden: open the URL with the token that --view printed",
                       "text/plain")
            return False
        return True

    def _token_in_url(self) -> bool:
        given = dict(parse_qsl(urlsplit(self.path).query)).get("token", "")
        return hmac.compare_digest(given.encode(), self.server.token.encode())

    def _token_in_cookie(self) -> bool:
        """Split by hand: http.cookies stops at the first cookie it cannot parse (another local
        server's JSON value, say), and would lose ours after it."""
        pairs = (pair.strip().partition("=") for header in self.headers.get_all("Cookie", [])
                 for pair in header.split(";"))
        return any(name == self._cookie_name() and hmac.compare_digest(value.encode(), self.server.token.encode())
                   for name, _, value in pairs)

    def _cookie_name(self) -> str:
        """One per port: a browser sends 127.0.0.1's cookies to every port of it, other viewers' included."""
        return f"trajgen-viewer-{self.port_box[0]}"

    def _static(self, path: str) -> bool:
        if path not in STATIC:
            return False
        name, content_type = STATIC[path]
        self._send(200, resources.files("trajgen.viewer").joinpath("static", name).read_bytes(), content_type)
        return True


def handler(viewer: Viewer, port_box: list[int]):
    class Handler(BaseHandler):
        def do_GET(self) -> None:
            if not self._allowed():
                return
            url = urlsplit(self.path)
            params = dict(parse_qsl(url.query))
            if self._static(url.path):
                return
            with viewer.lock:
                viewer.fresh()
                if url.path == "/api/summary":
                    return self._json(viewer.summary())
                if url.path == "/api/entries":
                    return self._json(viewer.entries(params))
                if url.path == "/api/entry":
                    found = viewer.entry(params.get("key", ""))
                    return self._json(found) if found else self._json({"error": "no such prompt"}, 404)
            self._json({"error": "not found"}, 404)

    Handler.port_box = port_box
    return Handler


class _Server(ThreadingHTTPServer):
    def __init__(self, address: tuple[str, int], handler_class: type[BaseHandler]):
        super().__init__(address, handler_class)
        self.token = secrets.token_urlsafe(32)  # the printed URL's: whoever was given it, and no one else

    def handle_error(self, request, client_address) -> None:
        """One line, not a traceback; a browser that went away mid-answer is not worth one."""
        error = sys.exc_info()[1]
        if not isinstance(error, ConnectionError):
            console.error(f"viewer: {type(error).__name__}: {error}")


def serve(index: RunIndex, port: int) -> int:
    """Serve until Ctrl-C; returns the exit status."""
    port_box = [port]
    viewer = Viewer(index)
    viewer.summary()  # the first page the browser asks for is then ready
    viewer.pager.ordered()
    return listen(handler(viewer, port_box), port_box, f"viewing {index.run_dir}")


def listen(handler_class: type[BaseHandler], port_box: list[int], what: str) -> int:
    """Serve `handler_class` on 127.0.0.1:port_box[0] until Ctrl-C; port_box then holds the port."""
    try:
        server = _Server(("127.0.0.1", port_box[0]), handler_class)
    except OSError as e:
        console.error(f"cannot listen on 127.0.0.1:{port_box[0]}: {e.strerror} (--view_port=0 takes any free port)")
        return 2
    port_box[0] = server.server_address[1]
    try:
        console.out.print(f"{what} at http://127.0.0.1:{port_box[0]}/?token={server.token} (Ctrl-C stops)",
                          markup=False, highlight=False, soft_wrap=True)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
