"""The report: the results table, the findings, and bench/RESULTS.md."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

from rich.table import Table

import harness
import ray_scale
import reference
import viewer
from harness import (
    MACHINE,
    NOTES_END,
    NOTES_START,
    console,
    median,
    spread,
)
from sections import (
    LATENCY,
)

# ----------------------------------------------------------------------------- report


@dataclass
class Row:
    section: str
    config: str
    value: str
    target: str
    verdict: str  # PASS / FAIL / info
    note: str = ""


def _fmt(v, digits=2, unit=""):
    return "n/a" if v is None else f"{v:.{digits}f}{unit}"


def _verdict(ok) -> str:
    return "info" if ok is None else ("PASS" if ok else "FAIL")


def _throughput_rows(res: dict, section: str, targets: dict) -> list[Row]:
    rows = []
    n = res["n"]
    base = res["configs"].get("4x4")
    base_dur = median([r["duration_s"] for r in base]) if base else None
    for key, runs in res["configs"].items():
        workers, conc = runs[0]["workers"], runs[0]["concurrency"]
        tools = runs[0].get("tools", True)
        eff = median([r["efficiency"] for r in runs])
        dur = median([r["duration_s"] for r in runs])
        wall = median([r["wall_s"] for r in runs])
        ideal = runs[0]["ideal_s"]
        target = targets.get(key)
        note = (f"ideal {ideal:.1f} s; duration {_fmt(dur, 1)} s (subprocess wall {_fmt(wall, 1)} s); "
                f"runs {len(runs)}")
        if len(runs) > 1:
            note += f" (efficiency {spread([r['efficiency'] for r in runs])})"
        floor = runs[0].get("calls", 2) * runs[0].get("latency", LATENCY)  # a prompt's calls, back to back
        p50 = median([r.get("prompt_wall_p50") for r in runs])
        p95 = median([r.get("prompt_wall_p95") for r in runs])
        if p50 is not None:
            note += f"; per-prompt wall p50 {p50:.2f} s, p95 {p95:.2f} s (floor {floor:.2f})"
        if (rate := median([r.get("steady_rate") for r in runs])) is not None:
            note += (f"; steady rate {rate:.1f} prompts/s (10th to 90th percentile of end times; "
                     f"ideal {conc / floor:.0f})")
        cpu = median([r["cpu_s"] for r in runs])
        scpu = median([r["server_cpu_s"] for r in runs])
        if cpu is not None and dur:
            note += (f"; CPU (getrusage) runner {cpu:.1f} s = {1000 * cpu / n:.1f} ms/prompt, server {scpu:.1f} s: "
                     f"{(cpu + scpu) / dur:.2f} of the 2 cores")
        mb = median([r.get("machine_busy") for r in runs])
        if mb is not None:
            kt = median([r.get("kthreads_cpu_s") for r in runs])
            fo = median([r.get("foreign_cpu_s") for r in runs])
            note += (f"; whole machine {100 * mb:.0f}% busy (CPU outside the CLI and the server {_fmt(fo, 1)} s"
                     + (f", kernel threads {kt:.1f} s" if kt is not None else "") + ")")
        if base_dur and dur and key != "4x4":
            note += f"; {base_dur / dur:.1f}x faster than 4x4"
        what = f"N={n:,} --num_workers={workers} --concurrency={conc}" + ("" if tools else ", no sandbox (the tool call is one the run does not offer)")
        rows.append(Row(section, what, f"efficiency {_fmt(eff)}",
                        f">= {target}" if target else ("(reference defaults)" if key == "4x4" else ""),
                        _verdict(eff >= target if (target and eff is not None) else None), note))
    return rows


def rows_throughput(res: dict) -> list[Row]:
    return _throughput_rows(res, "throughput", {"2x64": 0.90})


def rows_realistic(res: dict) -> list[Row]:
    rows = _throughput_rows(res, "realistic", {"2x256": 0.90})
    for row in rows:
        row.config += f", {res['commands']} terminal calls a prompt, {res['latency']:g} s a call"
    return rows


def rows_diag(res: dict) -> list[Row]:
    return _throughput_rows(res, "diagnosis", {"2x256-notools": 0.80})


def rows_versus(res: dict) -> list[Row]:
    """The pairs of section versus: with the flags over without, by the steady rate (throughput once
    going) and by the duration (start-up and the last stragglers included)."""
    pairs = res["pairs"]
    rate = [p["with"]["steady_rate"] / p["without"]["steady_rate"] for p in pairs
            if p["with"].get("steady_rate") and p["without"].get("steady_rate")]
    wall = [p["without"]["duration_s"] / p["with"]["duration_s"] for p in pairs
            if p["with"]["duration_s"] and p["without"]["duration_s"]]

    def fixed(which: str) -> float | None:  # seconds beyond what the steady rate accounts for
        return median([p[which]["duration_s"] - res["n"] / p[which]["steady_rate"] for p in pairs
                       if p[which]["duration_s"] and p[which].get("steady_rate")])

    def rates(which: str) -> str:
        return ", ".join(_fmt(p[which].get("steady_rate"), 1) for p in pairs)

    ratio = median(rate)
    target = 0.9 if "--executor=ray" in res["flags"] else None  # the Ray executor against the process pool
    note = (f"{len(pairs)} pairs, each run without the flags then with them; steady rate ratios "
            f"{', '.join(f'{r:.2f}' for r in rate)} (prompts/s without: {rates('without')}; with: {rates('with')}); "
            f"by duration {_fmt(median(wall))} ({spread(wall)}); seconds beyond the steady rate "
            f"(start-up, the last prompts, shutdown) without {_fmt(fixed('without'), 1)}, with {_fmt(fixed('with'), 1)}")
    return [Row("versus", f"N={res['n']:,} --num_workers={res['workers']} --concurrency={res['concurrency']}: "
                          f"{res['flags']} vs without", f"throughput ratio {_fmt(ratio)}",
                f">= {target}" if target else "", _verdict(ratio >= target if target and ratio else None), note)]


def rows_pool(res: dict) -> list[Row]:
    rows = []
    for key, runs in res["runs"].items():
        kind, conns = key.split("@")
        ms = median([r["cpu_ms_per_request"] for r in runs])
        wall = median([r["wall_s"] for r in runs])
        client = "openai.DefaultAioHttpClient (aiohttp)" if kind == "aiohttp" else f"{kind}.AsyncClient"
        rows.append(Row("http client", f"one process, openai.AsyncOpenAI + {client}, {conns} requests in flight",
                        f"{_fmt(ms)} ms CPU/request", "", "info",
                        f"{runs[0]['total']} requests at latency {LATENCY} s: wall {_fmt(wall, 1)} s for an ideal of "
                        f"{runs[0]['ideal_s']:.0f} s; runs {len(runs)}"
                        + {"httpx": " (trajgen/chat_calls.py's client before d607319)",
                           "httpx2": " (the openai SDK's default client)",
                           "aiohttp": " (trajgen/chat_calls.py's client from d607319 until trajgen/transport.py)"}.get(kind, "")))
    return rows


def rows_overhead(res: dict) -> list[Row]:
    rows = []
    n = res["n"]
    cfg = f"N={n:,} latency 0, --num_workers={res['workers']} --concurrency={res['concurrency']}"
    per = {}
    for label in ("no_tools", "terminal"):
        if label not in res:
            continue
        runs = res[label]["runs"]
        ms = median([1000 * r["cpu_s"] / n for r in runs])
        dur = median([r["duration_s"] for r in runs])
        wall = median([r["wall_s"] for r in runs])
        srv = median([1000 * r["server_cpu_s"] / n for r in runs])
        fixed = res[label]["fixed_n1"]
        fixed_cpu = median([r["cpu_s"] for r in fixed])
        fixed_dur = median([r["duration_s"] for r in fixed])
        per[label] = (ms, dur, fixed_cpu)
        net = (median([r["cpu_s"] for r in runs]) - fixed_cpu) * 1000 / n if fixed_cpu is not None else None
        kt = median([r.get("kthreads_cpu_s") for r in runs])
        fo = median([r.get("foreign_cpu_s") for r in runs])
        note = (f"runs {len(runs)} (range {spread([1000 * r['cpu_s'] / n for r in runs])} ms); "
                f"machine CPU outside the CLI and the server {_fmt(1000 * fo / n if fo is not None else None, 1)} ms/prompt"
                + (f" (kernel threads {1000 * kt / n:.1f})" if kt is not None else "") + "; "
                f"fixed cost of one invocation (N=1): {_fmt(fixed_cpu, 2)} CPU-s, {_fmt(fixed_dur, 2)} s wall; "
                f"per prompt without it {_fmt(net, 2)} ms; server {_fmt(srv, 2)} ms/prompt (not included)")
        rate = n / dur if dur else None
        if label == "no_tools":  # one API call per prompt: the runner's CPU per call, the invocation's start-up apart
            rows.append(Row("overhead", f"{cfg}, no tools (1 API call per prompt), net of one invocation's start-up",
                            f"{_fmt(net)} ms CPU/call", "<= 1.0 ms", _verdict(net <= 1.0 if net is not None else None),
                            f"with the start-up {_fmt(ms)} ms CPU/call; " + note))
            rows.append(Row("overhead", f"{cfg}, no tools", f"{_fmt(dur)} s wall ({_fmt(rate, 0)} prompts/s)",
                            "", "info", f"subprocess wall {_fmt(wall)} s"))
        else:
            rows.append(Row("overhead", f"{cfg}, 1 terminal call (bwrap)", f"{_fmt(ms)} ms CPU/prompt", "", "info", note))
            rows.append(Row("overhead", f"{cfg}, 1 terminal call (bwrap)", f"{_fmt(rate, 0)} prompts/s ({_fmt(dur)} s)",
                            ">= 300 prompts/s", _verdict(rate >= 300 if rate is not None else None),
                            f"subprocess wall {_fmt(wall)} s"))
    if "no_tools" in per and "terminal" in per and per["no_tools"][0] is not None:
        d_ms = per["terminal"][0] - per["no_tools"][0]
        d_s = (per["terminal"][1] or 0) - (per["no_tools"][1] or 0)
        rows.append(Row("overhead", "sandbox share (terminal - no tools)",
                        f"{_fmt(d_ms)} ms CPU/prompt ({100 * d_ms / per['terminal'][0]:.0f}% of CPU)", "", "info",
                        f"+{_fmt(d_s)} s wall for {n:,} prompts; the second API call adds part of this too"))
    return rows


def rows_scale(res: dict) -> list[Row]:
    rows = []
    sizes = res["sizes"]
    cfg = f"latency 0, no tools, --num_workers={res['workers']} --concurrency={res['concurrency']}"
    firsts = {}
    for n_str, entry in sizes.items():
        n = int(n_str)
        r = entry["run"]
        firsts[n] = r
        for role, key in (("parent", "parent_rss_mb"), ("one worker (max)", "worker_rss_mb")):
            v = r[key]
            rows.append(Row("scale", f"N={n:,} {cfg}: peak RSS {role}", f"{_fmt(v, 0)} MB", "< 300 MB",
                            _verdict(v < 300 if v is not None else None),
                            f"VmHWM polled every 0.2 s; run {_fmt(r['duration_s'], 1)} s, exit {r['returncode']}, "
                            f"ok {r['ok']:,}" if r["ok"] is not None else "no statistics"))
        rs = entry["resume"]
        rwall = median([x["wall_s"] for x in rs])
        rdur = median([x["duration_s"] for x in rs])
        target = "< 5 s" if n >= 100_000 else ""
        rows.append(Row("scale", f"N={n:,}: --resume of the finished run", f"{_fmt(rwall)} s wall",
                        target, _verdict(rwall < 5 if (target and rwall is not None) else None),
                        f"CLI duration_seconds {_fmt(rdur)} s; parent peak {_fmt(median([x['parent_rss_mb'] for x in rs]), 0)} MB; "
                        f"runs {len(rs)}; it scans, plans nothing, forks 1 worker, merges"))
        d = entry["direct"]
        rows.append(Row("scale", f"N={n:,}: merge (trajgen.merge.merge, called directly)",
                        f"{_fmt(median([x['merge_s'] for x in d]))} s", "", "info",
                        f"the CLI does not time its merge separately; resume scan (resume_scan.scan) "
                        f"{_fmt(median([x['scan_s'] for x in d]))} s; run dir {entry['disk_mb']} MB"))
    if len(firsts) >= 2:
        lo, hi = min(firsts), max(firsts)
        for role, key in (("parent", "parent_rss_mb"), ("worker", "worker_rss_mb")):
            a, b = firsts[lo][key], firsts[hi][key]
            if a and b:
                rows.append(Row("scale", f"peak RSS growth {role}, N={lo:,} -> {hi:,}", f"x{b / a:.2f} (+{b - a:.0f} MB)",
                                "flat (<= x1.2)", _verdict(b / a <= 1.2), ""))
    return rows


def rows_sandbox(res: dict) -> list[Row]:
    rows = []
    labels = {"plain": "unsafe_local: prlimit + bash, no bubblewrap",
              "fresh": "a prompt's first command (sandbox opened, started, closed)",
              "fresh-with-network": "the same without --unshare-net",
              "same": "a command after the first in a prompt's running sandbox"}
    for key, runs in res["runs"].items():
        variant, conc = key.split("@")
        per_s = median([r["per_s"] for r in runs])
        ours = median([r["cpu_ms"] + r.get("kthreads_ms", 0) for r in runs])
        target, verdict = ("<= 2 ms CPU/command", _verdict(ours <= 2)) if variant == "same" else ("", "info")
        rows.append(Row("sandbox", f"{labels.get(variant, variant)}, {conc} command(s) in flight, `echo hi`",
                        f"{_fmt(per_s, 0)} commands/s, {_fmt(ours, 1)} ms CPU/command", target, verdict,
                        f"latency p50 {_fmt(1000 * median([r['p50_s'] for r in runs]), 0)} ms, p95 "
                        f"{_fmt(1000 * median([r['p95_s'] for r in runs]), 0)} ms; CPU "
                        f"{_fmt(median([r['cpu_ms'] for r in runs]), 1)} ms/command in our processes, "
                        f"{_fmt(median([r['machine_cpu_ms'] for r in runs]), 1)} ms machine-wide, of which kernel threads "
                        f"{_fmt(median([r.get('kthreads_ms') for r in runs]), 1)} ms (the CPU figure: ours plus kernel threads; "
                        f"machine-wide counts everyone else's jobs on a shared machine); runs {len(runs)}"))
    return rows


KEY_FRAMES = (  # inclusive shares worth a line in the report
    "httpcore/_async/connection_pool.py:AsyncConnectionPool._assign_requests_to_connections",
    "subprocess.py:Popen._execute_child",
    "shutil.py:rmtree",
    "aiohttp/client.py:ClientSession._request",
    "trajgen/store.py:Writer._sync_loop",
    "httpcore/_async/http11.py:AsyncHTTP11Connection.has_expired",
    "anyio/abc/_sockets.py:_SocketProvider.extra_attributes",
    "httpx/_client.py:AsyncClient.send",
    "openai/_base_client.py:AsyncAPIClient.request",
    "openai/_utils/_transform.py:async_transform",
    "trajgen/sandbox/local.py:run_process",
    "trajgen/sandbox/backends.py:open_sandbox",
    "trajgen/sandbox/local.py:LocalSandbox.close",
    "trajgen/store.py:atomic_write",
    "trajgen/store.py:Writer.end_batch",
    "batch_runner.py:_execute.<locals>.checkpoint",
    "trajgen/process_pool.py:ProcessPool.poll",
    "rich/live.py:Live.refresh",
)


def key_frames(summary_role: dict) -> list[tuple[str, float]]:
    incl = dict(summary_role["top_inclusive"])
    return [(k, incl[k]) for k in KEY_FRAMES if k in incl]


def rows_profile(res: dict) -> list[Row]:
    rows = []
    s = res.get("summary", {})
    for role in ("worker", "parent"):
        if role not in s:
            continue
        r = s[role]
        pk = ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["self_by_package"][:5])
        frames = "; ".join(f"{k.split(':', 1)[1]} {100 * v:.0f}%" for k, v in key_frames(r)[:6])
        rows.append(Row("profile", f"{res['workers']}x{res['concurrency']} N={res['n']:,} under py-spy: {role} "
                                   f"({r['processes']} process{'es' if r['processes'] > 1 else ''})",
                        f"main thread busy {_fmt(100 * r['main_thread_busy'] if r['main_thread_busy'] is not None else None, 0)}%",
                        "", "info", f"self time: {pk}. Inclusive: {frames}. Files: {res['raw']['file']}, "
                                    f"{res['flamegraph']['file']}"))
    return rows


ROW_BUILDERS = {"throughput": rows_throughput, "realistic": rows_realistic, "overhead": rows_overhead,
                "scale": rows_scale, "diag": rows_diag, "pool": rows_pool, "sandbox": rows_sandbox,
                "profile": rows_profile, "versus": rows_versus}


def section_order(results: dict) -> list[str]:
    """Keys of results.json in report order: `name` or `name:tag` (a run of another tree)."""
    order = list(ROW_BUILDERS)
    return sorted(results, key=lambda k: (order.index(k.split(":")[0]) if k.split(":")[0] in order else 99, k))


def build_rows(results: dict) -> list[Row]:
    rows: list[Row] = []
    for key in section_order(results):
        name, _, tag = key.partition(":")
        if name not in ROW_BUILDERS:
            continue
        for row in ROW_BUILDERS[name](results[key]["data"]):
            if tag:
                row.section = f"{row.section} [{tag}]"
            rows.append(row)
    return rows


def print_table(rows: list[Row]) -> None:
    table = Table(title=f"batch_runner benchmark ({MACHINE})", show_lines=True)
    for col in ("section", "configuration", "measured (median)", "target", "pass/fail", "details"):
        table.add_column(col, overflow="fold")
    colors = {"PASS": "green", "FAIL": "red", "info": "dim"}
    for r in rows:
        table.add_row(r.section, r.config, r.value, r.target, f"[{colors[r.verdict]}]{r.verdict}[/]", r.note)
    console.print(table)


def findings(results: dict) -> list[str]:
    """Data-driven sentences; the hand-written analysis lives between the notes markers."""
    out = _throughput_findings(results)
    out += _overhead_findings(results.get("overhead", {}).get("data"))
    sc = results.get("scale", {}).get("data")
    if sc:
        for n_str, e in sc["sizes"].items():
            r = e["run"]
            out.append(f"Scale N={int(n_str):,}: parent peak {_fmt(r['parent_rss_mb'], 0)} MB, worker peak "
                       f"{_fmt(r['worker_rss_mb'], 0)} MB, run {_fmt(r['duration_s'], 1)} s; resume "
                       f"{_fmt(median([x['wall_s'] for x in e['resume']]))} s; merge "
                       f"{_fmt(median([x['merge_s'] for x in e['direct']]))} s.")
    pool = results.get("pool", {}).get("data")
    if pool:
        ms = {k: median([r["cpu_ms_per_request"] for r in v]) for k, v in pool["runs"].items()}
        if ms.get("httpx@128"):
            out.append(f"HTTP client alone, one process, CPU per request at 128 / 32 requests in flight: "
                       f"httpx (trajgen/chat_calls.py before d607319) {_fmt(ms.get('httpx@128'))} / {_fmt(ms.get('httpx@32'))} ms, "
                       f"httpx2 (the SDK's default) {_fmt(ms.get('httpx2@128'))} / {_fmt(ms.get('httpx2@32'))} ms, "
                       f"aiohttp (trajgen/chat_calls.py's from d607319 until trajgen/transport.py) {_fmt(ms.get('aiohttp@128'))} / {_fmt(ms.get('aiohttp@32'))} ms.")
    prof = results.get("profile", {}).get("data", {}).get("summary", {})
    if "worker" in prof:
        w = prof["worker"]
        frames = ", ".join(f"`{k}` {100 * v:.0f}%" for k, v in key_frames(w)[:4])
        out.append(f"Profile (py-spy): the workers' event loops were busy {100 * (w['main_thread_busy'] or 0):.0f}% of "
                   f"the time; of their busy samples: {frames}.")
    return out


def _throughput_findings(results: dict) -> list[str]:
    out = []
    for section in ("throughput", "realistic", "diag"):
        tp = results.get(section, {}).get("data")
        for key, runs in (tp or {}).get("configs", {}).items():
            eff = median([r["efficiency"] for r in runs])
            dur = median([r["duration_s"] for r in runs])
            cpu = median([r["cpu_s"] + r["server_cpu_s"] for r in runs])
            mb = median([r.get("machine_busy") for r in runs])
            if dur and cpu:
                out.append(f"{section.capitalize()} {key} (workers x concurrency{'' if runs[0].get('tools', True) else ', no tool'}): "
                           f"efficiency {_fmt(eff)}, {_fmt(dur, 1)} s for an ideal of {runs[0]['ideal_s']:.1f} s; "
                           f"the CLI and the server used {cpu / dur:.2f} of the 2 cores by getrusage"
                           + (f", the whole machine was {100 * mb:.0f}% busy." if mb is not None else "."))
    return out


def _overhead_findings(ov: dict | None) -> list[str]:
    if not ov or "no_tools" not in ov:
        return []
    n = ov["n"]

    def per_prompt(label):
        runs = ov[label]["runs"]
        ours = median([1000 * r["cpu_s"] / n for r in runs])
        machine = median([1000 * (r["cpu_s"] + r["server_cpu_s"] + (r.get("foreign_cpu_s") or 0)) / n for r in runs])
        rate = median([n / r["duration_s"] for r in runs if r["duration_s"]])
        return ours, machine, rate

    ms, mm, rate = per_prompt("no_tools")
    out = [f"Overhead without tools (latency 0): {_fmt(ms)} ms of CPU per prompt in the CLI and its children "
           f"(getrusage), {_fmt(mm)} ms for the whole machine; {_fmt(rate, 0)} prompts/s."]
    if "terminal" in ov:
        ms2, mm2, rate2 = per_prompt("terminal")
        out.append(f"With one terminal call in bubblewrap: {_fmt(ms2)} ms per prompt by getrusage but {_fmt(mm2)} ms "
                   f"for the whole machine (kernel work of the sandbox is charged to no process of ours); at "
                   f"latency 0 the box does {_fmt(rate2, 0)} such prompts/s, which caps any run of this workload here: "
                   f"--concurrency=64 at 0.5 s per prompt asks for 128/s, --concurrency=256 for 512/s.")
    return out


STANDALONE = ((viewer.START, viewer.END), (ray_scale.START, ray_scale.END), (reference.START, reference.END))


def write_markdown(results: dict, rows: list[Row]) -> None:
    old_notes, kept = "", []
    if harness.RESULTS_MD.exists():
        text = harness.RESULTS_MD.read_text()
        if NOTES_START in text and NOTES_END in text:
            old_notes = text.split(NOTES_START, 1)[1].split(NOTES_END, 1)[0].strip("\n")
        for start, end in STANDALONE:  # the sections of the standalone benchmarks, which this run does not measure
            if start in text and end in text:
                kept.append(start + text.split(start, 1)[1].split(end, 1)[0] + end)
    date = subprocess.run(["date", "-u", "+%F"], capture_output=True, text=True).stdout.strip()
    lines = [
        "# batch_runner benchmark results",
        "",
        f"Machine: {MACHINE} (noisy; medians of repeated runs). Date: {date}. Python {sys.version.split()[0]}.",
        "",
        "Commands (per section, the latest run of each):",
        "",
    ]
    for key in section_order(results):
        r = results[key]
        lines.append(f"- {key} ({r['date']}, repeats {r['repeats']}, runner at {r.get('git_head', '?')}, "
                     f"sources {', '.join(r.get('code', [])) or '?'}): `{r['command']}`")
    lines += [
        "",
        "The CLI runs as `python batch_runner.py --dataset_file=... --run_name=... --output_dir=bench/out/runs "
        "--base_url=<scripted server> --api_key=dummy --model=bench --require_reasoning=False "
        "--distribution=terminal_only --num_workers=W --concurrency=C` (`--distribution=minimal` where a "
        "row says no tools or no sandbox: a prompt offered the terminal starts its sandbox during its first call) against "
        "`python -m tests.support.scripted_server --script FILE --latency L` (both on 127.0.0.1).",
        "",
        "| section | configuration | measured (median) | target | pass/fail | details |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r.section, r.config, r.value, r.target, f"**{r.verdict}**" if r.verdict != "info" else "info", r.note]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", "## Findings", ""]
    lines += [f"- {s}" for s in findings(results)]
    for key in section_order(results):
        if key.split(":")[0] == "profile" and results[key]["data"].get("summary"):
            lines += _profile_lines(key, results[key])
    lines += ["", "## Analysis", "", NOTES_START, old_notes or "(no notes yet)", NOTES_END, ""]
    for section in kept:
        lines += [section, ""]
    harness.RESULTS_MD.write_text("\n".join(lines))


def _profile_lines(key: str, result: dict) -> list[str]:
    """RESULTS.md's section of one profile: busy shares by package and frame, per process role."""
    lines: list[str] = []
    d = result["data"]
    prof = d["summary"]
    tag = key.partition(":")[2]
    lines += ["", f"## Profile{f' [{tag}]' if tag else ''} — runner at {result.get('git_head', '?')}, {d['workers']}x{d['concurrency']}, "
                  f"N={d['n']:,} (py-spy record --subprocesses --threads --idle; shares of busy samples)", "",
              "Busy = samples whose leaf frame is not a thread blocked in a system call (epoll wait, idle "
              "thread-pool threads, waitpid, the pipe reader). Files: "
              f"`{d['raw']['file']}` (collapsed stacks), `{d['flamegraph']['file']}`.", ""]
    for role in ("worker", "parent"):
        if role not in prof:
            continue
        r = prof[role]
        lines.append(f"**{role}** ({r['processes']} process(es), {r['samples']} samples, {r['busy_samples']} busy; "
                     f"main thread busy {100 * (r['main_thread_busy'] or 0):.0f}%)")
        lines.append("")
        lines.append("- self time by package: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["self_by_package"][:8]))
        lines.append("- key frames (inclusive): " + "; ".join(f"`{k}` {100 * v:.0f}%" for k, v in key_frames(r)))
        lines.append("- top self frames: " + "; ".join(f"`{k}` {100 * v:.1f}%" for k, v in r["top_self"][:10]))
        lines.append("")
    return lines
