"""The `browser` toolset: a real headless Chromium driven by Playwright.

One browser per worker process, launched at the first browser call and reused; one
BrowserContext (cookies, history, tabs) per prompt, closed by the prompt's cleanups. The model
reads a page through Playwright's accessibility snapshot, whose numbered elements ([12]) it
passes back to click and type. Only http(s) pages can be opened.

Unless --allow_private_urls, nothing the browser does may reach a loopback, private or link-local
address: browser_navigate checks its URL, and each prompt's context connects only through its own
netguard.Guard, a SOCKS5 proxy in this process that checks every connection (redirect hops,
subresources, link clicks, form submits, WebSockets) and resolves each host once per prompt. A
--proxy-server in $TRAJGEN_CHROMIUM_ARGS is then not used by the contexts; with the flag, the guard
is off and Chromium connects as it is told.

Playwright's own browser download is not used: the binary is the system's chromium (Debian's
package; `browser_executable`, else $CHROMIUM_PATH, else `chromium` on PATH). A root runner starts it
in a bubblewrap sandbox as an unprivileged uid (_User), so Chromium's own sandbox stays on for
untrusted pages and nothing root later runs or deletes is writable by that uid, and in a memory
cgroup of its own of --sandbox_memory MB (its pages share it; the kernel kills the largest, a page's
renderer, past it, and the call fails saying so). Its environment is
BROWSER_ENV, never the runner's (API keys). Playwright launches it with a fresh temporary profile
and with background networking, component updates, sync and first-run turned off; CHROMIUM_ARGS
closes the remaining paths to outside services, and $TRAJGEN_CHROMIUM_ARGS adds switches of your
own (a proxy, say).
"""
from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import shlex
import shutil
from dataclasses import dataclass
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

from trajgen import locks
from trajgen.sandbox import cgroups, roots
from trajgen.sandbox.local import NEW_PRIVILEGES_OFF, bwrap_system_binds
from trajgen.tools import ToolContext, ToolSettings, ToolSpec
from trajgen.tools.netguard import Guard, check_url

BROWSER_TMP_MB = 1024  # the browser's /tmp: its profile, cache and shared memory files
BROWSER_TASKS = 4096  # the processes and threads of a worker's Chromium (a page's renderer has dozens of threads)
MAX_SNAPSHOT_CHARS = 30_000
MAX_ERROR_CHARS = 500
NAVIGATION_TIMEOUT_MS = 30_000
ACTION_TIMEOUT_MS = 10_000
# Chromium keeps only the last --disable-features, so this one repeats the features Playwright turns off
# for traffic (optimization hints, network time, AI mode, search preconnects, media router) and its
# behaviour fixes, and adds the services that call out on their own: autofill (any page with a form),
# translation, safe browsing, sign-in, certificate transparency and extension updates.
DISABLED_FEATURES = ["AvoidUnnecessaryBeforeUnloadCheckSync", "DestroyProfileOnBrowserClose", "HttpsUpgrades",
                     "HttpsFirstBalancedModeAutoEnable", "LensOverlay", "MediaRouter", "PaintHolding",
                     "ThirdPartyStoragePartitioning", "AvoidCorsURLLoaderRestartOnRedirect", "OptimizationHints",
                     "NetworkTimeServiceQuerying", "AimEnabled", "PreconnectToSearch",
                     "AutofillServerCommunication", "Translate", "SafeBrowsingEnableRealTimeUrlLookups",
                     "CertificateTransparencyComponentUpdater", "InterestFeedContentSuggestions"]
CHROMIUM_ARGS = ["--disable-gpu", "--disable-quic", "--no-pings", "--disable-domain-reliability",
                 "--disable-client-side-phishing-detection", "--safebrowsing-disable-auto-update",
                 "--disable-crash-reporter", "--disable-sync", "--disable-extensions", "--disable-component-update",
                 "--disable-background-networking", "--disable-features=" + ",".join(DISABLED_FEATURES),
                 "--force-webrtc-ip-handling-policy=disable_non_proxied_udp"]  # WebRTC's UDP would go around the guard
# With the guard on, pages reach the network only through it (names go to the proxy unresolved), so
# the browser itself needs no lookups: a service that starts on its own cannot resolve its server.
NO_OWN_LOOKUPS = "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"
CONTEXT_KEY, REFS_KEY, GUARD_KEY = "browser_context", "browser_refs", "browser_guard"  # in ctx.state
_SNAPSHOT_REF = re.compile(r"\[ref=([\w-]+)\]")  # Playwright's element refs (e12, f3e12...)
_REF_ARGUMENT = re.compile(r"^\[?(\d+)\]?$")


class Refused(Exception):
    """An action the model asked for that cannot be done; its message is the tool's error."""


