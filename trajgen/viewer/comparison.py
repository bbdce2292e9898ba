"""A comparison of runs as HTML: comparison.html (self-contained, the conversations of the prompts
only one run solved inline) and the viewer's comparison pages (every shared prompt, two runs'
conversations side by side). Everything from the runs is escaped here; no script, no inline style.
"""
from __future__ import annotations

from html import escape
from typing import Callable
from urllib.parse import parse_qsl, urlencode, urlsplit

import orjson

from trajgen.compare import Run, completed, passed
from trajgen.merge import Filtering
from trajgen.viewer import conversation, render, server

# seconds per reply in each run's statistics.json, named as the run's summary names them (console.latency_rows)
LATENCY = {"first_byte": "first byte", "first_token": "first token", "generation": "generation"}
INLINE = 200  # discordant prompts per pair whose conversations comparison.html holds; the rest are listed
Link = Callable[[dict, str], str]  # (pair, prompt key) -> the address of its side-by-side view


def _e(value) -> str:
    return escape(str(value), quote=True)


def _pct(rate: dict) -> str:
    if rate["rate"] is None:
        return "n/a"
    low, high = rate["ci95"]
    return f"{100 * rate['rate']:.1f}% [{100 * low:.1f}, {100 * high:.1f}] of {rate['of']}"


def _or_na(value, fmt: str = "{}") -> str:
    return "n/a" if value is None else fmt.format(value)


def figure_rows(runs: list[dict]) -> list[tuple[str, list[str]]]:
    """The per-run figures as (label, one cell per run): the HTML and the terminal table show these."""
    ks = sorted({k for r in runs for k in r["pass_at_k"]}, key=int)
    rows = [
        ("model", [str(r["model"]) for r in runs]),
        ("served by", [", ".join(f"{n} ({c})" for n, c in r["served_by"].items()) or "n/a" for r in runs]),
        ("prompts compared / in run", [f"{r['prompts']} / {r['prompts_in_run']}" for r in runs]),
        ("samples ok / discarded / failed",
         [" / ".join(str(r["samples"].get(k, 0)) for k in ("ok", "discarded", "failed")) for r in runs]),
        ("pass rate, prompts [95% CI]", [_pct(r["pass_rate_prompts"]) for r in runs]),
        ("pass rate, samples [95% CI]", [_pct(r["pass_rate_samples"]) for r in runs]),
        *((f"pass@{k}", [_or_na((r["pass_at_k"].get(k) or {}).get("rate"), "{:.1%}") for r in runs]) for k in ks),
        ("mean turns per sample", [_or_na(r["mean_turns"]) for r in runs]),
        ("mean tool calls per sample", [_or_na(r["mean_tool_calls"]) for r in runs]),
        ("tool error rate", [_or_na(r["tool_error_rate"], "{:.1%}") for r in runs]),
        ("samples calling a tool not offered", [str(r["samples_with_hallucinated_tools"]) for r in runs]),
        ("reasoning coverage", [_or_na(r["reasoning_coverage"], "{:.1%}") for r in runs]),
        ("tokens prompt / completion / reasoning",
         [" / ".join(str(r["tokens"][k]) for k in ("prompt", "completion", "reasoning")) for r in runs]),
        ("cost", [_or_na(r["cost"], "${:.4f}") for r in runs]),
        ("cost per passed prompt", [_or_na(r["cost_per_passed_prompt"], "${:.4f}") for r in runs]),
        ("wall time (all invocations)", [_or_na(r["wall_seconds_total"], "{:.1f} s") for r in runs]),
        ("median seconds per sample", [_or_na(r["median_seconds_per_sample"]) for r in runs]),
    ]
    measured = {k for r in runs for k in (r["latency"] or {})}
    rows += [(f"{LATENCY[key]} median / p95", [_spread((r["latency"] or {}).get(key)) for r in runs])
             for key in LATENCY if key in measured or key == "first_token"]
    return rows


def _spread(spread: dict | None) -> str:
    return "n/a" if not spread else f"{spread['median']:.2f} s / {spread['p95']:.2f} s"


def run_label(i: int, run: dict) -> str:
    """A run as the tables name it: its number and directory (two runs may share a model)."""
    return f"{i}: {run['run_dir']}"


def pair_label(pair: dict, runs: list[dict]) -> str:
    return f"A = {run_label(pair['a'], runs[pair['a']])} vs B = {run_label(pair['b'], runs[pair['b']])}"


