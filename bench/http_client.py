#!/usr/bin/env python
"""The chat call's HTTP client alone: CPU per call and per streamed chunk, before and after, and httpx
against aiohttp; then the memory of workers that all receive a reply over --max_reply_mb at once.

    python bench/http_client.py                 # both parts, printed as Markdown tables
    python bench/http_client.py --part=cpu      # or --part=memory, --part=w2000

CPU is this process's own (time.process_time), the scripted server running as another process on
127.0.0.1, so its CPU is not counted. Each figure is the median of --repeats runs.
  per call     N=2000 non-streamed calls, 32 at once over a pool of 32 connections, each request
               the body a 3-turn conversation sends, each answer parsed into a Completion:
               trajgen/transport.py (the client before, from git 35a4771) with chat_calls.parse_completion;
               chat_calls.Endpoint (aiohttp, the client after) with --stream=False and with the default
               --stream and a one-chunk reply; httpx reading and parsing the same way.
  per chunk    8 streams of a 1,000-token reply sent as 1,000 chunks at once, each chunk its own write,
               1 ms apart, assembled by trajgen/stream.py: chat_calls.Endpoint (aiohttp), and httpx
               reading the same events; then chat_calls.Endpoint at a provider's pace, 32 streams at
               once of 100 and 30 chunks a second (300 and 100 chunks each); the same two over TLS (the
               server's, with a certificate made for the run that SSL_CERT_FILE trusts, as a user's CA).
  w2000        W(2000) at C=256 without a sandbox, before and after, in alternating pairs.
  memory       the CLI, --num_workers=4 --concurrency=4, 4 prompts, every reply 300 MB: a body of
               declared length, a chunked body, and one event that never ends; peak RSS (VmHWM)
               of each worker, read from /proc while the run lasts.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trajgen import chat_calls, stream  # noqa: E402
from trajgen.task import ModelSettings  # noqa: E402

BEFORE = "35a4771"  # the last commit with trajgen/transport.py
MESSAGES = [{"role": "system", "content": "You are a capable assistant. " * 20},
            {"role": "user", "content": "Compute something for me, step by step. " * 5},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "terminal", "arguments": json.dumps({"command": "echo hi"})}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "hi\n" * 20}]
REPLY = {"content": "The answer is 42.", "reasoning": "I ran the command and read its output.",
         "usage": {"prompt_tokens": 900, "completion_tokens": 40}}


def start_server(script: dict, tls: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """The scripted server in a process of its own (its CPU not counted); `tls`: ("--tls", CERT, KEY)."""
    path = Path(tempfile.mkdtemp()) / "script.json"
    path.write_text(json.dumps(script))
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.scripted_server", "--script", str(path), *tls], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = proc.stdout.readline()
    assert line.startswith("READY "), line
    return proc, line.split()[1]


def certificate() -> tuple[str, ...]:
    """A self-signed certificate for 127.0.0.1, trusted by the client the way a user trusts a CA of
    their own (SSL_CERT_FILE, read by chat_calls.trust()); the server's arguments to serve it."""
    folder = Path(tempfile.mkdtemp())
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(folder / "key.pem"),
                    "-out", str(folder / "cert.pem")], check=True, capture_output=True)
    os.environ["SSL_CERT_FILE"] = str(folder / "cert.pem")
    return "--tls", str(folder / "cert.pem"), str(folder / "key.pem")