@dataclass
class _Shared:
    """The worker's Playwright and browser, which belong to the event loop that started them."""

    loop: asyncio.AbstractEventLoop
    lock: asyncio.Lock
    playwright: Any = None
    browser: Any = None
    user: _User | None = None


class _User:
    """Who Chromium runs as when the runner is root: a uid of the sandbox range, held while the
    worker lives. `launcher`, which root runs, is root's own file in a sandbox root of its own
    (roots.new_root_dir: under root's private directory, swept by a later run if this worker is
    killed); it moves itself into the browser's cgroup (`trajgen-<run id>.browser-<pid>/chromium`,
    removed by the run's end or its next invocation if this worker does not), starts Chromium in a
    bubblewrap sandbox of its own (system dirs read-only, a private /tmp holding the profile and
    HOME, its own PID and IPC namespaces) and drops to the uid there, so Chromium's own sandbox can
    stay on."""

    def __init__(self, chromium: str, settings: ToolSettings) -> None:
        self.run_id, self.label = settings.run_id, f"{cgroups.BROWSER}-{os.getpid()}"
        self.group = None if cgroups.problem() else cgroups.create(
            self.run_id, self.label, "chromium", settings.browser_memory_mb << 20, BROWSER_TASKS)
        self.uid, self._lock = roots.take_uid()
        self.root = roots.new_root_dir()
        self.launcher = os.path.join(self.root, "chromium")
        sandbox = [*bwrap_system_binds(), "--size", str(BROWSER_TMP_MB << 20), "--perms", "1777", "--tmpfs", "/tmp",
                   "--dev", "/dev", "--perms", "1777", "--tmpfs", "/dev/shm", "--proc", "/proc",
                   "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent"]
        as_uid = ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups", *NEW_PRIVILEGES_OFF]
        fd = os.open(self.launcher, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o700)
        with os.fdopen(fd, "w") as f:
            f.write(LAUNCHER.format(procs=shlex.join(self.group.procs_files if self.group else []),
                                    bwrap=shlex.join(["bwrap", *sandbox]), chromium=shlex.join([*as_uid, chromium])))

    def oom_kills(self) -> int:
        return self.group.oom_kills() if self.group else 0

    def close(self) -> None:
        if self.group:
            cgroups.remove(self.run_id, self.label)
        roots.remove_root(self.root)
        roots.release_root(self.root)
        locks.release(self._lock)


# Playwright names a profile in the runner's TMPDIR: its directory is made in the sandbox, where it stays
LAUNCHER = """#!/bin/sh
for procs in {procs}; do echo $$ > "$procs" || exit 126; done
dir=/tmp
for arg; do case "$arg" in --user-data-dir=*) dir=$(dirname -- "${{arg#--user-data-dir=}}");; esac; done
exec {bwrap} --perms 1777 --dir "$dir" -- {chromium} "$@"
"""


def browser_env(home: str) -> dict[str, str]:
    """Chromium's whole environment: these names only, nothing else of the runner's."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home}


_shared: _Shared | None = None


def executable(settings: ToolSettings) -> str | None:
    """The chromium binary (a path, or a name looked up on PATH), if it is there and executable."""
    return shutil.which(settings.browser_executable or os.environ.get("CHROMIUM_PATH") or "chromium")


def browser_unavailable(settings: ToolSettings) -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed (pip install 'trajgen-batch-runner[browser]')"
    if executable(settings) is None:
        return "no chromium binary: apt-get install chromium, or set --browser_executable or CHROMIUM_PATH"
    return None


async def _browser(settings: ToolSettings) -> Any:
    """The worker's browser: launched once, under a lock because many prompts may ask at once,
    and launched again if it died."""
    global _shared
    loop = asyncio.get_running_loop()
    if _shared is None or _shared.loop is not loop:
        _shared = _Shared(loop, asyncio.Lock())
    shared = _shared
    async with shared.lock:
        if shared.browser is None or not shared.browser.is_connected():
            from playwright.async_api import async_playwright

            if shared.playwright is None:
                shared.playwright = await async_playwright().start()
            if os.geteuid() == 0 and shared.user is None:  # Chromium's sandbox refuses to run as root
                shared.user = _User(executable(settings), settings)
            shared.browser = await shared.playwright.chromium.launch(
                executable_path=shared.user.launcher if shared.user else executable(settings), headless=True,
                env=browser_env("/tmp" if shared.user else os.path.expanduser("~")),
                chromium_sandbox=True, args=[*CHROMIUM_ARGS, *([] if settings.allow_private_urls else [NO_OWN_LOOKUPS]),
                      *shlex.split(os.environ.get("TRAJGEN_CHROMIUM_ARGS", ""))],
            )
    return shared.browser


async def shutdown() -> None:
    """Close this process's browser and Playwright driver, if they run on this event loop."""
    global _shared
    shared, _shared = _shared, None
    if shared is None or shared.loop is not asyncio.get_running_loop():
        return
    if shared.browser is not None:
        await shared.browser.close()
    if shared.playwright is not None:
        await shared.playwright.stop()
    if shared.user is not None:
        shared.user.close()


