"""The run directory. Only the parent process writes here, and only through this module.

Files: batch_<N>.jsonl (ok rows), discarded.jsonl and failures.jsonl (side records),
journal.jsonl (the replies of prompts not yet landed, trajgen/journal.py), manifest.json (the
run's settings), checkpoint.json (progress), statistics.json and trajectories.jsonl (the merge).
Rows are appended as whole lines with one write and fsynced per batch; the JSON files are
replaced atomically. Resume trusts the rows, not the checkpoint. Every append starts on a fresh
line, so a line torn by a kill or a full disk never swallows the next record; a full disk stops
the run with DiskFull and the rows already written kept.
"""
from __future__ import annotations

import errno
import os
import queue
import re
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import orjson

from trajgen import locks
from trajgen.errors import DiskFull, UsageError

BATCH_FILE = re.compile(r"batch_(\d+)\.jsonl$")
ROW_START = re.compile(rb'\{"prompt_index":\d+,"metadata":\{"prompt_key":"([^"\\]+)"')  # as agent.py writes a row
DISCARDED = "discarded.jsonl"
FAILURES = "failures.jsonl"
CHECKPOINT = "checkpoint.json"
JOURNAL = "journal.jsonl"
READ_BUFFER = 1 << 20  # rows are kilobytes each: with the default 8 KB buffer, reading a line took a read() of its own
CHECKPOINT_SECONDS = 1.0  # between two checkpoints: each costs 0.3 ms of CPU, and a fast run ends many batches a second
COMPACT_AT = 1 << 18  # journal bytes before the first compaction; after it, twice what the last one left
LOCK = ".runner.lock"
REPAIR = {  # what to do about an unreadable JSON file of the run directory
    "manifest.json": "pass --resume --force to write it again with this run's settings",
    CHECKPOINT: "it is rebuilt from the rows (earlier runs' durations are not counted)",
    "statistics.json": "--resume rebuilds it from the rows",
}


class UnreadableFile(UsageError):
    """A JSON file of the run directory is empty or garbage (a full disk, an editor, a crash)."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path} is unreadable ({reason}): {REPAIR.get(path.name, 'delete it')}")


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn "no space left" while writing `path` into DiskFull naming it."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(path) from e
        raise


def lock_run_dir(run_dir: Path) -> None:
    """One runner per run directory. Held until this process exits: the kernel then releases it,
    so neither a crash nor kill -9 leaves a stale lock."""
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        with writing(run_dir / LOCK):
            locks.acquire(run_dir / LOCK)
    except locks.LockHeld as e:
        raise UsageError(f"{run_dir} is in use by another runner (pid {e.holder or 'unknown'}); "
                         "wait for it to finish or stop it, then try again") from None


def entries(run_dir: Path) -> list[Path]:
    """What the run directory holds, apart from its lock."""
    return [p for p in run_dir.iterdir() if p.name != LOCK] if run_dir.exists() else []


def atomic_write(path: Path, data: bytes) -> None:
    """Temp file in the same directory, fsync, rename: readers see the old file or the new one."""
    with writing(path):
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
    """The JSON object in `path`; anything else is an UnreadableFile that says what to do."""
    data = path.read_bytes()
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise UnreadableFile(path, "empty" if not data.strip() else f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise UnreadableFile(path, "not a JSON object")
    return obj


def read_checkpoint(run_dir: Path) -> dict:
    """The checkpoint, or {} when there is none or it is unreadable (scan names that at the start)."""
    try:
        return read_json(run_dir / CHECKPOINT)
    except (FileNotFoundError, UnreadableFile):
        return {}


def batch_files(run_dir: Path) -> list[tuple[int, Path]]:
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := BATCH_FILE.match(p.name))]
    return sorted(found)


def read_lines(path: Path, torn: list[str]) -> Iterator[tuple[bytes, dict]]:
    """Whole, parseable lines only, each with its record; a torn line (a kill mid-write) is
    reported in `torn`, never returned."""
    if not path.exists():
        return
    with open(path, "rb", buffering=READ_BUFFER) as f:
        for number, raw in enumerate(f, 1):
            if (record := _parse(raw, path, number, torn)) is not None:
                yield raw, record


def read_records(path: Path, torn: list[str]) -> Iterator[dict]:
    return (record for _, record in read_lines(path, torn))


def _parse(raw: bytes, path: Path, number: int, torn: list[str]) -> dict | None:
    if raw == b"\n":  # the fresh line started after a torn one
        return None
    try:
        if not raw.endswith(b"\n"):
            raise ValueError("no line end")
        record = orjson.loads(raw)
    except ValueError:
        torn.append(f"{path.name}:{number}")
        return None
    return record if isinstance(record, dict) else None


def _row_keys(path: Path, torn: list[str], settled: bool) -> Iterator[str]:
    """The keys of a batch file's rows. A settled file (fsynced, then listed by a checkpoint
    written after its last change) holds whole lines written by this module, so a line that
    starts and ends as a row does is not parsed: parsing 5 KB rows was most of a resume's scan."""
    with open(path, "rb", buffering=READ_BUFFER) as f:
        for number, raw in enumerate(f, 1):
            if settled and (start := ROW_START.match(raw)) and raw.endswith(b"}\n"):
                yield start.group(1).decode()
            elif (row := _parse(raw, path, number, torn)) is not None and (key := row_key(row)):
                yield key


