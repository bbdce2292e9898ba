"""The runner's CPU per call with and without --token_ids, at 1,000-token completions (issue 48: at
most 10% more).

    python bench/token_ids.py [--prompts=200] [--repeats=3]

A vLLM-shaped loopback server (tests/support/token_servers.py, its own process) streams every
reply one token a chunk, as vLLM does: 1,000 chunks, each with its `token_ids` piece and its
`logprobs.content` entry when the run asks for them, at 1,000 tokens a second (--pace; a real
server is slower still), so that both arms read the stream in the same pieces whatever the
server's own CPU. Each prompt is one call. A third arm runs without the flag against a server that
sends the ids all the same: what their bytes cost a runner that does not read them, the floor of
any reading. The runs alternate (without, ids sent but not read, with) so that the machine's load
spreads over them; CPU is getrusage of the CLI and all
its descendants (the fork server and its workers adopted: bench/harness.py), net of one
invocation's fixed cost measured the same way with one prompt. Prints the figures; the section
between `<!-- token-ids -->` and `<!-- /token-ids -->` of bench/RESULTS.md is written by hand.
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import harness  # noqa: E402
from harness import (CHILDREN, OUT, ROOT, _drop, _env, _fresh, _readline_with_timeout, cli_argv, dataset,  # noqa: E402
                     run_cli, say)

TOKENS = 1000
harness.QUIET["max_wait"] = 10.0  # eight jobs share this machine: it is never quiet for long
WITHOUT, SENT, WITH = "without", "ids sent, not read", "with --token_ids"
ARMS = {WITHOUT: (), SENT: (), WITH: ("--token_ids",)}  # SENT: against a server that sends the ids unasked


class TokenServer(harness.Server):
    """harness.Server's process, serving ids as vLLM does instead of a script."""

    def __init__(self, tokens: int, pace: float, always_ids: bool = False):
        self.tokens, self.pace, self.always_ids = tokens, pace, always_ids
        OUT.mkdir(parents=True, exist_ok=True)
        self.log = open(OUT / "server-token-ids.log", "ab")
        self.restarts = 0
        self.start()

    def start(self) -> None:
        self.proc = CHILDREN.start([sys.executable, "-m", "tests.support.token_servers", "--kind=vllm",
                                    f"--tokens={self.tokens}", f"--pace={self.pace}",
                                    *(["--always_ids"] if self.always_ids else [])],
                                   cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log, env=_env())
        line = _readline_with_timeout(self.proc, 30)
        if not line.startswith("READY http://127.0.0.1:"):
            CHILDREN.stop(self.proc)
            raise RuntimeError(f"token server did not start: {line!r}")
        self.url = line.split(" ", 1)[1].strip()


def call_path(urls: dict[str, str], rounds: int, calls: int) -> dict[str, list[float]]:
    """CPU (this process's) per call of the chat call alone, Endpoint.call and the reply's check, in
    rounds alternating without and with the ids: the part of the runner the ids change, with less of
    the noise a whole run on a shared machine has."""
    import asyncio
    import time

    from trajgen import chat_calls, token_ids
    from trajgen.model import checked
    from trajgen.task import ModelSettings

    plain = {arm: ModelSettings(model="bench", base_url=url, api_key="dummy") for arm, url in urls.items()}
    settings = {**plain, WITH: replace(plain[WITH], token_ids=token_ids.Dialect(token_ids.VLLM))}
    messages = [{"role": "user", "content": "bench prompt: say done"}]

    async def one(endpoint: chat_calls.Endpoint, body: bytes) -> None:
        completion = await endpoint.call(body)
        reply = checked(completion.message, {})
        if endpoint.settings.token_ids:
            token_ids.checked(completion.tokens, reply.usage)

    async def measure(settings: ModelSettings) -> float:
        endpoint = chat_calls.Endpoint(settings, connections=calls)
        body = chat_calls.request_body(settings, chat_calls.request_args(settings, messages, None))
        await asyncio.gather(*(one(endpoint, body) for _ in range(calls)))  # the connections opened
        started = time.process_time()
        await asyncio.gather(*(one(endpoint, body) for _ in range(calls)))  # in flight together, as in a run
        await endpoint.close()
        return 1000 * (time.process_time() - started) / calls

    found: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for _ in range(rounds):
        for arm in ARMS:
            found[arm].append(asyncio.run(measure(settings[arm])))
    return found


def _change(figures: dict[str, float], arm: str) -> str:
    return f"{100 * (figures[arm] / figures[WITHOUT] - 1):+.1f}%"


def whole_runs(servers: dict[str, TokenServer], n: int, repeats: int) -> None:
    """Whole CLI runs of `n` prompts per arm, `repeats` times, arms alternating."""
    data, one = dataset(n), dataset(1)
    cpu: dict[str, list[float]] = {arm: [] for arm in ARMS}  # ms per call, net of the fixed cost
    server_cpu: dict[str, list[float]] = {arm: [] for arm in ARMS}
    busy: list[float] = []
    for rep in range(repeats):
        for arm, flags in ARMS.items():
            server, runs = servers[arm], {}
            for size, prompts in ((1, one), (n, data)):
                name = f"token-ids-{list(ARMS).index(arm)}-n{size}-r{rep}"
                _fresh(name)
                argv = cli_argv(prompts, name, server.url, 2, 16, flags=flags, sandbox=False)
                runs[size] = run_cli(argv, name, size, server, timeout=1800, sample_rss=False)
                _drop(name, harness.KEEP_RUNS)
            per_call = 1000 * (runs[n].cpu_s - runs[1].cpu_s) / (n - 1)
            cpu[arm].append(per_call)
            server_cpu[arm].append(1000 * runs[n].server_cpu_s / n)
            busy.append(runs[n].machine_busy or 0.0)
            say(f"{arm} r{rep}: {per_call:.2f} ms CPU/call (runner), server {server_cpu[arm][-1]:.2f} ms/call, "
                f"machine {100 * (runs[n].machine_busy or 0):.0f}% busy")
    medians = {arm: round(statistics.median(values), 2) for arm, values in cpu.items()}
    say(f"median runner CPU per call: {medians}: with --token_ids {_change(medians, WITH)} (target <= +10%), "
        f"ids sent, not read {_change(medians, SENT)}; per run {cpu}; server per call "
        f"{ {arm: round(statistics.median(v), 2) for arm, v in server_cpu.items()} }; machine busy "
        f"{min(busy):.0%}-{max(busy):.0%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20, help="rounds of the call path alone (0: skip it)")
    parser.add_argument("--pace", type=float, default=0.01,
                        help="seconds between each ten chunks (0.01: 1,000 tokens/s; 0: every chunk at once)")
    args = parser.parse_args()
    with TokenServer(TOKENS, args.pace) as asked, TokenServer(TOKENS, args.pace, always_ids=True) as unasked:
        servers = {WITHOUT: asked, SENT: unasked, WITH: asked}
        if args.rounds:
            alone = call_path({arm: server.url for arm, server in servers.items()}, args.rounds, 20)
            lows = {arm: round(min(v), 2) for arm, v in alone.items()}
            mids = {arm: round(statistics.median(v), 2) for arm, v in alone.items()}
            say(f"call path alone, CPU per call: min {lows}, median {mids}: with --token_ids "
                f"{_change(lows, WITH)} by the minimum, {_change(mids, WITH)} by the median; ids sent, not read "
                f"{_change(lows, SENT)} / {_change(mids, SENT)}")
        if args.repeats:
            whole_runs(servers, args.prompts, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