def _guard(ctx: ToolContext) -> Guard | None:
    """The prompt's guard, None with --allow_private_urls (its proxy starts with the browser context)."""
    if ctx.settings.allow_private_urls:
        return None
    if GUARD_KEY not in ctx.state:
        ctx.state[GUARD_KEY] = Guard()
        ctx.cleanups.append(ctx.state[GUARD_KEY].close)
    return ctx.state[GUARD_KEY]


async def _page(ctx: ToolContext) -> Any:
    """The prompt's current tab (the newest open one, so a link that opens a tab is followed)."""
    context = ctx.state.get(CONTEXT_KEY)
    if context is None or not context.browser.is_connected():
        browser = await _browser(ctx.settings)
        options = {}
        if guard := _guard(ctx):  # "<-loopback>": loopback goes through the guard too
            options["proxy"] = {"server": await guard.start(), "bypass": "<-loopback>"}
        context = await browser.new_context(accept_downloads=False, service_workers="block", locale="en-US",
                                            viewport={"width": 1280, "height": 800}, **options)
        context.set_default_timeout(ACTION_TIMEOUT_MS)
        context.set_default_navigation_timeout(NAVIGATION_TIMEOUT_MS)
        ctx.state[CONTEXT_KEY] = context
        ctx.cleanups.append(context.close)
    pages = [p for p in context.pages if not p.is_closed()]
    return pages[-1] if pages else await context.new_page()


def _fail(error: str) -> dict:
    return {"success": False, "error": error}


async def _act(ctx: ToolContext, action: Callable[[Any], Awaitable[dict | None]]) -> dict:
    """Run one action on the current tab; report where the browser is afterwards, and what the guard
    refused meanwhile: a page the guard kept the tab from is a failure, blocked parts of a page are listed."""
    from playwright.async_api import Error as PlaywrightError

    guard = _guard(ctx)
    seen = len(guard.refused) if guard else 0
    kills = _oom_kills()
    try:
        extra = await action(await _page(ctx)) or {}
        page = await _page(ctx)
        await page.wait_for_load_state("domcontentloaded")
        result = {"success": True, "error": None, "url": page.url, "title": await page.title(), **extra}
    except Refused as e:
        return _fail(str(e))
    except PlaywrightError as e:
        if _oom_kills() > kills and "crashed" in e.message:  # its tab goes: the next call opens a new one
            await _close_crashed(ctx)
            return _fail(f"the page went past the browser's memory limit ({ctx.settings.browser_memory_mb} MB) "
                         "and the kernel killed it; its tab is closed")
        result = _fail(e.message.split("\nCall log:")[0].strip()[:MAX_ERROR_CHARS])  # Playwright's log is noise here
    refused = list(dict.fromkeys(guard.refused[seen:])) if guard else []
    if refused and (not result["success"] or result["url"].startswith("chrome-error:")):
        return _fail("; ".join(refused) + (f" ({result['error']})" if result["error"] else ""))
    return {**result, "blocked": refused} if refused else result


def _oom_kills() -> int:
    """The processes of this worker's browser the kernel killed for its memory limit so far."""
    return _shared.user.oom_kills() if _shared and _shared.user else 0


async def _close_crashed(ctx: ToolContext) -> None:
    """Close the prompt's tab that crashed, the newest one, on which the action ran."""
    from playwright.async_api import Error as PlaywrightError

    context = ctx.state.get(CONTEXT_KEY)
    pages = [p for p in context.pages if not p.is_closed()] if context else []
    if pages:
        try:
            await pages[-1].close()
        except PlaywrightError:
            pass


def _number(tree: str) -> tuple[str, dict[str, str]]:
    """The snapshot with its elements numbered [1], [2]... in order, and number -> Playwright ref."""
    refs: dict[str, str] = {}

    def number(match: re.Match) -> str:
        refs[str(len(refs) + 1)] = match.group(1)
        return f"[{len(refs)}]"

    return _SNAPSHOT_REF.sub(number, tree), refs


def _ref_number(ref: object) -> str | None:
    """The element number the model passed: 12, "12" or "[12]"."""
    if type(ref) is int:
        ref = str(ref)
    match = _REF_ARGUMENT.match(ref.strip()) if isinstance(ref, str) else None
    return match.group(1) if match else None


