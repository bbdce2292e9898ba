"""The web, browser and vision toolsets end to end: the CLI (in process, `inline`) against the scripted model,
a local website, a fake SearXNG and real headless Chromium, all on 127.0.0.1.

The local website is on a loopback address: runs that read it pass --allow_private_urls, and one
run checks that without it the web and browser tools refuse the site.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import call, read_jsonl, think, write_jsonl
from tests.test_browser_tools import LAUNCH_PROBLEM, LOOPBACK_ONLY, in_browser, ref
from tests.test_web_tools import fake_api, local_site, no_provider_env  # noqa: F401  (fixtures)
from toolset_distributions import get_distribution, sample_toolsets
from trajgen import dataset
from trajgen.tools import ToolContext, ToolSettings
from trajgen.tools.browser import browser_navigate, browser_snapshot

VISION_QUESTION = "What animal is on the test site's picture?"
BROWSER_WEB_VISION = ("web_search", "web_extract", "browser_navigate", "browser_snapshot", "browser_click",
                      "browser_type", "browser_scroll", "browser_back", "vision_analyze")


def seed_sampling(prompts_file, distribution: str, toolsets: set[str]) -> int:
    """A --seed under which every prompt of the file samples all of `toolsets`."""
    check = dataset.check(str(prompts_file))
    keys = [e.key for e in dataset.entries(str(prompts_file), check.duplicates)]
    for seed in range(1000):
        if all(toolsets <= set(sample_toolsets(get_distribution(distribution), seed, key)) for key in keys):
            return seed
    raise AssertionError("no seed samples those toolsets for every prompt")


def element_numbers(site_url: str) -> tuple[str, str]:
    """The snapshot numbers of the home page's form link and of the form's text field, as the model
    would read them (the pages are fixed, so their numbering is too)."""
    found: list[str] = []

    async def steps(contexts: list[ToolContext]) -> None:
        ctx = ToolContext(sandbox=None, settings=ToolSettings(allow_private_urls=True))
        contexts.append(ctx)
        for path, element in (("/", 'link "open the form"'), ("/form", 'textbox "Your name"')):
            await browser_navigate(ctx, url=site_url + path)
            found.append(ref((await browser_snapshot(ctx))["snapshot"], element))

    in_browser(steps)
    return found[0], found[1]


@pytest.fixture
def tmpdir_for_chromium() -> Iterator[Path]:
    """The run's TMPDIR: a unique name to find its Chromium processes by, writable by Chromium's own user."""
    tmpdir = Path(tempfile.mkdtemp(prefix="trajgen-e2e-"))
    tmpdir.chmod(0o1777)
    yield tmpdir
    shutil.rmtree(tmpdir, ignore_errors=True)


def chromium_left(tmpdir: Path, timeout: float = 30) -> list[str]:
    """The run's Chromium processes (their profile is in the run's TMPDIR, so no one else's match)
    still alive after `timeout`: they exit just after their worker, when Playwright's driver sees
    its worker's pipe close."""
    def alive() -> list[str]:
        found = subprocess.run(["pgrep", "-af", str(tmpdir)], capture_output=True, text=True).stdout
        return [line for line in found.splitlines() if "chrom" in line]
    deadline = time.monotonic() + timeout
    while (left := alive()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def tool_results(row: dict) -> dict[str, dict]:
    """Tool name -> the last result it returned, from the row's tool turns."""
    results = {}
    for turn in row["conversations"]:
        if turn["from"] == "tool":
            envelope = json.loads(turn["value"].removeprefix("<tool_response>\n").removesuffix("\n</tool_response>"))
            results[envelope["name"]] = envelope["content"]
    return results


@pytest.mark.skipif(LAUNCH_PROBLEM is not None, reason=f"the browser toolset needs chromium: {LAUNCH_PROBLEM}")
def test_browser_use_run_really_searches_reads_browses_and_looks(inline, scripted_server, local_site, fake_api,
                                                                monkeypatch, tmpdir_for_chromium):
    tmpdir = tmpdir_for_chromium
    monkeypatch.setenv("TRAJGEN_CHROMIUM_ARGS", LOOPBACK_ONLY)
    site = local_site.url
    link, field = element_numbers(site)
    local_site.requests.clear()
    searxng = fake_api({"/search": (200, {"query": "loopback fox", "results": [
        {"url": site + "/", "title": "Local Test Site", "content": "A fox on the loopback interface.", "engine": "local"}]})})
    steps = [
        call("web_search", query="loopback fox"),
        call("web_extract", urls=[site + "/"]),
        call("browser_navigate", url=site + "/"),
        call("browser_snapshot"),
        call("browser_scroll", direction="down"),
        call("browser_click", ref=link),
        call("browser_snapshot"),
        call("browser_type", ref=field, text="hello from e2e", submit=True),
        call("browser_snapshot"),
        call("browser_back"),
        call("vision_analyze", image_url=site + "/cat.png", question=VISION_QUESTION),
        think("The site greets you back: You typed: hello from e2e."),
    ]
    calls = Counter(step["tool_calls"][0]["name"] for step in steps[:-1])
    prompts = ["Find the loopback fox site and say hello through its form.", "Visit the fox site and greet it."]
    server = scripted_server({"prompts": {p: steps for p in prompts},
                              "match": [{"contains": VISION_QUESTION, "replies": [{"content": "A tiny cat."}]}]})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": p} for p in prompts])
    seed = seed_sampling(inline.cwd / "prompts.jsonl", "browser_use", {"browser", "web", "vision"})

    done = inline.run(*inline.args(server, distribution="browser_use", seed=seed, max_turns=15,
                                   allow_private_urls=True),
                      env={"SEARXNG_URL": searxng.url, "TRAJGEN_CHROMIUM_ARGS": LOOPBACK_ONLY, "TMPDIR": str(tmpdir)})

    assert done.returncode == 0, done.stderr
    rows = read_jsonl(inline.run_dir() / "trajectories.jsonl")
    assert len(rows) == 2
    for row in rows:
        assert row["completed"] is True and set(row["toolsets_used"]) == {"browser", "web", "vision"}
        for name in BROWSER_WEB_VISION:
            n = calls[name]
            assert row["tool_stats"][name] == {"count": n, "success": n, "failure": 0}, (name, tool_results(row)[name])
        results = tool_results(row)
        assert results["web_search"]["provider"] == "searxng" and results["web_search"]["results"][0]["url"] == site + "/"
        assert "The quick brown fox lives on the loopback interface" in results["web_extract"]["results"][0]["content"]
        assert results["browser_click"]["url"] == site + "/form"
        assert results["browser_type"]["url"] == site + "/result?q=hello+from+e2e"
        assert 'You typed: hello from e2e' in results["browser_snapshot"]["snapshot"]  # the last snapshot
        assert results["browser_back"]["url"] == site + "/form" and results["browser_scroll"]["scroll_y"] > 0
        assert results["vision_analyze"]["analysis"] == "A tiny cat."
    vision_requests = [r for r in server.requests() if r["prompt"] and VISION_QUESTION in r["prompt"]]
    assert len(vision_requests) == 2 and vision_requests[0]["body"]["model"] == "test-model"
    image = vision_requests[0]["body"]["messages"][0]["content"][1]
    assert image == {"type": "image_url", "image_url": {"url": site + "/cat.png"}}
    assert [r["query"] for r in searxng.requests] == [{"q": ["loopback fox"], "format": ["json"]}] * 2
    assert any("trajgen-web-extract" in r["headers"]["user-agent"] for r in local_site.requests)
    assert any("HeadlessChrome" in r["headers"]["user-agent"] for r in local_site.requests)
    statistics = json.loads((inline.run_dir() / "statistics.json").read_text())
    assert statistics["tool_statistics"]["browser_type"]["success_rate"] == 1.0
    assert chromium_left(tmpdir) == []  # every worker's browser is gone with the run


@pytest.mark.skipif(LAUNCH_PROBLEM is not None, reason=f"the browser toolset needs chromium: {LAUNCH_PROBLEM}")
def test_without_allow_private_urls_the_tools_refuse_the_local_site(inline, scripted_server, local_site):
    site = local_site.url
    steps = [call("web_extract", urls=[site + "/"]), call("browser_navigate", url=site + "/"),
             think("Both were refused.")]
    server = scripted_server({"default": steps})
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": "Read the loopback fox site."}])
    seed = seed_sampling(inline.cwd / "prompts.jsonl", "browser_use", {"browser", "web"})

    done = inline.run(*inline.args(server, distribution="browser_use", seed=seed),  # no --allow_private_urls
                      env={"TRAJGEN_CHROMIUM_ARGS": LOOPBACK_ONLY})

    assert done.returncode == 0, done.stderr
    (row,) = read_jsonl(inline.run_dir() / "trajectories.jsonl")
    results = tool_results(row)
    for name in ("web_extract", "browser_navigate"):
        assert row["tool_stats"][name] == {"count": 1, "success": 0, "failure": 1}, results[name]
        assert results[name]["success"] is False and "refused: 127.0.0.1 is" in results[name]["error"]
        assert "--allow_private_urls" in results[name]["error"]
    assert local_site.requests == []


def test_vision_and_image_flags_reach_the_tools(inline, scripted_server):
    vision = scripted_server({"default": [{"content": "A tiny cat."}]})
    steps = [call("vision_analyze", image_url="https://127.0.0.1/cat.png", question=VISION_QUESTION),
             think("It is a cat.")]
    server = scripted_server({"default": steps})
    prompt = "Look at the picture of the fox site."
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": prompt}])
    seed = seed_sampling(inline.cwd / "prompts.jsonl", "creative", {"vision", "image_gen"})

    done = inline.run(*inline.args(server, distribution="creative", seed=seed, vision_model="vision-model",
                                   vision_base_url=vision.url, vision_api_key="vision-key", image_model="image-model",
                                   allow_private_urls=True))  # the image URL is on 127.0.0.1

    assert done.returncode == 0, done.stderr
    (row,) = read_jsonl(inline.run_dir() / "trajectories.jsonl")
    assert row["tool_stats"]["vision_analyze"]["success"] == 1
    assert "image_generate" in [t["function"]["name"] for t in server.requests()[0]["body"]["tools"]]
    (request,) = vision.requests()
    assert request["body"]["model"] == "vision-model" and request["auth"] == "Bearer vision-key"
    assert not any(VISION_QUESTION in (r["prompt"] or "") for r in server.requests())