def pair_rows(pair: dict) -> list[tuple[str, str]]:
    """A pair's table as (label, value): the HTML and the terminal table show these."""
    word = pair["outcome"]
    return [("prompts compared", f"{pair['prompts_compared']} of {pair['shared_prompts']} shared"),
            (f"both {word}", str(pair["both"])), (f"only A {word}", str(pair["only_a"])),
            (f"only B {word}", str(pair["only_b"])), (f"neither {word}", str(pair["neither"])),
            ("exact McNemar p-value", "n/a (no verdicts)" if pair["p_value"] is None else f"{pair['p_value']:.4g}")]


def _table(head: list[str], rows: list[tuple[str, list[str]]], cls: str) -> str:
    header = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join(f'<tr><th scope="row">{_e(label)}</th>' + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>"
                   for label, cells in rows)
    return f'<table class="numbers {cls}"><thead><tr>{header}</tr></thead><tbody>{body}</tbody></table>'


def turns_html(turns: list[dict]) -> str:
    """One conversation, as conversation.view gives its turns."""
    shown = []
    for turn in turns:
        role = str(turn.get("role"))
        parts = [f'<div class="role">{_e(role)}{" · " + _e(turn["name"]) if turn.get("name") else ""}</div>']
        if turn.get("reasoning"):
            parts.append(f'<details class="reasoning"><summary>reasoning</summary><pre>{_e(turn["reasoning"])}</pre></details>')
        if turn.get("text"):
            parts.append(f"<pre>{_e(turn['text'])}</pre>")
        for call in turn.get("calls") or []:
            call = call if isinstance(call, dict) else {"name": str(call)}
            parts.append(f'<div class="call"><span class="call-head">{_e(call.get("name"))}</span>'
                         f'<pre>{_e(_json(call.get("arguments")))}</pre></div>')
        if "content" in turn:
            parts.append(f"<pre>{_e(_json(turn['content']))}</pre>")
        shown.append(f'<div class="turn {_e(role)}">{"".join(parts)}</div>')
    return f'<div class="chat">{"".join(shown)}</div>'


def _json(value) -> str:
    return value if isinstance(value, str) else orjson.dumps(value, option=orjson.OPT_INDENT_2).decode()


def side_by_side(key: str, a: Run, b: Run, labels: tuple[str, str]) -> str:
    """Two runs' conversations of one prompt, each run's samples in turn, in two columns."""
    columns = []
    for run, label in ((a, labels[0]), (b, labels[1])):
        samples = []
        for sample in run.groups.get(key, []):
            entry = run.index.entries[run.index.by_key[sample.key]]
            shown = conversation.view(entry, run.index.read(entry), Filtering(), run.path)
            head = f"{sample.key} · {sample.status}{' (' + sample.reason + ')' if sample.reason else ''} · verify {sample.verdict}"
            samples.append(f'<h4>{_e(head)}</h4><p class="empty">{_e(run.path.name)}/{_e(sample.file)}, line {sample.line}</p>'
                           + turns_html(shown["turns"]))
        verdict = {True: "passed", False: "not passed", None: "not judged"}[passed(run.groups.get(key, []))]
        columns.append(f'<div class="side"><h3>{_e(label)}: {_e(verdict)}</h3>'
                       f'{"".join(samples) or """<p class="empty">not in this run</p>"""}</div>')
    return f'<div class="pair">{"".join(columns)}</div>'


def comparison_html(found: dict, runs: list[Run], link: Link | None = None) -> str:
    """The comparison's body. With `link` (the viewer) every shared prompt links to its side-by-side
    view; without it the prompts only one run solved hold theirs inline (comparison.html)."""
    figures = found["runs"]
    head = f"<h2>Comparison of {len(figures)} runs over {found['shared_prompts']} shared prompts</h2>"
    head += "".join(f'<p class="live">{_e(w)}</p>' for w in found["warnings"])
    parts = [_card("Per run", _table(["", *(run_label(i, r) for i, r in enumerate(figures))],
                                     figure_rows(figures), "figures"))]
    for pair in found["pairs"]:
        a, b = runs[pair["a"]], runs[pair["b"]]
        label = pair_label(pair, figures)
        table = _table(["", ""], [(name, [value]) for name, value in pair_rows(pair)], "pair-table")
        table += f'<p class="live">{_e(pair["note"])}</p>' if pair["note"] else ""
        parts.append(_card(label, table + _prompt_list(pair, a, b, link), "wide"))
    return head + '<div class="cards">' + "".join(parts) + "</div>"


