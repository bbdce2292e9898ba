"""The run at a glance as HTML with inline SVG charts: the viewer's summary pane and report.html.

Every string that comes from the run is escaped here; the markup uses classes only (no inline
style), so it stays inside the viewer's Content-Security-Policy.
"""
from __future__ import annotations

import base64
import hashlib
import math
from html import escape
from importlib import resources

from trajgen import console
from trajgen.scheduler import now
from trajgen.viewer.summary import NOT_KEPT_SHOWN, NotKept, Summary

WIDTH = 640
LABEL = 170  # room for the names left of horizontal bars
BAR = 18
CHAR = 7  # width of a character of the charts' text, roughly


def _e(value) -> str:
    return escape(str(value), quote=True)


def _svg(height: int, body: str, label: str) -> str:
    return (f'<svg class="chart" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" role="img" '
            f'aria-label="{_e(label)}">{body}</svg>')


def _rect(x: float, y: float, w: float, h: float, cls: str, tip: str) -> str:
    return (f'<rect class="{cls}" x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{h:.1f}">'
            f'<title>{_e(tip)}</title></rect>')


def _text(x: float, y: float, text, cls: str = "", anchor: str = "start") -> str:
    return f'<text class="{cls}" x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}">{_e(text)}</text>'


def bars(rows: list[tuple[str, list[tuple[int, str, str]]]], label: str) -> str:
    """Horizontal bars, one per name, each stacked from (value, class, legend) segments."""
    if not rows:
        return '<p class="empty">none</p>'
    top = max(sum(v for v, _, _ in segments) for _, segments in rows) or 1
    values = [" / ".join(str(v) for v, _, _ in segments) for _, segments in rows]
    scale = (WIDTH - LABEL - 12 - CHAR * max(map(len, values))) / top
    body = []
    for i, (name, segments) in enumerate(rows):
        y = 4 + i * (BAR + 6)
        body.append(_text(LABEL - 8, y + BAR - 5, name, "name", "end"))
        x = LABEL
        for value, cls, legend in segments:
            body.append(_rect(x, y, value * scale, BAR, cls, f"{name}: {legend} {value}"))
            x += value * scale
        body.append(_text(x + 6, y + BAR - 5, values[i], "value"))
    return _svg(8 + len(rows) * (BAR + 6), "".join(body), label)


def histogram(bins: list[tuple[int, int, int]], label: str, unit: str) -> str:
    """Vertical bars, each labelled with its count and its range of `unit`."""
    if not bins:
        return '<p class="empty">no kept rows yet</p>'
    height, bottom = 160, 132
    top = max(count for _, _, count in bins) or 1
    width = (WIDTH - 20) / len(bins)
    spans = [str(low) if low == high else f"{low}-{high}" for low, high, _ in bins]
    every = math.ceil((CHAR * max(map(len, spans)) + 6) / width)  # label every n-th bin, so labels never overlap
    body = []
    for i, (low, high, count) in enumerate(bins):
        h = (bottom - 28) * count / top
        x = 10 + i * width
        body.append(_rect(x + 1, bottom - h, width - 2, h, "bar-hist", f"{spans[i]} {unit}: {count} rows"))
        if count:
            body.append(_text(x + width / 2, bottom - h - 4, count, "axis", "middle"))
        if i % every == 0:
            body.append(_text(x + width / 2, bottom + 14, spans[i], "axis", "middle"))
    body.append(_text(WIDTH / 2, height - 2, f"{unit} (rows per bin above each bar)", "axis", "middle"))
    return _svg(height, "".join(body), label)


def _legend(items: list[tuple[str, str]]) -> str:
    return '<p class="legend">' + "".join(f'<span class="key {cls}"></span>{_e(name)} ' for cls, name in items) + "</p>"


def _section(title: str, content: str) -> str:
    return f'<section class="card"><h3>{_e(title)}</h3>{content}</section>'


