"""The browser tools driving real headless Chromium over a local site on 127.0.0.1.

Chromium runs with a dead proxy for everything but loopback and with host resolution turned
off, so nothing it does can leave the machine. Skipped (with the reason) only when playwright
or a chromium binary is missing, or chromium cannot start here.

The local site is on 127.0.0.1, so tests that use it allow private URLs. The tests of the refusal
do not: their contexts connect only through netguard's guard (which takes the dead proxy's place
for them), and every address they name is loopback or private, refused before any connection.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import time

import pytest

import model_tools
from tests.test_web_tools import local_site  # noqa: F401  (fixture)
from trajgen.sandbox import cgroups
from trajgen.tools import ToolContext, ToolSettings, browser
from trajgen.tools.browser import (CONTEXT_KEY, GUARD_KEY, browser_back, browser_click, browser_navigate,
                                   browser_scroll, browser_snapshot, browser_type)

LOOPBACK_ONLY = "--proxy-server=http://127.0.0.1:9 --host-resolver-rules='MAP * ~NOTFOUND, EXCLUDE 127.0.0.1'"


def _launch_problem() -> str | None:
    if reason := browser.browser_unavailable(ToolSettings()):
        return reason

    async def probe() -> None:
        try:
            await browser._browser(ToolSettings())
        finally:
            await browser.shutdown()

    os.environ["TRAJGEN_CHROMIUM_ARGS"] = LOOPBACK_ONLY
    try:
        asyncio.run(probe())
    except Exception as e:  # whatever stops chromium here is the skip reason
        return f"chromium cannot start here: {str(e).strip().splitlines()[0]}"
    finally:
        del os.environ["TRAJGEN_CHROMIUM_ARGS"]
    return None


LAUNCH_PROBLEM = _launch_problem()
pytestmark = pytest.mark.skipif(LAUNCH_PROBLEM is not None, reason=f"browser tools need chromium: {LAUNCH_PROBLEM}")


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch) -> None:
    monkeypatch.setenv("TRAJGEN_CHROMIUM_ARGS", LOOPBACK_ONLY)


def context(allow_private_urls: bool = True) -> ToolContext:
    """A prompt's context; private URLs allowed unless a test says otherwise (the local site is on 127.0.0.1)."""
    async def no_sandbox():
        raise AssertionError("browser tools never open the sandbox")

    return ToolContext(sandbox=no_sandbox, settings=ToolSettings(allow_private_urls=allow_private_urls))


def in_browser(steps) -> None:
    """Run `steps()` on one event loop, then the prompts' cleanups and the browser's shutdown."""
    async def main() -> None:
        contexts: list[ToolContext] = []
        try:
            await steps(contexts)
        finally:
            for ctx in contexts:
                await asyncio.gather(*(cleanup() for cleanup in ctx.cleanups))
            await browser.shutdown()

    asyncio.run(main())


def ref(snapshot: str, element: str) -> str:
    """The number the snapshot gives an element, e.g. ref(s, 'link "open the form"') -> '7'."""
    return re.search(re.escape(element) + r"(?: \[\D[^\]]*\])* \[(\d+)\]", snapshot).group(1)  # after [level=1]...


def test_navigate_snapshot_click_type_submit_and_back(local_site):
    async def steps(contexts: list[ToolContext]) -> None:
        ctx = context()
        contexts.append(ctx)
        opened = await browser_navigate(ctx, url=local_site.url + "/")
        assert opened == {"success": True, "error": None, "url": local_site.url + "/", "title": "Local Test Site",
                          "status": 200}
        home = await browser_snapshot(ctx)
        assert home["success"] is True and home["truncated"] is False
        tree = home["snapshot"]
        assert 'heading "Welcome to the test site" [level=1]' in tree and "quick brown fox" in tree
        assert 'img "A tiny cat"' in tree
        numbers = [int(n) for n in re.findall(r"\[(\d+)\]", tree)]
        assert numbers == list(range(1, len(numbers) + 1))  # elements numbered [1], [2]... in order

        clicked = await browser_click(ctx, ref=ref(tree, 'link "open the form"'))
        assert clicked["success"] is True and clicked["url"] == local_site.url + "/form"
        assert clicked["title"] == "Greeting Form"
        form = (await browser_snapshot(ctx))["snapshot"]
        field, button = ref(form, 'textbox "Your name"'), ref(form, 'button "Send"')
        typed = await browser_type(ctx, ref=field, text="Ada Lovelace")
        assert typed["success"] is True and typed["url"] == local_site.url + "/form"
        sent = await browser_click(ctx, ref=f"[{button}]")  # "[12]" as shown in the snapshot works too
        assert sent["url"] == local_site.url + "/result?q=Ada+Lovelace" and sent["title"] == "Result"
        assert "You typed: Ada Lovelace" in (await browser_snapshot(ctx))["snapshot"]

        back = await browser_back(ctx)
        assert back["success"] is True and back["url"] == local_site.url + "/form"
        again = (await browser_snapshot(ctx))["snapshot"]
        submitted = await browser_type(ctx, ref=int(ref(again, 'textbox "Your name"')), text="Grace", submit=True)
        assert submitted["url"] == local_site.url + "/result?q=Grace"
        assert (await browser_back(ctx))["url"] == local_site.url + "/form"
        assert (await browser_back(ctx))["url"] == local_site.url + "/"

    in_browser(steps)
    assert [r["path"] for r in local_site.requests].count("/cat.png") >= 1  # the page's image loaded, locally