def old_transport():
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE}:trajgen/transport.py"], capture_output=True,
                            check=True).stdout
    path = Path(tempfile.mkdtemp()) / "transport_before.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("transport_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["transport_before"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


async def _spread(n: int, width: int, one) -> None:
    queue = iter(range(n))

    async def lane():
        for i in queue:
            await one(i)

    await asyncio.gather(*(lane() for _ in range(width)))


def cpu_of(make, n: int, width: int) -> float:
    """Seconds of this process's CPU per call for `n` calls, `width` at once."""
    async def run():
        one, close = await make()
        await _spread(min(n, 64), width, one)  # warm: connections open, code paths taken
        start = time.process_time()
        await _spread(n, width, one)
        spent = time.process_time() - start
        await close()
        return spent / n
    return asyncio.run(run())


def clients(url: str, width: int, streamed_reply: bool) -> dict:
    settings = ModelSettings(model="m", base_url=url, api_key="k", max_retries=0, stream=streamed_reply)
    body = chat_calls.request_body(settings, chat_calls.request_args(settings, MESSAGES, None))
    chat_url = f"{url}/chat/completions"
    headers = {"Authorization": "Bearer k", "Content-Type": "application/json", "Accept": "application/json"}

    async def endpoint():
        made = chat_calls.Endpoint(settings, width)

        async def one(i):
            await made.call(body)
        return one, made.close

    async def httpx_client():
        import httpx
        client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(None, connect=10.0),
                                   limits=httpx.Limits(max_connections=width, max_keepalive_connections=width))

        async def one(i):
            async with client.stream("POST", chat_url, content=body) as response:
                if streamed_reply:
                    reader, assembly = stream.EventReader(), stream.Assembly()
                    async for piece in response.aiter_bytes():
                        for data in reader.feed(piece):
                            assembly.add(data)
                else:
                    chat_calls.parse_completion(await response.aread())
        return one, client.aclose

    async def before():
        transport = old_transport()
        client = transport.Client(chat_url, width)

        async def one(i):
            async with asyncio.timeout(600):
                response = await client.post(body, headers)
            chat_calls.parse_completion(response.body)

        async def close():
            client.close()
        return one, close

    after = {"aiohttp (chat_calls.Endpoint, after)": endpoint,
             f"httpx {importlib.metadata.version('httpx')} (same reading)": httpx_client}
    return after if streamed_reply else {f"transport.py ({BEFORE}, before)": before, **after}


def part_cpu(repeats: int) -> list[str]:
    lines = ["| what | client | CPU | runs |", "|---|---|---|---|"]
    proc, url = start_server({"default": [REPLY]})
    try:
        for label, streamed in (("per call, --stream=False", False), ("per call, streamed (one chunk)", True)):
            for name, make in clients(url, 32, streamed).items():
                if streamed and name.startswith("transport"):
                    continue
                runs = [cpu_of(make, 2000, 32) * 1e3 for _ in range(repeats)]
                lines.append(f"| {label} | {name} | {statistics.median(runs):.3f} ms | "
                             f"{', '.join(f'{r:.3f}' for r in runs)} |")
                print(lines[-1], flush=True)
    finally:
        proc.terminate()
        proc.wait()
    tls = certificate()
    for chunks, delay, width, label, server_args in ((1000, 0.001, 8, "1,000-chunk reply, 1 ms apart, 8 at once", ()),
                                                     (300, 0.01, 32, "100 chunks/s, 32 at once", ()),
                                                     (100, 0.033, 32, "30 chunks/s, 32 at once", ()),
                                                     (300, 0.01, 32, "100 chunks/s, 32 at once, TLS", tls),
                                                     (100, 0.033, 32, "30 chunks/s, 32 at once, TLS", tls)):
        proc, url = start_server({"default": [{"content": "t" * chunks, "pieces": 1, "chunk_delay": delay}]}, server_args)
        try:
            for name, make in clients(url, width, True).items():
                if name.startswith("httpx") and width != 8:
                    continue
                runs = [cpu_of(make, width, width) / chunks * 1e6 for _ in range(repeats)]
                lines.append(f"| per chunk, {label} | {name} | {statistics.median(runs):.1f} µs | "
                             f"{', '.join(f'{r:.1f}' for r in runs)} |")
                print(lines[-1], flush=True)
        finally:
            proc.terminate()
            proc.wait()
    return lines