def summary_html(summary: Summary) -> str:
    s = summary.stats
    title = f"Run {s['run_name']}: {s['model']}"
    live = ('<p class="live">The run is still going (or stopped before its statistics were written): these counts '
            'are live from the files; durations are those of the last checkpoint.</p>') if summary.live else ""
    overview = "".join(f'<tr><th scope="row">{_e(name)}</th><td>{_e(value)}</td></tr>'
                       for name, value in [*console.overview_rows(s), *console.verification_rows(s),
                                           *console.reward_rows(s)])
    filtered = s["filtered_hallucinated"] + s["filtered_no_reasoning"] + s["filtered_not_passed"]
    outcome = [("kept", s["kept"], "bar-ok"), ("filtered", filtered, "bar-filtered"),
               ("discarded", s["discarded"]["total"], "bar-discarded"), ("failed", s["failed"]["total"], "bar-failed"),
               ("not yet run", s["remaining_not_run"], "bar-pending")]
    outcome_chart = bars([("prompts", [(v, cls, name) for name, v, cls in outcome])], "prompts by outcome")
    tools = sorted(((n, t) for n, t in s["tool_statistics"].items() if t["count"]), key=lambda item: -item[1]["count"])
    tool_rows = "".join(
        f'<tr><td>{_e(n)}</td><td>{t["count"]}</td><td>{t["success"]}</td><td>{t["failure"]}</td>'
        f'<td>{100 * t["success_rate"]:.1f}%</td></tr>' for n, t in tools)
    tool_table = (f'<table class="numbers tools"><thead><tr><th>tool</th><th>calls</th><th>success</th><th>failure</th>'
                  f'<th>success rate</th></tr></thead><tbody>{tool_rows}</tbody></table>') if tools else ""
    tool_chart = bars([(n, [(t["success"], "bar-ok", "success"), (t["failure"], "bar-failed", "failure")])
                       for n, t in tools], "tool calls by tool")
    toolset_chart = bars([row for n, (sampled, offered) in summary.toolsets.items()
                          for row in ((f"{n} sampled", [(sampled, "bar-sampled", "sampled")]),
                                      (f"{n} offered", [(offered, "bar-ok", "offered")]))],
                         "toolsets sampled and offered")
    reasoning = s["reasoning_statistics"]
    reasoning_chart = bars([("assistant turns", [(reasoning["turns_with_reasoning"], "bar-ok", "with reasoning"),
                                                 (reasoning["turns_without_reasoning"], "bar-pending", "without")])],
                           "reasoning coverage")
    return "".join([
        f'<h2>{_e(title)}</h2>', live,
        '<div class="cards">',
        _section("At a glance", f'<table class="numbers overview"><tbody>{overview}</tbody></table>'),
        _section("Prompts by outcome", outcome_chart + _legend([(c, f"{n} {v}") for n, v, c in outcome])),
        _section("Tool calls by tool (kept rows)", tool_chart + _legend([("bar-ok", "success"), ("bar-failed", "failure")])
                 + tool_table),
        _section("Toolsets: sampled and offered (prompts)", toolset_chart),
        _section("Assistant turns per prompt (kept rows)", histogram(summary.turns, "turns per prompt", "turns")),
        _section("Tokens per prompt, prompt + completion (kept rows)",
                 histogram(summary.tokens, "tokens per prompt", "tokens")),
        _section(f"Reasoning coverage: {reasoning['coverage_percent']}%", reasoning_chart
                 + _legend([("bar-ok", "with reasoning"), ("bar-pending", "without")])),
        '</div>',
    ])


def stylesheet() -> str:
    return resources.files("trajgen.viewer").joinpath("static/app.css").read_text()


def not_kept_html(prompts: list[NotKept]) -> str:
    """The prompts without a kept row, each with its status and why."""
    if not prompts:
        return _section("Prompts not kept", '<p class="empty">none: every prompt run has a row in trajectories.jsonl</p>')
    rows = "".join(f'<tr><td>{_e("" if p.prompt_index is None else p.prompt_index)}</td><td>{_e(p.dataset_id or "")}</td>'
                   f'<td>{_e(p.status)}</td><td>{_e(p.reason or "")}</td><td>{_e(p.preview)}</td></tr>'
                   for p in prompts[:NOT_KEPT_SHOWN])
    more = (f'<p class="empty">and {len(prompts) - NOT_KEPT_SHOWN} more: <code>--view</code> lists them all</p>'
            if len(prompts) > NOT_KEPT_SHOWN else "")
    return _section(f"Prompts not kept: failed, discarded, filtered ({len(prompts)})",
                    '<table class="numbers not-kept"><thead><tr><th>prompt</th><th>id</th><th>status</th>'
                    f'<th>why</th><th>text</th></tr></thead><tbody>{rows}</tbody></table>{more}')


def report_html(summary: Summary, prompts: list[NotKept]) -> str:
    """The run's summary, then the prompts not kept."""
    return standalone("Report: " + str(summary.stats["run_name"]), summary_html(summary) + not_kept_html(prompts),
                      "batch_runner.py --report")


def standalone(title: str, body: str, written_by: str) -> str:
    """A page that needs nothing but itself: the stylesheet inline, allowed by its hash alone."""
    css = stylesheet()
    digest = base64.b64encode(hashlib.sha256(css.encode()).digest()).decode()
    policy = f"default-src 'none'; style-src 'sha256-{digest}'; img-src data:; base-uri 'none'; form-action 'none'"
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{policy}">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">'
            f'<title>{_e(title)}</title><style>{css}</style></head>'
            f'<body class="report"><main id="summary">{body}'
            f'<p class="empty">Written by <code>{_e(written_by)}</code> at {_e(now())}.</p></main></body></html>\n')