def test_scroll_moves_the_page_and_reports_where(local_site):
    async def steps(contexts: list[ToolContext]) -> None:
        ctx = context()
        contexts.append(ctx)
        await browser_navigate(ctx, url=local_site.url + "/")
        down = await browser_scroll(ctx, direction="down")
        assert down["success"] is True and down["scroll_y"] > 0 and down["page_height"] > down["viewport_height"]
        further = await browser_scroll(ctx, direction="down")
        assert further["scroll_y"] > down["scroll_y"]
        up = await browser_scroll(ctx, direction="up")
        assert up["scroll_y"] < further["scroll_y"]
        assert (await browser_scroll(ctx, direction="sideways"))["success"] is False

    in_browser(steps)


def test_refusals_and_model_mistakes_are_failed_results(local_site):
    async def steps(contexts: list[ToolContext]) -> None:
        ctx = context()
        contexts.append(ctx)
        for url in ("file:///etc/passwd", "chrome://version", "about:blank", "javascript:alert(1)", "view-source:http://x",
                    "127.0.0.1", "", None, 5):
            result = await browser_navigate(ctx, url=url)
            assert result["success"] is False and "http(s)" in result["error"], url
        assert ctx.state == {}  # refused before any browser work
        missing = await browser_click(ctx, ref="3")
        assert missing["success"] is False and "take a snapshot first" in missing["error"]
        await browser_navigate(ctx, url=local_site.url + "/")
        tree = (await browser_snapshot(ctx))["snapshot"]
        link = ref(tree, 'link "open the form"')
        assert "no element [9999]" in (await browser_click(ctx, ref="9999"))["error"]
        for bad in ("e3", "link", "", None, True, 1.5):
            assert (await browser_click(ctx, ref=bad))["error"].startswith("`ref` must be"), bad
        heading = ref(tree, 'heading "Welcome to the test site"')
        not_a_field = await browser_type(ctx, ref=heading, text="x")
        assert not_a_field["success"] is False and not_a_field["error"]
        assert (await browser_type(ctx, ref=link, text=5))["success"] is False
        assert (await browser_type(ctx, ref=link, text="x", submit="yes"))["success"] is False
        await browser_navigate(ctx, url=local_site.url + "/form")
        stale = await browser_click(ctx, ref=link)  # a number from the page before
        assert stale["success"] is False and "browser_snapshot" in stale["error"]
        gone = await browser_navigate(ctx, url="http://127.0.0.1:1/")  # a port Chromium refuses
        assert gone["success"] is False and gone["error"].startswith("Page.goto: net::ERR_")
        assert "Call log" not in gone["error"]
        fresh = context()
        contexts.append(fresh)
        assert (await browser_back(fresh))["error"] == "there is no previous page in this tab's history"

    in_browser(steps)


def test_navigate_refuses_private_addresses_without_the_flag(local_site):
    async def steps(contexts: list[ToolContext]) -> None:
        ctx = context(allow_private_urls=False)
        contexts.append(ctx)
        port = local_site.server.server_port
        for url in (f"{local_site.url}/", f"http://localhost:{port}/", f"http://[::1]:{port}/", f"http://127.1:{port}/",
                    "http://10.1.2.3/", "http://169.254.169.254/latest/meta-data/", "http://[fd00:ec2::254]/"):
            result = await browser_navigate(ctx, url=url)
            assert result["success"] is False and result["error"].startswith("refused: "), url
            assert "--allow_private_urls" in result["error"]
        assert CONTEXT_KEY not in ctx.state  # refused before any browser work

    in_browser(steps)
    assert local_site.requests == []


PAGE = """<html><head><title>A page on the web</title></head><body>
<h1>Links and pictures</h1><a href="{site}/form">the internal form</a> <a href="http://127.0.0.1:1/hop">a hop</a>
<img src="{site}/cat.png" alt="internal"> <img src="http://10.1.2.3/x.png" alt="private">
<iframe src="http://169.254.169.254/latest/meta-data/"></iframe>
<script>new WebSocket("ws://localhost:{port}/")</script></body></html>"""


