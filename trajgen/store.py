"""The run directory. Only the parent process writes here, and only through this module.

Files: batch_<N>.jsonl (ok rows), discarded.jsonl and failures.jsonl (side records),
manifest.json (the run's settings), checkpoint.json (progress), statistics.json and
trajectories.jsonl (the merge). Rows are appended as whole lines with one write and fsynced
per batch; the JSON files are replaced atomically. Resume trusts the rows, not the checkpoint.
"""
from __future__ import annotations

import os
import queue
import re
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import orjson

BATCH_FILE = re.compile(r"batch_(\d+)\.jsonl$")
DISCARDED = "discarded.jsonl"
FAILURES = "failures.jsonl"


def atomic_write(path: Path, data: bytes) -> None:
    """Temp file in the same directory, fsync, rename: readers see the old file or the new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json(path: Path, obj) -> None:
    atomic_write(path, orjson.dumps(obj, option=orjson.OPT_INDENT_2) + b"\n")


def read_json(path: Path):
    return orjson.loads(path.read_bytes())


def batch_files(run_dir: Path) -> list[tuple[int, Path]]:
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := BATCH_FILE.match(p.name))]
    return sorted(found)


def read_records(path: Path, torn: list[str]) -> Iterator[dict]:
    """Whole, parseable lines only; a torn line (a kill mid-write) is reported in `torn`, never returned."""
    if not path.exists():
        return
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                if not raw.endswith(b"\n"):
                    raise ValueError("no line end")
                record = orjson.loads(raw)
            except ValueError:
                torn.append(f"{path.name}:{number}")
                continue
            if isinstance(record, dict):
                yield record


@dataclass
class Scan:
    """What the run directory already holds: the keys with a final record, and where to go on."""

    done: set[str] = field(default_factory=set)
    next_batch: int = 0
    torn: list[str] = field(default_factory=list)


def row_key(row: dict) -> str | None:
    metadata = row.get("metadata")
    key = metadata.get("prompt_key") if isinstance(metadata, dict) else None
    return key if isinstance(key, str) else None


def scan(run_dir: Path) -> Scan:
    result = Scan()
    for number, path in batch_files(run_dir):
        result.next_batch = number + 1
        for row in read_records(path, result.torn):
            if key := row_key(row):
                result.done.add(key)
    for record in read_records(run_dir / DISCARDED, result.torn):
        if isinstance(record.get("prompt_key"), str):
            result.done.add(record["prompt_key"])
    return result


class Writer:
    """Appends rows and side records as whole lines. Batch files are opened on their first row;
    when a batch ends, a background thread fsyncs and closes it and then writes the latest
    checkpoint, so the scheduler never waits on the disk."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.batches: dict[int, int] = {}  # batch number -> open file descriptor
        self.side = {name: self._open(run_dir / name) for name in (DISCARDED, FAILURES)}
        self._jobs: queue.Queue = queue.Queue()
        self._checkpoint: dict | None = None  # the latest payload not yet written
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._sync_loop, name="fsync", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(path: Path) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def _append(self, fd: int, record: dict) -> None:
        if self._error:
            raise self._error
        data = orjson.dumps(record) + b"\n"
        while data:  # one write almost always; loop in case the kernel takes less
            data = data[os.write(fd, data):]

    def row(self, batch_num: int, row: dict) -> None:
        if batch_num not in self.batches:
            self.batches[batch_num] = self._open(self.run_dir / f"batch_{batch_num}.jsonl")
        self._append(self.batches[batch_num], row)

    def discarded(self, record: dict) -> None:
        self._append(self.side[DISCARDED], record)

    def failed(self, record: dict) -> None:
        self._append(self.side[FAILURES], record)

    def end_batch(self, batch_num: int) -> None:
        self._jobs.put(self.batches.pop(batch_num, None))

    def checkpoint(self, payload: dict) -> None:
        """Written after everything queued before it is on disk; newer payloads replace older unwritten ones."""
        with self._lock:
            queued = self._checkpoint is not None
            self._checkpoint = payload
        if not queued:
            self._jobs.put("checkpoint")

    def _sync_loop(self) -> None:
        while (job := self._jobs.get()) != "stop":
            try:
                if job == "checkpoint":
                    with self._lock:
                        payload, self._checkpoint = self._checkpoint, None
                    write_json(self.run_dir / "checkpoint.json", payload)
                else:
                    for fd in self.side.values():
                        os.fsync(fd)
                    if job is not None:
                        os.fsync(job)
                        os.close(job)
            except BaseException as e:  # surfaced to the scheduler at its next write or at close
                self._error = e

    def close(self, final_checkpoint: dict) -> None:
        """Flush everything; the final checkpoint is written last, after every batch is on disk."""
        for batch_num in list(self.batches):
            self.end_batch(batch_num)
        self._jobs.put(None)
        self.checkpoint(final_checkpoint)
        self._jobs.put("stop")
        self._thread.join()
        for fd in self.side.values():
            os.close(fd)
        self.side = {}
        if self._error:
            raise self._error
