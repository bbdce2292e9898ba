"""The trajectory viewer (--view) and the run report (--report), driven in the real Chromium.

One run is made by the real CLI against the loopback scripted server (tool calls, a failure from
an HTTP 400, a sample without reasoning, a hallucinated tool, hostile text); one viewer serves it and one
Chromium, with every background service off, drives it for all tests of the module. Skipped
with the reason where playwright or chromium is missing.
"""
from __future__ import annotations

import http.client
import json
import re
import shutil
import signal
import subprocess
import time
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.conftest import CLI, call, read_jsonl, think, write_jsonl
from tests.support.inline import Inline
from tests.support.scripted_server import start_server
from trajgen.viewer.index import RunIndex
from trajgen.viewer.summary import summarize

sync_api = pytest.importorskip("playwright.sync_api", reason="the viewer tests need playwright (.[browser])")
CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="the viewer tests need Debian's chromium")
CHROMIUM_ARGS = ["--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--metrics-recording-only", "--disable-features=AutofillServerCommunication,OptimizationHints,MediaRouter",
                 "--no-first-run", "--disable-default-apps", "--disable-domain-reliability", "--no-pings",
                 "--disable-client-side-phishing-detection", "--safebrowsing-disable-auto-update",
                 "--disable-crash-reporter", "--disable-gpu", "--disable-quic",
                 "--proxy-server=http://127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]
HOSTILE = "</tool_response> <script>window.pwned = 1</script> <img src=x onerror=\"window.pwned = 2\">"
BAD_TOOL = "<img src=x onerror=\"window.pwned = 3\">"
SCRIPT = {"prompts": {
    "make a file": [call("write_file", path="hello.txt", content="hi\n"),
                    call("terminal", command="cat hello.txt; seq 1 60"),
                    call("read_file", path="missing.txt"),
                    {"content": "Done.", "reasoning": "all good"}],
    "hostile": [call("terminal", command=f"printf '%s' '{HOSTILE}'"), {"content": HOSTILE, "reasoning": HOSTILE}],
    "refused": [{"status": 400, "error": "bad request"}],
    "no reasoning": [{"content": "plain"}],
    "invent a tool": [call(BAD_TOOL, x=1), think("ok")],
}, "default": [call("terminal", command="echo hi"), think("answer")]}
PROMPTS = ([{"prompt": "make a file", "id": "a1"}, {"prompt": "hostile", "id": "<b>id</b>"}, {"prompt": "refused"},
            {"prompt": "no reasoning"}, {"prompt": "invent a tool"}] + [{"prompt": f"other {i}"} for i in range(5)])


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The run: (CLI, the CLI's output, statistics.json)."""
    cli = CLI(tmp_path_factory.mktemp("viewer"))
    server = start_server(SCRIPT)
    try:
        write_jsonl(cli.cwd / "prompts.jsonl", PROMPTS)
        done = cli.run(*cli.args(server, batch_size=3), env={"COLUMNS": "200"})
    finally:
        server.stop()
    assert done.returncode == 1, done.stderr  # one prompt failed
    return cli, done, json.loads((cli.run_dir() / "statistics.json").read_text())


def start_viewer(cli: CLI, run_name: str = "run") -> tuple[subprocess.Popen, str]:
    process = cli.start("--view", f"--run_name={run_name}", "--view_port=0")
    line = process.stdout.readline()
    found = re.search(r"http://127\.0\.0\.1:\d+/\?token=[\w-]{43}(?=\s)", line)
    assert found, line + process.stderr.read()
    return process, found.group(0)


@pytest.fixture(scope="module")
def url(made):
    process, address = start_viewer(made[0])
    yield address
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 0


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    opened = context.new_page()
    opened.dialogs = []
    opened.on("dialog", lambda dialog: (opened.dialogs.append(dialog.message), dialog.dismiss()))
    yield opened
    context.close()


def rows_by_index(made) -> dict[int, dict]:
    run_dir = made[0].run_dir()
    return {r["prompt_index"]: r for path in sorted(run_dir.glob("batch_*.jsonl")) for r in read_jsonl(path)}


def shown_indices(page) -> list[int]:
    return [int(n) for n in page.locator("#rows tr td:first-child").all_inner_texts()]


def open_list(page, url: str) -> None:
    page.goto(url)
    page.keyboard.press("t")
    page.locator("#rows tr").first.wait_for()


def choose(page, name: str, value: str, expected: list[int]) -> None:
    page.select_option(f"#f-{name}", value)
    sync_api.expect(page.locator("#rows tr td:first-child")).to_have_text([str(i) for i in expected])


def overview(page) -> dict[str, str]:
    """The summary's "At a glance" table: label -> value, as shown."""
    page.locator("#summary table.overview").wait_for()
    return dict(zip(page.locator("table.overview th").all_inner_texts(), page.locator("table.overview td").all_inner_texts()))


def test_the_summary_shows_statistics_json_and_the_cli_s_numbers(made, url, page):
    cli, done, stats = made
    page.goto(url)
    shown = overview(page)
    assert shown["prompts in dataset"] == "10" == str(stats["total_prompts"])
    assert shown["ok (rows written)"] == str(stats["ok"]) == "9"
    assert shown["kept in trajectories.jsonl"] == str(stats["kept"]) == "7"
    assert shown["discarded"] == "0" and shown["failed (resume retries)"] == "BadRequestError 1"
    assert shown["filtered (no reasoning)"] == str(stats["filtered_no_reasoning"]) == "1"
    assert shown["filtered (hallucinated tool)"] == str(stats["filtered_hallucinated"]) == "1"
    assert shown["api calls"] == str(stats["api_calls"])
    assert shown["reasoning coverage"].startswith(f"{stats['reasoning_statistics']['coverage_percent']}% of ")
    first_token = stats["latency"]["first_token"]
    assert shown["first token median / p95"] == f"{first_token['median']:.2f} s / {first_token['p95']:.2f} s"
    assert shown["stalls (calls asked again)"] == str(stats["stalls"]) == "0"
    for name, value in shown.items():  # the terminal's summary table printed the very same
        assert re.search(re.escape(name) + r"\s*│\s*" + re.escape(value) + r"\s*│", done.stdout), name
    tools = page.locator("table.tools tbody tr").all_inner_texts()
    expected = {n: s for n, s in stats["tool_statistics"].items() if s["count"]}
    assert len(tools) == len(expected) == 3
    for line in tools:
        name, count, success, failure, _ = line.split("\t")
        assert (int(count), int(success), int(failure)) == tuple(expected[name][k] for k in ("count", "success", "failure"))


def test_filters_show_exactly_the_right_rows(made, url, page):
    rows = rows_by_index(made)
    open_list(page, url)
    every = list(range(10))  # every prompt, failed ones too
    assert shown_indices(page) == every
    called_read_file = [i for i, r in sorted(rows.items()) if r["tool_stats"].get("read_file", {}).get("count")]
    called_terminal = [i for i, r in sorted(rows.items()) if r["tool_stats"].get("terminal", {}).get("count")]
    assert called_read_file == [0] and called_terminal == [0, 1, 5, 6, 7, 8, 9]
    choose(page, "tool", "read_file", called_read_file)
    choose(page, "tool", "terminal", called_terminal)
    choose(page, "tool", "", every)
    choose(page, "status", "failed", [2])
    page.locator("#detail .banner.failed").wait_for()
    assert "BadRequestError" in page.inner_text("#detail")
    page.locator("#detail .turn.human", has_text="refused").wait_for()  # its prompt, from the dataset file
    choose(page, "status", "filtered", [3, 4])
    assert "no assistant turn has reasoning (--require_reasoning)" in page.inner_text("#rows")
    choose(page, "status", "", every)
    choose(page, "failed_class", "BadRequestError", [2])
    choose(page, "failed_class", "", every)
    choose(page, "hallucinated", "yes", [4])
    assert "filtered" in page.inner_text("#rows")
    choose(page, "hallucinated", "", every)
    for query, expected in [("OTHER 3", "8"), ("A1", "0"), ("9", "9")]:  # prompt text, dataset id, index
        page.fill("#q", query)
        sync_api.expect(page.locator("#rows tr td:first-child")).to_have_text([expected])


def test_a_conversation_shows_the_tool_call_and_its_result(made, url, page):
    open_list(page, url)
    page.locator("#rows tr", has_text="make a file").click()
    page.locator("#detail .turn.human", has_text="make a file").wait_for()
    chat = page.locator("#detail .chat")
    chat.locator(".call-head", has_text="write_file").wait_for()
    call_box = chat.locator(".call", has_text="write_file")
    assert '"path": "hello.txt"' in call_box.inner_text()
    result = chat.locator(".turn.tool").nth(1)
    assert "tool result: terminal" in result.inner_text() and "hi\n1\n2\n" in result.inner_text()
    assert result.locator("details").count() == 1  # 61 lines: folded after the first ones
    reasoning = chat.locator("details.reasoning").first
    assert reasoning.get_attribute("open") is None and "reasoning" in reasoning.inner_text()
    assert "batch_0.jsonl:" in page.inner_text("#detail aside")
    assert '"id": "a1"' in page.inner_text("#detail aside")


def test_hostile_text_is_shown_as_text(made, url, page):
    open_list(page, url)
    page.locator("#rows tr", has_text="hostile").click()
    page.locator("#detail .turn.human", has_text="hostile").wait_for()
    chat = page.inner_text("#detail .chat")
    assert chat.count(HOSTILE) >= 2  # the tool's output and the final answer, verbatim
    assert "<b>id</b>" in page.inner_text("#rows")
    choose(page, "tool", BAD_TOOL, [4])
    page.keyboard.press("s")
    page.locator("#summary table.overview").wait_for()
    assert page.evaluate("document.querySelectorAll('script').length") == 1  # app.js alone
    assert page.evaluate("document.querySelectorAll('#detail img, #rows img, #summary img').length") == 0
    assert page.evaluate("window.pwned") is None and page.dialogs == []


def test_keyboard_moves_between_rows_and_pages_of_the_list(url, page):
    open_list(page, url)
    page.locator("#detail .chat").wait_for()
    page.keyboard.press("j")
    page.keyboard.press("j")
    sync_api.expect(page.locator("#rows tr.selected td").first).to_have_text("2")
    page.locator("#detail .banner.failed").wait_for()
    page.keyboard.press("k")
    sync_api.expect(page.locator("#rows tr.selected td").first).to_have_text("1")
    page.keyboard.press("/")
    assert page.evaluate("document.activeElement.id") == "q"


def test_the_report_opens_without_any_request_but_its_own_file(made, browser):
    cli, _, stats = made
    done = Inline(cli.cwd).run("--report", "--run_name=run")
    assert done.returncode == 0, done.stderr
    report = cli.run_dir() / "report.html"
    context = browser.new_context()
    opened = context.new_page()
    requests: list[str] = []
    opened.on("request", lambda request: requests.append(request.url))
    opened.goto(report.as_uri())
    opened.locator("table.overview").wait_for()
    assert requests == [report.as_uri()]
    assert f"ok (rows written)\t{stats['ok']}" in opened.inner_text("table.overview")
    assert opened.locator("svg.chart").count() >= 5
    not_kept = [line.split("\t") for line in opened.inner_text("table.not-kept tbody").splitlines()]
    assert [row[1:4] for row in not_kept] == [["", "failed", "BadRequestError"],
                                              ["", "filtered", "no assistant turn has reasoning (--require_reasoning)"],
                                              ["", "filtered", "called a tool that was not offered"]], not_kept
    assert [row[4] for row in not_kept] == ["refused", "no reasoning", "invent a tool"]
    assert "indexed" not in done.stderr and "note:" not in done.stderr
    context.close()


def _get(url: str, path: str, **headers) -> http.client.HTTPResponse:
    host, port = urlsplit(url).hostname, urlsplit(url).port
    connection = http.client.HTTPConnection(host, port, timeout=30)
    connection.request("GET", path, headers=headers)
    response = connection.getresponse()
    response.read()
    return response


def test_the_viewer_answers_only_with_its_token_on_its_own_host(url):
    token, port = parse_qs(urlsplit(url).query)["token"][0], urlsplit(url).port
    cookie = f"trajgen-viewer-{port}"
    for path in ("/", "/app.js", "/app.css", "/api/summary", "/api/entries", "/api/entry?key=x", "/nowhere"):
        with_query = path + ("&" if "?" in path else "?")
        assert _get(url, path).status == 403, path  # no token
        assert _get(url, f"{with_query}token=wrong{token}").status == 403, path
        assert _get(url, f"{with_query}token=").status == 403, path
        assert _get(url, path, Cookie=f"{cookie}={token[::-1]}").status == 403, path
        assert _get(url, path, Cookie=f"trajgen-viewer-{port + 1}={token}").status == 403, path  # another viewer's name
        assert _get(url, path, Cookie='bad"cookie;;=').status == 403, path
    refused = _get(url, f"/api/summary?token={token}", Host=f"attacker.example:{port}")
    assert refused.status == 403 and refused.getheader("Set-Cookie") is None
    first = _get(url, f"/?token={token}")
    assert first.status == 200 and "script-src 'self'" in first.getheader("Content-Security-Policy")
    assert first.getheader("Set-Cookie") == f"{cookie}={token}; Path=/; HttpOnly; SameSite=Strict"
    for path in ("/", "/app.js", "/app.css", "/api/summary", "/api/entries"):
        answer = _get(url, path, Cookie=f'other={{"json": 1}}; {cookie}={token}')  # another server's cookie first
        assert answer.status == 200 and answer.getheader("Set-Cookie") is None, path


def test_the_page_opens_from_the_printed_url_alone_then_by_its_cookie(url, page):
    bare = url.split("?")[0]
    refused = page.goto(bare)
    assert refused.status == 403 and "token" in page.inner_text("body")
    assert page.goto(url).status == 200
    page.locator("#summary table.overview").wait_for()  # its script and data came with the cookie
    page.goto(bare)  # the token gone from the address bar: the cookie stands for it
    page.locator("#summary table.overview").wait_for()


def test_usage_errors_are_one_line(made, tmp_path):
    cli = Inline(made[0].cwd)
    for flags, message in [(["--view"], "--view needs --run_name"), (["--report", "--run_name=nope"], "no such run directory"),
                           (["--view", "--run_name=run", "--view_port=70000"], "--view_port must be")]:
        done = cli.run(*flags)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_an_index_follows_a_run_that_is_still_going(made, tmp_path):
    """Lines land one at a time, a half-written last line waits for its end, and once every line
    is there the counts are statistics.json's."""
    source = made[0].run_dir()
    target = tmp_path / "copy"
    target.mkdir()
    shutil.copy(source / "manifest.json", target)
    lines = [(p.name, line) for p in sorted(source.glob("*.jsonl")) if p.name != "trajectories.jsonl"
             for line in p.read_bytes().splitlines(keepends=True)]
    index = RunIndex(target)
    for name, line in lines[:-1]:
        with open(target / name, "ab") as f:
            f.write(line)
    name, last = lines[-1]
    with open(target / name, "ab") as f:
        f.write(last[:10])
    index.refresh()
    assert len(index.entries) == 9 and summarize(index).live and not index.tallies.torn
    with open(target / name, "ab") as f:
        f.write(last[10:])
    index.refresh()
    shutil.copy(source / "statistics.json", target)
    found = summarize(index)
    assert len(index.entries) == 10 and not found.live
    saved = json.loads((source / "statistics.json").read_text())
    assert found.stats == {k: v for k, v in saved.items() if k != "merged_from"}  # a digest of the files, not a count
    for path in target.glob("*.jsonl"):  # --overwrite: the run starts again
        path.unlink()
    (target / "batch_0.jsonl").write_bytes(lines[0][1])
    index.refresh()
    assert [e.prompt_index for e in index.entries] == [json.loads(lines[0][1])["prompt_index"]]


def test_ctrl_c_stops_the_viewer_quietly(made):
    process, _ = start_viewer(made[0])
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 0
    assert "Traceback" not in process.stderr.read()


def test_the_viewer_follows_a_run_that_is_still_going(made, page):
    cli = made[0]
    server = start_server({"default": [{**call("terminal", command="true"), "delay": 0.3}, {**think(), "delay": 0.3}]})
    try:
        write_jsonl(cli.cwd / "slow.jsonl", [{"prompt": f"slow {i}"} for i in range(12)])
        running = cli.start(*cli.args(server, run_name="live", dataset_file="slow.jsonl", num_workers=1, concurrency=1,
                                      batch_size=2))
        first = cli.run_dir("live") / "batch_0.jsonl"
        deadline = time.monotonic() + 120
        while not (first.exists() and first.read_bytes().count(b"\n")) and running.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        viewer, address = start_viewer(cli, "live")
        try:
            page.goto(address)
            page.locator("#summary p.live").wait_for()  # counts from the files: no statistics.json yet
            assert int(overview(page)["ok (rows written)"]) < 12
            assert running.wait(timeout=300) == 0
            stats = json.loads((cli.run_dir("live") / "statistics.json").read_text())
            deadline = time.monotonic() + 60
            while page.locator("#summary p.live").count() or overview(page)["ok (rows written)"] != "12":
                assert time.monotonic() < deadline
                page.reload()
                page.locator("#summary table.overview").wait_for()
            assert overview(page)["api calls"] == str(stats["api_calls"]) == "24"
        finally:
            viewer.send_signal(signal.SIGINT)
            viewer.wait(timeout=60)
    finally:
        server.stop()
