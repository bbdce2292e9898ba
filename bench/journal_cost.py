"""What the journal costs per reply, in process: medians of repeated timings.

Worker side: hashing the request (canonical JSON of the whole body, sha256) at three
conversation sizes, and pickling the `Replied` message for the pipe. Parent side: appending
the entry to journal.jsonl, and compacting a journal of in-flight prompts at a batch end.

    python bench/journal_cost.py
"""
from __future__ import annotations

import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trajgen import journal, store  # noqa: E402
from trajgen.chat_calls import request_args  # noqa: E402
from trajgen.messages import Replied  # noqa: E402
from trajgen.model import Reply  # noqa: E402
from trajgen.task import ModelSettings  # noqa: E402

REPEATS = 7
SETTINGS = ModelSettings("bench", "http://127.0.0.1:1/v1", "dummy", temperature=0.7, system_prompt="You are helpful. " * 20)
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": "does a thing " * 10,
                                           "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
         for i in range(12)]
REPLY = Reply({"role": "assistant", "content": "Let me look. " * 40,
               "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "tool_1", "arguments": '{"x": "y"}'}}],
               "reasoning": "thinking " * 60}, {"prompt_tokens": 3000, "completion_tokens": 200, "cost": 0.001})


def conversation(turns: int, tool_output_bytes: int) -> list[dict]:
    messages = [{"role": "system", "content": SETTINGS.system_prompt}, {"role": "user", "content": "Do the task."}]
    for t in range(turns):
        messages.append({"role": "assistant", "content": "step", "tool_calls": REPLY.message["tool_calls"]})
        messages.append({"role": "tool", "tool_call_id": "call_1", "content": "o" * tool_output_bytes})
    return messages


def median_us(fn, n: int) -> float:
    """Median over REPEATS of the mean time of n calls, in microseconds."""
    samples = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(samples)


def main() -> None:
    rows = []
    for turns, out in ((1, 200), (10, 2000), (30, 8000)):
        messages = conversation(turns, out)
        size = len(journal.orjson.dumps(messages)) // 1024
        rows.append((f"worker: request hash, {turns} turns ({size} KB of messages)",
                     median_us(lambda: journal.request_hash(request_args(SETTINGS, messages, TOOLS, False)), 200)))
    replied = Replied("k" * 20, 3, "0" * 64, REPLY)
    rows.append(("worker: pickle the Replied message", median_us(lambda: pickle.dumps(replied), 2000)))
    with tempfile.TemporaryDirectory() as tmp:
        writer = store.Writer(Path(tmp))
        entry = journal.entry(replied)
        rows.append(("parent: append one entry to journal.jsonl", median_us(lambda: writer.journal(entry), 2000)))
        writer.close({})
    with tempfile.TemporaryDirectory() as tmp:
        writer = store.Writer(Path(tmp))
        for i in range(64 * 10):  # 64 prompts in flight, 10 replies each
            writer.journal({**entry, "key": f"k{i % 64}", "turn": i // 64})
        landed = frozenset(f"k{i}" for i in range(5))
        rows.append(("parent: compact 640 entries at a batch end (background thread)",
                     median_us(lambda: writer._compact(landed), 5)))
        writer.close({})
    print("| step | median per call |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} µs |")


if __name__ == "__main__":
    main()