async def _element(ctx: ToolContext, page: Any, number: str) -> Any:
    """The element numbered so in the last snapshot, if it is still on the page."""
    name = ctx.state.get(REFS_KEY, {}).get(number)
    if name is None:
        raise Refused(f"no element [{number}] in the last browser_snapshot; take a snapshot first")
    target = page.locator(f"aria-ref={name}")
    if await target.count() == 0:
        raise Refused(f"element [{number}] is no longer on the page; take a new browser_snapshot")
    return target


BAD_REF = "`ref` must be an element number from browser_snapshot, e.g. \"12\""


async def browser_navigate(ctx: ToolContext, url: object = None) -> dict:
    parts = urlsplit(url.strip()) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
        return _fail("`url` must be an http(s) URL; other schemes (file:, chrome:, about:...) are refused")
    if (guard := _guard(ctx)) and (reason := await check_url(url.strip(), False, guard.check)):
        return _fail(reason)

    async def go(page: Any) -> dict:
        response = await page.goto(url.strip(), wait_until="domcontentloaded")
        return {"status": response.status if response else None}

    return await _act(ctx, go)


async def browser_snapshot(ctx: ToolContext) -> dict:
    async def snapshot(page: Any) -> dict:
        tree, ctx.state[REFS_KEY] = _number(await page.aria_snapshot(mode="ai"))
        return {"snapshot": tree[:MAX_SNAPSHOT_CHARS], "truncated": len(tree) > MAX_SNAPSHOT_CHARS}

    return await _act(ctx, snapshot)


async def browser_click(ctx: ToolContext, ref: object = None) -> dict:
    number = _ref_number(ref)
    if number is None:
        return _fail(BAD_REF)

    async def click(page: Any) -> None:
        await (await _element(ctx, page, number)).click()

    return await _act(ctx, click)


async def browser_type(ctx: ToolContext, ref: object = None, text: object = None, submit: object = False) -> dict:
    number = _ref_number(ref)
    if number is None:
        return _fail(BAD_REF)
    if not isinstance(text, str):
        return _fail("`text` must be a string")
    if not isinstance(submit, bool):
        return _fail("`submit` must be true or false")

    async def type_text(page: Any) -> None:
        target = await _element(ctx, page, number)
        await target.fill(text)
        if submit:
            await target.press("Enter")

    return await _act(ctx, type_text)


async def browser_scroll(ctx: ToolContext, direction: object = None) -> dict:
    if direction not in ("up", "down"):
        return _fail("`direction` must be \"up\" or \"down\"")

    async def scroll(page: Any) -> dict:
        y, viewport, height = await page.evaluate(
            "(sign) => { window.scrollBy({top: sign * window.innerHeight * 0.8, behavior: 'instant'});"
            " return [window.scrollY, window.innerHeight, document.documentElement.scrollHeight]; }",
            1 if direction == "down" else -1,
        )
        return {"scroll_y": round(y), "viewport_height": viewport, "page_height": height}

    return await _act(ctx, scroll)


async def browser_back(ctx: ToolContext) -> dict:
    async def back(page: Any) -> None:
        before = page.url
        if await page.go_back(wait_until="domcontentloaded") is None and page.url == before:
            raise Refused("there is no previous page in this tab's history")

    return await _act(ctx, back)


def _tool(name: str, fn: Callable, description: str, properties: dict, required: list[str]) -> ToolSpec:
    parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return ToolSpec(name, "browser", description, parameters, fn, unavailable=browser_unavailable)


REF = {"type": "string", "description": "The element's number from browser_snapshot, e.g. \"12\"."}

TOOLS = [
    _tool("browser_navigate", browser_navigate, "Open an http(s) URL in the browser's current tab.",
          {"url": {"type": "string", "description": "The http(s) URL to open."}}, ["url"]),
    _tool("browser_snapshot", browser_snapshot,
          "The current page as an accessibility tree: text, links, buttons and fields, each element numbered "
          "[1], [2]... for browser_click and browser_type.", {}, []),
    _tool("browser_click", browser_click, "Click an element of the last snapshot by its number.", {"ref": REF}, ["ref"]),
    _tool("browser_type", browser_type, "Replace the text of a field of the last snapshot; optionally press Enter.",
          {"ref": REF, "text": {"type": "string", "description": "The text to put in the field."},
           "submit": {"type": "boolean", "description": "Press Enter afterwards (default false)."}}, ["ref", "text"]),
    _tool("browser_scroll", browser_scroll, "Scroll the page by most of a screen.",
          {"direction": {"type": "string", "enum": ["up", "down"]}}, ["direction"]),
    _tool("browser_back", browser_back, "Go back to the previous page of the current tab.", {}, []),
]