@dataclass
class Scan:
    """What the run directory already holds: the keys with a final record, and where to go on."""

    done: set[str] = field(default_factory=set)
    next_batch: int = 0
    torn: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # damaged or missing files, said at the start
    journal: dict[str, list[dict]] = field(default_factory=dict)  # prompt key -> its journaled replies, if not done


def row_key(row: dict) -> str | None:
    metadata = row.get("metadata")
    key = metadata.get("prompt_key") if isinstance(metadata, dict) else None
    return key if isinstance(key, str) else None


def settled(run_dir: Path) -> set[int]:
    """The batch files a checkpoint lists as fsynced and that have not changed since it was written."""
    listed, written = set(read_checkpoint(run_dir).get("batch_files", [])), _mtime(run_dir / CHECKPOINT)
    return {number for number, path in batch_files(run_dir) if number in listed and _mtime(path) <= written}


def row_keys(run_dir: Path, torn: list[str]) -> Iterator[str]:
    """The keys of every row of every batch file, in file order."""
    trusted = settled(run_dir)
    for number, path in batch_files(run_dir):
        yield from _row_keys(path, torn, number in trusted)


def scan(run_dir: Path) -> Scan:
    result = Scan()
    result.done.update(row_keys(run_dir, result.torn))
    present = {number for number, _ in batch_files(run_dir)}
    result.next_batch = max(present, default=-1) + 1
    for record in read_records(run_dir / DISCARDED, result.torn):
        if isinstance(record.get("prompt_key"), str):
            result.done.add(record["prompt_key"])
    unreadable: list[str] = []
    for entry in read_records(run_dir / JOURNAL, unreadable):
        if not _journal_entry(entry):
            unreadable.append(JOURNAL)
        elif entry["key"] not in result.done:
            result.journal.setdefault(entry["key"], []).append(entry)
    if unreadable:
        result.notes.append(f"{JOURNAL} has {len(unreadable)} unreadable line(s) (a kill mid-write, or damage): "
                            "the replies they held will be asked for, and paid for, again")
    for name in (CHECKPOINT, "statistics.json"):
        try:
            read_json(run_dir / name)
        except UnreadableFile as e:
            result.notes.append(str(e))
        except FileNotFoundError:
            pass
    missing = [f"batch_{n}.jsonl" for n in read_checkpoint(run_dir).get("batch_files", []) if n not in present]
    if missing:
        result.notes.append(f"{', '.join(missing)} written by an earlier run are gone: their prompts run again")
    return result


def _journal_entry(entry: dict) -> bool:
    """Whether a journal line is an entry that trajgen/journal.py can replay."""
    return (isinstance(entry.get("key"), str) and isinstance(entry.get("turn"), int)
            and isinstance(entry.get("hash"), str) and isinstance(entry.get("message"), dict)
            and isinstance(entry.get("usage"), dict))


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return -1