async def _huge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, kind: str) -> None:
    """Answers every request with 300 MB, written 1 MB at a time until the client goes."""
    block = b"x" * (1 << 20)
    try:
        while True:
            await reader.readuntil(b"\r\n\r\n")  # the body follows; the client waits for nothing
            if kind == "length":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (300 << 20))
                writer.write(b'{"choices": [{"message": {"content": "')
            elif kind == "chunked":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                start = b'data: {"a": "'
                writer.write(b"%x\r\n%s\r\n" % (len(start), start))
            for _ in range(300):
                writer.write(block if kind == "length" else b"%x\r\n%s\r\n" % (len(block), block))
                await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


def part_memory() -> list[str]:
    lines = ["| 300 MB reply, 4 workers at once | workers' peak RSS (each) | prompts failed | the failure |", "|---|---|---|---|"]
    work = Path(tempfile.mkdtemp())
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(4)))
    for kind, flags in (("length", ["--stream=False"]), ("chunked", ["--stream=False"]), ("event", [])):
        loop = asyncio.new_event_loop()
        server = loop.run_until_complete(asyncio.start_server(lambda r, w: _huge(r, w, kind), "127.0.0.1", 0))
        port = server.sockets[0].getsockname()[1]
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        cli = subprocess.Popen([sys.executable, str(ROOT / "batch_runner.py"), "--dataset_file=prompts.jsonl",
                                f"--run_name={kind}", f"--base_url=http://127.0.0.1:{port}/v1", "--api_key=k",
                                "--num_workers=4", "--concurrency=4", "--distribution=terminal_only",
                                "--max_retries=0", *flags], cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
        peaks: dict[int, int] = {}
        servers: set[int] = set()  # the fork server (the workers are its children, with its command line)
        while cli.poll() is None:
            servers |= {int(c) for c in _children(cli.pid)}
            for child in _descendants(cli.pid):
                try:
                    status = Path(f"/proc/{child}/status").read_text()
                    cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"forkserver" in cmdline and child not in servers:
                    hwm = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM"))
                    peaks[child] = max(peaks.get(child, 0), hwm)
            time.sleep(0.05)
        stats = json.loads((work / "data" / kind / "statistics.json").read_text())
        failure = json.loads((work / "data" / kind / "failures.jsonl").read_text().splitlines()[0])
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        shown = ", ".join(f"{kb / 1024:.0f}" for kb in sorted(peaks.values()))
        lines.append(f"| {kind} ({' '.join(flags) or '--stream'}) | {shown} MB | {stats['failed']['total']} | "
                     f"{failure['error_class']}: {failure['message'][:90]} |")
        print(lines[-1], flush=True)
    return lines


def _children(pid: int) -> list[int]:
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(c) for c in children.read_text().split()]
        except OSError:
            pass
    return found


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for children in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                kids = [int(c) for c in children.read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def part_w2000(pairs: int) -> list[str]:
    """W(2000) at C=256 without a sandbox (bench/sections.py's diag configuration 2x256-notools),
    the tree before (git archive of BEFORE) and this one alternately, so each pair meets the same machine."""
    sys.path.insert(0, str(ROOT / "bench"))
    import harness
    import sections
    before = harness.OUT / "trees" / BEFORE
    if not (before / "batch_runner.py").exists():
        before.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", BEFORE], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
    lines = ["| pair | tree | duration | efficiency | runner CPU per call |", "|---|---|---|---|---|"]
    for pair in range(pairs):
        for label, root in (("before", before), ("after", ROOT)):
            harness.CLI_ROOT = root
            runs = sections._throughput_runs([(2, 256, False)], 2000, 1, f"w2000-{label}-{pair}")
            r = next(iter(runs.values()))[0]
            per_call = r["cpu_s"] / (2000 * r["calls"]) * 1e3
            lines.append(f"| {pair} | {label} | {r['duration_s']:.2f} s | {r['efficiency']:.3f} | {per_call:.2f} ms |")
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=("cpu", "memory", "w2000", "all"), default="all")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.part in ("cpu", "all"):
        print("\n".join(part_cpu(args.repeats)))
    if args.part in ("memory", "all"):
        print("\n".join(part_memory()))
    if args.part in ("w2000", "all"):
        print("\n".join(part_w2000(args.pairs)))


if __name__ == "__main__":
    main()