PAGE_REFUSED = ("refused: 10.1.2.3 is", "refused: 169.254.169.254 is", "refused: 127.0.0.1 is",
                "refused: localhost (127.0.0.1) is")  # its picture, frame, internal picture and socket


async def _refusals_in(guard, since: int) -> None:
    """Wait for each of PAGE's private addresses to be refused since refusal `since`: they come a
    moment after it loads, later on a loaded machine; one not refused within 60 s fails the test."""
    deadline = time.monotonic() + 60
    while not all(any(r.startswith(p) for r in guard.refused[since:]) for p in PAGE_REFUSED):
        assert time.monotonic() < deadline, f"not all of PAGE's private addresses were refused: {guard.refused[since:]}"
        await asyncio.sleep(0.05)


def test_the_guard_keeps_a_page_from_the_internal_network(local_site):
    """A page may not pull the browser into private addresses: not its pictures, frames or sockets,
    not a link, and not a redirect. With the flag off only a public page is opened, and no test may
    reach one; so the page is put in the tab by Playwright (set_content), and the redirect is answered
    by the test's own Playwright route at a loopback address (refused itself if it were ever fetched).
    No Playwright route sees a redirect's next hop: Chromium requests it, through the guard."""
    async def steps(contexts: list[ToolContext]) -> None:
        ctx = context(allow_private_urls=False)
        contexts.append(ctx)
        assert (await browser_snapshot(ctx))["success"] is True  # opens the prompt's context, on about:blank
        guard, page = ctx.state[GUARD_KEY], ctx.state[CONTEXT_KEY].pages[-1]
        port = local_site.server.server_port
        await page.set_content(PAGE.format(site=local_site.url, port=port), wait_until="load")
        await _refusals_in(guard, since=0)

        tree = (await browser_snapshot(ctx))["snapshot"]
        clicked = await browser_click(ctx, ref=ref(tree, 'link "the internal form"'))
        assert clicked["success"] is False and clicked["error"].startswith("refused: 127.0.0.1 is"), clicked

        # off the refused link's error page: a refusal landing late during a snapshot of an error page
        # (the last page's picture, on a loaded machine) fails the snapshot; on a blank one it is listed
        await page.goto("about:blank")
        since = len(guard.refused)
        await page.set_content(PAGE.format(site=local_site.url, port=port))
        await _refusals_in(guard, since)  # the page's own, before the hop's
        await page.route("http://127.0.0.1:1/hop", lambda route: route.fulfill(
            status=302, headers={"Location": f"http://localhost:{port}/form"}))
        snapshot = await browser_snapshot(ctx)
        assert snapshot["success"] is True, snapshot
        tree = snapshot["snapshot"]
        redirected = await browser_click(ctx, ref=ref(tree, 'link "a hop"'))
        assert redirected["success"] is False and "refused: localhost (127.0.0.1) is" in redirected["error"], redirected

        await page.route("http://127.0.0.1:1/page", lambda route: route.fulfill(content_type="text/html", body=(
            '<html><head><title>Served</title><script src="http://10.1.2.3/x.js"></script></head>'
            '<body><p>Here.</p></body></html>')))
        await page.goto("about:blank")
        await page.set_content('<a href="http://127.0.0.1:1/page">a page</a>')
        tree = (await browser_snapshot(ctx))["snapshot"]
        served = await browser_click(ctx, ref=ref(tree, 'link "a page"'))  # the page comes, its script does not
        assert served["success"] is True and served["title"] == "Served", served
        assert [r for r in served["blocked"] if r.startswith("refused: 10.1.2.3 is")], served

    in_browser(steps)
    assert local_site.requests == []  # not the picture, the socket, the link, nor the redirect's target


def test_one_browser_per_process_one_context_per_prompt_closed_by_cleanup(local_site):
    async def steps(contexts: list[ToolContext]) -> None:
        first, second = context(), context()
        contexts.extend([first, second])
        results = await asyncio.gather(browser_navigate(first, url=local_site.url + "/"),
                                       browser_navigate(second, url=local_site.url + "/form"))
        assert all(r["success"] for r in results)
        one, two = first.state[CONTEXT_KEY], second.state[CONTEXT_KEY]
        assert one is not two and one.browser is two.browser  # launched once, under the lock
        assert len(first.cleanups) == 1 and len(second.cleanups) == 1
        await first.cleanups[0]()
        assert one.pages == [] and two.pages[0].url == local_site.url + "/form"
        assert (await browser_snapshot(second))["success"] is True

    in_browser(steps)


def test_availability_follows_playwright_and_chromium():
    assert browser.browser_unavailable(ToolSettings()) is None
    reason = browser.browser_unavailable(ToolSettings(browser_executable="/nonexistent/chromium"))
    assert reason.startswith("no chromium binary")
    unavailable = model_tools.unavailable_tools(ToolSettings(browser_executable="/nonexistent/chromium"))
    assert model_tools.unavailable_toolsets(unavailable)["browser"] == reason