def _without(lines: bytes, landed: frozenset[str]) -> bytes:
    """The whole, parseable journal lines of `lines` whose prompt has not landed."""
    kept = []
    for line in lines.splitlines(keepends=True):
        try:
            entry = orjson.loads(line) if line.endswith(b"\n") else None
        except orjson.JSONDecodeError:
            continue
        if isinstance(entry, dict) and entry.get("key") not in landed:
            kept.append(line)
    return b"".join(kept)


class Writer:
    """Appends rows and side records as whole lines. Batch files are opened on their first row;
    when a batch ends, a background thread fsyncs and closes it and then writes the latest
    checkpoint, so the scheduler never waits on the disk. The checkpoint lists the batch files
    fsynced before it was written, so that resume can say which were deleted and read those it
    can trust for their keys only. The same thread compacts the journal: the entries
    of prompts that landed are dropped, so it holds only the replies of prompts in flight or failed."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.paths: dict[int, Path] = {}  # open file descriptor -> its file
        self.torn: set[int] = set()  # descriptors whose file may end in a torn line
        self.unsynced: set[int] = set()  # descriptors written since their last fsync
        # fsynced, and unchanged since: a crashed run's others never were, one edited by hand is no longer
        self.synced = settled(run_dir)
        self.batches: dict[int, int] = {}  # batch number -> open file descriptor
        self.side = {name: self._open(run_dir / name) for name in (DISCARDED, FAILURES)}
        self._jobs: queue.Queue = queue.Queue()
        self._checkpoint: dict | None = None  # the latest payload not yet written
        self._checkpointed = -CHECKPOINT_SECONDS  # when the last one was written (time.monotonic)
        self.journal_fd = self._open(run_dir / JOURNAL)
        self._journal_lock = threading.Lock()  # appends wait while a compaction swaps the file
        self.journaled: set[str] = set()  # prompts with entries in the journal (most that land have none)
        self.landed: set[str] = set()  # of those, the ones whose entries can go at the next compaction
        self._compacted_size = 0  # of the journal after the last compaction
        if os.fstat(self.journal_fd).st_size:  # an earlier run may have died before compacting it
            found = scan(run_dir)
            self.landed, self.journaled = found.done, set(found.journal)
            self._compact_later()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._sync_loop, name="fsync", daemon=True)
        self._thread.start()

    def _open(self, path: Path) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        size = os.fstat(fd).st_size
        self.torn.discard(fd)  # the number of a file closed earlier
        if size and os.pread(fd, 1, size - 1) != b"\n":
            self.torn.add(fd)
        self.paths[fd] = path
        return fd

    def _append(self, fd: int, record: dict | orjson.Fragment) -> None:
        if self._error:
            raise self._error
        data = (b"\n" if fd in self.torn else b"") + orjson.dumps(record) + b"\n"
        self.torn.add(fd)
        try:
            with writing(self.paths[fd]):
                while data:  # one write almost always; loop in case the kernel takes less
                    data = data[os.write(fd, data):]
        except DiskFull as e:  # the first full write is the one to report, whatever fails after it
            self._error = e
            raise
        self.torn.discard(fd)
        self.unsynced.add(fd)

    def row(self, batch_num: int, key: str, row: orjson.Fragment) -> None:  # serialised by the worker
        if batch_num not in self.batches:
            self.batches[batch_num] = self._open(self.run_dir / f"batch_{batch_num}.jsonl")
        self._append(self.batches[batch_num], row)
        self._landed(key)

    def user_files(self, files: dict[str, bytes]) -> None:
        """Files a prompt's tools made, by path relative to the run directory, which they must stay in."""
        for name, data in files.items():
            path = self.run_dir / name
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise ValueError(f"a tool's file {name!r} is not inside the run directory")
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, data)

    def discarded(self, record: dict) -> None:
        self._append(self.side[DISCARDED], record)
        self._landed(record["prompt_key"])

    def _landed(self, key: str) -> None:
        if key in self.journaled:
            self.landed.add(key)

    def journal(self, entry: dict) -> None:
        with self._journal_lock:
            self._append(self.journal_fd, entry)
        self.journaled.add(entry["key"])

    def _compact_later(self) -> None:
        """Queued after the rows of the landed prompts, so their entries go only once they are on disk."""
        if self.landed:
            self._jobs.put(("compact", frozenset(self.landed)))
            self.journaled -= self.landed
            self.landed = set()

    def _compact(self, landed: frozenset[str]) -> None:
        """Rewrite the journal without the landed prompts' entries. Appends wait only while the
        few lines added during the rewrite are copied and the file is swapped."""
        path = self.paths[self.journal_fd]
        with open(path, "rb") as f:
            data = f.read()
        done = data.rfind(b"\n") + 1  # whole lines only: an append may be under way
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with writing(path), os.fdopen(fd, "wb") as f:
                f.write(_without(data[:done], landed))
                f.flush()
                os.fsync(f.fileno())
                with self._journal_lock:
                    size = os.fstat(self.journal_fd).st_size
                    f.write(_without(os.pread(self.journal_fd, size - done, done), landed))
                    f.flush()
                    os.fsync(f.fileno())
                    os.replace(tmp, path)
                    self._compacted_size = f.tell()
                    old, self.journal_fd = self.journal_fd, self._open(path)
                    self.unsynced.discard(old)  # the new file is fsynced; the old one's number may be reused
                    os.close(old)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def failed(self, record: dict) -> None:
        self._append(self.side[FAILURES], record)

    def end_batch(self, batch_num: int) -> None:
        self._jobs.put((batch_num, self.batches.pop(batch_num, None)))
        with self._journal_lock:  # a compaction may be swapping the journal's descriptor
            size = os.fstat(self.journal_fd).st_size
        if size >= max(COMPACT_AT, 2 * self._compacted_size):
            self._compact_later()  # only once it doubled: compaction reads the whole journal

    def checkpoint(self, payload: dict) -> None:
        """Written after everything queued before it is on disk, at most once per CHECKPOINT_SECONDS;
        newer payloads replace older unwritten ones. An older checkpoint after a crash costs the
        resume only time: the files it does not list yet have their lines parsed."""
        with self._lock:
            queued = self._checkpoint is not None
            self._checkpoint = payload
        if not queued:
            self._jobs.put("checkpoint")

    def _checkpoint_due(self) -> float | None:
        """Seconds until the waiting checkpoint may be written; None when none waits."""
        if self._checkpoint is None:
            return None
        return max(0.0, self._checkpointed + CHECKPOINT_SECONDS - time.monotonic())

    def _sync_loop(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._checkpoint_due())
            except queue.Empty:  # the waiting checkpoint is due
                job = "checkpoint"
            if job == "stop":
                return
            try:
                if job == "checkpoint":
                    if self._checkpoint_due():
                        continue  # written when due: the queue's timeout
                    with self._lock:
                        payload, self._checkpoint = self._checkpoint, None
                    self._write_checkpoint(payload)
                    self._checkpointed = time.monotonic()
                elif job[0] == "compact":
                    self._compact(job[1])
                else:
                    for fd in (*self.side.values(), self.journal_fd):
                        if fd in self.unsynced:  # taken out first: a write meanwhile leaves it in again
                            self.unsynced.discard(fd)
                            with writing(self.paths[fd]):
                                os.fsync(fd)
                    batch_num, fd = job
                    if fd is not None:
                        self.unsynced.discard(fd)  # no more writes: the batch has ended
                        with writing(self.paths[fd]):
                            os.fsync(fd)
                        os.close(fd)
                        self.synced.add(batch_num)
            except BaseException as e:  # surfaced to the scheduler at its next write or at close
                self._error = self._error or e

    def _write_checkpoint(self, payload: dict) -> None:
        write_json(self.run_dir / CHECKPOINT, {**payload, "batch_files": sorted(self.synced)})

    def close(self, final_checkpoint: dict) -> None:
        """Flush everything; the final checkpoint is written last, after every batch is on disk
        (a checkpoint still queued may be ahead of the last batches)."""
        for batch_num in list(self.batches):
            self.end_batch(batch_num)
        self._compact_later()
        self._jobs.put((None, None))
        self._jobs.put("stop")
        self._thread.join()
        try:
            self._write_checkpoint(final_checkpoint)
        except BaseException as e:
            self._error = self._error or e
        for fd in (*self.side.values(), self.journal_fd):
            os.close(fd)
        self.side = {}
        if self._error:
            raise self._error