def _card(title: str, content: str, cls: str = "") -> str:
    return f'<section class="card {cls}"><h3>{_e(title)}</h3>{content}</section>'


def _prompt_list(pair: dict, a: Run, b: Run, link: Link | None) -> str:
    word = pair["outcome"]
    if link:
        keys = sorted(a.groups.keys() & b.groups.keys())
        items = [(k, (a.groups[k][0].preview or b.groups[k][0].preview), _outcome(a, b, k, word)) for k in keys]
        title = f"Every shared prompt ({len(items)})"
    else:
        items = [(d["prompt_key"], d["preview"], f"only {d['solved_by'].upper()} {word}") for d in pair["discordant"]]
        title = f"Prompts only one run {word} ({len(items)})"
    labels = (f"A: {a.label}", f"B: {b.label}")
    rows = []
    for i, (key, preview, outcome) in enumerate(items):
        said = f'{_e(preview or key)} <span class="reason">{_e(outcome)}</span>'
        if link:
            rows.append(f'<li><a href="{_e(link(pair, key))}">{said}</a></li>')
        elif i < INLINE:
            rows.append(f'<li><details><summary>{said}</summary>{side_by_side(key, a, b, labels)}</details></li>')
        else:
            rows.append(f"<li>{said}</li>")
    more = (f'<p class="empty">The conversations of the first {INLINE} are here; <code>--view --compare</code> shows '
            'every one.</p>') if not link and len(items) > INLINE else ""
    return f"<h4>{_e(title)}</h4>{more}" + (f'<ul class="prompts">{"".join(rows)}</ul>' if rows else '<p class="empty">none</p>')


def _outcome(a: Run, b: Run, key: str, word: str) -> str:
    judge = passed if word == "passed" else completed
    x, y = judge(a.groups[key]), judge(b.groups[key])
    if x is None or y is None:
        return "not judged in both"
    return f"both {word}" if x and y else f"only A {word}" if x else f"only B {word}" if y else f"neither {word}"


def comparison_page(found: dict, runs: list[Run]) -> str:
    """comparison.html: needs nothing but itself."""
    return render.standalone(f"Comparison of {len(runs)} runs", comparison_html(found, runs),
                             "batch_runner.py --compare")


def _viewer_page(title: str, body: str) -> str:
    return ('<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><link rel="icon" href="data:,">'
            f'<link rel="stylesheet" href="/app.css"><title>{_e(title)}</title></head>'
            f'<body class="report"><main id="summary">{body}</main></body></html>\n')


def serve(found: dict, runs: list[Run], port: int) -> int:
    """The viewer of a comparison: every shared prompt of each pair, each opening both runs'
    conversations side by side. Until Ctrl-C; returns the exit status."""
    link = lambda pair, key: "/pair?" + urlencode({"a": pair["a"], "b": pair["b"], "key": key})  # noqa: E731
    front = _viewer_page(f"Comparison of {len(runs)} runs", comparison_html(found, runs, link))

    class Handler(server.BaseHandler):
        def do_GET(self) -> None:
            if not self._allowed():
                return
            url = urlsplit(self.path)
            if url.path == "/":
                return self._send(200, front.encode(), "text/html; charset=utf-8")
            if url.path == "/pair" and (page := _pair_page(dict(parse_qsl(url.query)), runs)):
                return self._send(200, page.encode(), "text/html; charset=utf-8")
            if url.path == "/app.css" and self._static(url.path):
                return
            self._send(404, b"not found", "text/plain")

    Handler.port_box = [port]
    return server.listen(Handler, Handler.port_box, f"comparing {len(runs)} runs")


def _pair_page(params: dict[str, str], runs: list[Run]) -> str | None:
    try:
        a, b = runs[int(params["a"])], runs[int(params["b"])]
    except (KeyError, ValueError, IndexError):
        return None
    key = params.get("key", "")
    if key not in a.groups and key not in b.groups:
        return None
    first = (a.groups.get(key) or b.groups.get(key))[0]
    body = (f'<p><a href="/">back to the comparison</a></p><h2>{_e(first.preview or key)}</h2>'
            + side_by_side(key, a, b, (f"A: {a.label}", f"B: {b.label}")))
    return _viewer_page(f"{first.preview[:60] or key}", body)
