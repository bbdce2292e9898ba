"""The viewer's HTTP server: the static page and a small JSON API over the index, on 127.0.0.1.

Single process, the stdlib's threading server, one lock around the index. The index is brought
up to date with the files at most once a second, so a run that is still going shows what has
landed. Every response carries a strict Content-Security-Policy; requests naming another host
are refused (a web page elsewhere cannot reach the viewer through DNS rebinding).
"""
from __future__ import annotations

import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qsl, urlsplit

import orjson

from trajgen import console
from trajgen.viewer import conversation, render
from trajgen.viewer.index import RunIndex
from trajgen.viewer.query import STATUSES, Filtering, Filters, Pager, reason, status
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


def handler(viewer: Viewer, port_box: list[int]):
    class Handler(BaseHTTPRequestHandler):
        server_version = "trajgen-viewer"

        def log_message(self, format, *args) -> None:  # quiet: the terminal shows only the URL
            pass

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
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

        def do_GET(self) -> None:
            if self.headers.get("Host") not in (f"127.0.0.1:{port_box[0]}", f"localhost:{port_box[0]}"):
                return self._send(HTTPStatus.FORBIDDEN, b"forbidden host", "text/plain")
            url = urlsplit(self.path)
            params = dict(parse_qsl(url.query))
            if url.path in STATIC:
                name, content_type = STATIC[url.path]
                body = resources.files("trajgen.viewer").joinpath("static", name).read_bytes()
                return self._send(200, body, content_type)
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

    return Handler


class _Server(ThreadingHTTPServer):
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
    try:
        server = _Server(("127.0.0.1", port), handler(viewer, port_box))
    except OSError as e:
        console.error(f"cannot listen on 127.0.0.1:{port}: {e.strerror} (--view_port=0 takes any free port)")
        return 2
    port_box[0] = server.server_address[1]
    try:
        console.out.print(f"viewing {index.run_dir} at http://127.0.0.1:{port_box[0]}/ (Ctrl-C stops)")
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