ADDRESS_FORM = (b"<html><head><title>Order</title></head><body><form action='/done' method='get'>"
                b"<label>Name <input name='name' autocomplete='name'></label>"
                b"<label>Email <input name='email' type='email' autocomplete='email'></label>"
                b"<label>Street <input name='street' autocomplete='street-address'></label>"
                b"<label>City <input name='city' autocomplete='address-level2'></label>"
                b"<button type='submit'>Order</button></form></body></html>")


def test_a_form_page_sends_nothing_outside_the_proxy(monkeypatch):
    """Chromium on a page with a form asks an autofill service about it unless told not to. Everything the
    browser itself sends goes to a logging proxy here (the page, on loopback, bypasses it): the log must
    name no outside service."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import threading

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(ADDRESS_FORM)))
            self.end_headers()
            self.wfile.write(ADDRESS_FORM)

        def log_message(self, *args) -> None:
            pass

    site = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    asked: list[str] = []

    async def steps(contexts: list[ToolContext]) -> None:
        async def log_and_close(reader, writer) -> None:
            asked.append((await reader.readline()).decode(errors="replace").strip())
            writer.close()

        proxy = await asyncio.start_server(log_and_close, "127.0.0.1", 0)
        monkeypatch.setenv("TRAJGEN_CHROMIUM_ARGS", LOOPBACK_ONLY.replace(
            "http://127.0.0.1:9", f"http://127.0.0.1:{proxy.sockets[0].getsockname()[1]}"))
        ctx = context()
        contexts.append(ctx)
        url = f"http://127.0.0.1:{site.server_port}/"
        assert (await browser_navigate(ctx, url=url))["title"] == "Order"
        form = (await browser_snapshot(ctx))["snapshot"]
        for name, text in (("Name", "Ada Lovelace"), ("Email", "ada@example.org"), ("Street", "12 St James's Square")):
            assert (await browser_type(ctx, ref=ref(form, f'textbox "{name}"'), text=text))["success"] is True
        assert (await browser_click(ctx, ref=ref(form, 'button "Order"')))["success"] is True
        assert (await browser_navigate(ctx, url=url))["success"] is True
        proxy.close()

    try:
        in_browser(steps)
    finally:
        site.shutdown()
    assert not [line for line in asked if "autofill" in line], asked


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in os.listdir(f"/proc/{parent}/task"):
            try:
                children = [int(c) for c in open(f"/proc/{parent}/task/{task}/children").read().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


@pytest.mark.skipif(os.geteuid() != 0, reason="run unprivileged, Chromium is the runner's own user anyway")
def test_chromium_runs_unprivileged_with_its_own_sandbox(local_site):
    """Run as root, the runner starts Chromium as a uid of the sandbox range, without --no-sandbox."""
    seen: list[tuple[int, str]] = []

    async def steps(contexts: list[ToolContext]) -> None:
        ctx = context()
        contexts.append(ctx)
        assert (await browser_navigate(ctx, url=local_site.url + "/"))["success"] is True
        for pid in _descendants(os.getpid()):
            try:
                args = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
                uid = os.stat(f"/proc/{pid}").st_uid
            except OSError:
                continue
            if "chromium" in args and "setpriv" not in args and "chromium-as-user" not in args:
                seen.append((uid, args))

    in_browser(steps)
    assert any("--type=renderer" in args for _, args in seen), seen
    assert all(uid != 0 for uid, _ in seen), [(u, a[:80]) for u, a in seen if u == 0]
    assert not any("--no-sandbox" in args for _, args in seen)


@pytest.mark.skipif(os.geteuid() != 0 or cgroups.problem() is not None,
                    reason="the browser's memory cgroup needs a root runner and cgroups")
def test_a_page_past_the_browsers_memory_limit_is_killed_and_the_next_call_works(local_site):
    """A page whose script holds 2 GB, with --sandbox_memory=512: its renderer is killed, not the runner."""
    async def steps(contexts: list[ToolContext]) -> None:
        ctx = context()
        ctx.settings = dataclasses.replace(ctx.settings, browser_memory_mb=512)
        contexts.append(ctx)
        hog = await browser_navigate(ctx, url=local_site.url + "/hog")
        assert hog == {"success": False, "error": "the page went past the browser's memory limit (512 MB) and the "
                                                  "kernel killed it; its tab is closed"}, hog
        after = await browser_navigate(ctx, url=local_site.url + "/")
        assert after["success"] and after["title"] == "Local Test Site", after

    in_browser(steps)
    assert [d for base in cgroups._bases()[0] for d in base.glob(f"trajgen-*.browser-{os.getpid()}")] == []
