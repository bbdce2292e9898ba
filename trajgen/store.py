"""The run directory. Only the parent process writes here, and only through this module.

Files: batch_<N>.jsonl (ok rows), discarded.jsonl and failures.jsonl (side records),
journal.jsonl (the replies of prompts not yet landed, trajgen/journal.py), manifest.json (the
run's settings), checkpoint.json (progress), statistics.json and trajectories.jsonl (the merge).
Rows are appended as whole lines with one write and fsynced per batch; the JSON files are
replaced atomically. Resume trusts the rows, not the checkpoint (resume_scan.py). Every append starts on a fresh
line, so a line torn by a kill or a full disk never swallows the next record; a full disk (DiskFull)
or a run directory turned read-only (ReadOnly) stops the run with the rows already written kept.
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
from pathlib import Path
from typing import Iterator

import orjson

from trajgen import locks
from trajgen.errors import DiskFull, ReadOnly, Unwritable, UsageError

BATCH_FILE = re.compile(r"batch_(\d+)\.jsonl$")
ROW_START = re.compile(rb'\{"prompt_index":\d+,"metadata":\{"prompt_key":"([^"\\]+)"')  # as encode_row starts a row
DISCARDED = "discarded.jsonl"
FAILURES = "failures.jsonl"
CHECKPOINT = "checkpoint.json"
JOURNAL = "journal.jsonl"
READ_BUFFER = 1 << 20  # rows are kilobytes each: the default 8 KB buffer would cost a read() per line
CHECKPOINT_SECONDS = 1.0  # between two checkpoints: each is a temp file, an fsync and a rename, and a fast run ends many batches a second
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
    """Turn "no space left" or "read-only" while writing `path` into DiskFull or ReadOnly naming it."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(path) from e
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise ReadOnly(path, e.strerror or str(e)) from e
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



def read_json_or_empty(path: Path) -> dict:
    """The JSON object in `path`, or {} when it is missing or unreadable: for readers that show what
    a run has, and must not stop on a file a crash left half-written."""
    try:
        return read_json(path)
    except (OSError, UnreadableFile):
        return {}

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


def encode_row(row: dict) -> bytes:
    """A row's line, which starts as ROW_START reads it back: prompt_index, then metadata with prompt_key first."""
    head = {"prompt_index": row["prompt_index"], "metadata": {"prompt_key": row["metadata"]["prompt_key"], **row["metadata"]}}
    return orjson.dumps({**head, **{k: v for k, v in row.items() if k not in head}})


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


def final_keys(run_dir: Path, torn: list[str]) -> set[str]:
    """The keys with a final record: a row in a batch file, or a discard."""
    done = set(row_keys(run_dir, torn))
    done.update(record["prompt_key"] for record in read_records(run_dir / DISCARDED, torn)
                if isinstance(record.get("prompt_key"), str))
    return done


def journal_entries(run_dir: Path, done: set[str], unreadable: list[str]) -> dict[str, list[dict]]:
    """The replayable journal entries of the prompts not `done`, by key; each unreadable line noted in `unreadable`."""
    entries: dict[str, list[dict]] = {}
    for entry in read_records(run_dir / JOURNAL, unreadable):
        if not _journal_entry(entry):
            unreadable.append(JOURNAL)
        elif entry["key"] not in done:
            entries.setdefault(entry["key"], []).append(entry)
    return entries


def _journal_entry(entry: dict) -> bool:
    """Whether a journal line is an entry that trajgen/journal.py can replay."""
    return (isinstance(entry.get("key"), str) and isinstance(entry.get("turn"), int)
            and isinstance(entry.get("hash"), str) and isinstance(entry.get("message"), dict)
            and isinstance(entry.get("usage"), dict) and isinstance(entry.get("role", "agent"), str))


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


class AppendFile:
    """One file appended to in whole lines. A line torn by a kill or a full disk is followed by a
    fresh line, so it never swallows the next record."""

    def __init__(self, path: Path):
        self.path = path
        with writing(path):
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)  # rows may hold what users keep private
        size = os.fstat(self.fd).st_size
        self.torn = bool(size) and os.pread(self.fd, 1, size - 1) != b"\n"
        self.unsynced = False  # written since its last fsync

    def append(self, record: dict | orjson.Fragment) -> None:
        data = (b"\n" if self.torn else b"") + orjson.dumps(record) + b"\n"
        self.torn = True
        with writing(self.path):
            while data:  # one write almost always; loop in case the kernel takes less
                data = data[os.write(self.fd, data):]
        self.torn = False
        self.unsynced = True

    def sync(self) -> None:
        if self.unsynced:  # cleared first: a write meanwhile sets it again
            self.unsynced = False
            with writing(self.path):
                os.fsync(self.fd)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        os.close(self.fd)


class RowFiles:
    """The batch files, opened on their first row and closed once fsynced at their batch's end, and
    the side files (discarded, failures); `synced` holds the batch files known to be on disk."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        # fsynced, and unchanged since: a crashed run's others never were, one edited by hand is no longer
        self.synced = settled(run_dir)
        self.batches: dict[int, AppendFile] = {}
        self.side = {name: AppendFile(run_dir / name) for name in (DISCARDED, FAILURES)}

    def row(self, batch_num: int, row: orjson.Fragment) -> None:
        if batch_num not in self.batches:
            self.batches[batch_num] = AppendFile(self.run_dir / f"batch_{batch_num}.jsonl")
        self.batches[batch_num].append(row)

    def user_files(self, files: dict[str, bytes]) -> None:
        """Files a prompt's tools made, by path relative to the run directory, which they must stay in."""
        for name, data in files.items():
            path = self.run_dir / name
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise ValueError(f"a tool's file {name!r} is not inside the run directory")
            with writing(path):
                path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, data)

    def sync_side(self) -> None:
        for file in self.side.values():
            file.sync()

    def finish(self, batch_num: int, file: AppendFile) -> None:
        """fsync and close an ended batch's file (no more writes come to it)."""
        with writing(file.path):
            os.fsync(file.fd)
        file.close()
        self.synced.add(batch_num)

    def close(self) -> None:
        for file in self.side.values():
            file.close()
        self.side = {}


class Journal:
    """The replies of prompts not yet landed. Compaction drops the entries of prompts that landed,
    so it holds only the replies of prompts in flight or failed."""

    def __init__(self, run_dir: Path):
        self.file = AppendFile(run_dir / JOURNAL)
        self._lock = threading.Lock()  # appends wait while a compaction swaps the file
        self.journaled: set[str] = set()  # prompts with entries in the journal (most that land have none)
        self.landed: set[str] = set()  # of those, the ones whose entries can go at the next compaction
        self._compacted_size = 0  # of the journal after the last compaction
        if self.file.size():  # an earlier run may have died before compacting it
            self.landed = final_keys(run_dir, [])
            self.journaled = set(journal_entries(run_dir, self.landed, []))

    def append(self, entry: dict) -> None:
        with self._lock:
            self.file.append(entry)
        self.journaled.add(entry["key"])

    def land(self, key: str) -> None:
        if key in self.journaled:
            self.landed.add(key)

    def take_landed(self) -> frozenset[str]:
        """The landed prompts not yet handed to a compaction (their rows are written, maybe not fsynced)."""
        landed = frozenset(self.landed)
        self.journaled -= self.landed
        self.landed = set()
        return landed

    def grown(self) -> bool:
        """Compaction reads the whole journal: only once it doubled since the last one."""
        with self._lock:  # a compaction may be swapping the file
            size = self.file.size()
        return size >= max(COMPACT_AT, 2 * self._compacted_size)

    def sync(self) -> None:
        self.file.sync()

    def compact(self, landed: frozenset[str]) -> None:
        """Rewrite the journal without the landed prompts' entries. Appends wait only while the
        few lines added during the rewrite are copied and the file is swapped."""
        path = self.file.path
        with open(path, "rb") as f:
            data = f.read()
        done = data.rfind(b"\n") + 1  # whole lines only: an append may be under way
        with writing(path):
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with writing(path), os.fdopen(fd, "wb") as f:
                f.write(_without(data[:done], landed))
                f.flush()
                os.fsync(f.fileno())
                with self._lock:
                    f.write(_without(os.pread(self.file.fd, self.file.size() - done, done), landed))
                    f.flush()
                    os.fsync(f.fileno())
                    os.replace(tmp, path)
                    self._compacted_size = f.tell()
                    old, self.file = self.file, AppendFile(path)  # fsynced already
                    old.close()
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def close(self) -> None:
        self.file.close()


class Checkpointer:
    """The latest checkpoint, written at most once per CHECKPOINT_SECONDS by the writer's thread;
    newer payloads replace older unwritten ones. An older checkpoint after a crash costs the resume
    only time: the files it does not list yet have their lines parsed."""

    def __init__(self, path: Path):
        self.path = path
        self._waiting: dict | None = None  # the latest payload not yet written
        self._written = -CHECKPOINT_SECONDS  # when the last one was written (time.monotonic)

    def offer(self, payload: dict) -> None:
        """Keep the payload, in place of any older one still waiting."""
        self._waiting = payload

    def due(self) -> float | None:
        """Seconds until the waiting checkpoint may be written; None when none waits."""
        if self._waiting is None:
            return None
        return max(0.0, self._written + CHECKPOINT_SECONDS - time.monotonic())

    def write_waiting(self, batch_files: set[int]) -> None:
        payload, self._waiting = self._waiting, None
        self.write(payload, batch_files)
        self._written = time.monotonic()

    def write(self, payload: dict, batch_files: set[int]) -> None:
        """The checkpoint lists the batch files fsynced before it was written, so that resume can say
        which were deleted and read those it can trust for their keys only."""
        write_json(self.path, {**payload, "batch_files": sorted(batch_files)})


class Writer:
    """The run directory's one writer: rows, side records and journal entries are appended at once;
    a background thread fsyncs and closes each batch when it ends, then compacts the journal and
    writes the checkpoint, in that order, so the scheduler never waits on the disk."""

    def __init__(self, run_dir: Path):
        self.rows = RowFiles(run_dir)
        self.replies = Journal(run_dir)
        self.checkpoints = Checkpointer(run_dir / CHECKPOINT)
        self._jobs: queue.Queue = queue.Queue()
        self.error: BaseException | None = None  # the first failure: the run stops at it, and close raises it
        self._compact_later()
        self._thread = threading.Thread(target=self._sync_loop, name="fsync", daemon=True)
        self._thread.start()

    def _write(self, append, *args) -> bool:
        """Whether it was written. A run directory that cannot be written does not raise here: the
        first such failure is kept in `error`, which stops the run (the scheduler asks), and what
        still arrives is written if it can be (a file already open, the journal, still takes it)."""
        try:
            append(*args)
        except Unwritable as e:  # the first is the one to report, whatever fails after it
            self.error = self.error or e
            return False
        return True

    def row(self, batch_num: int, key: str, row: orjson.Fragment) -> None:  # serialised by the worker
        if self._write(self.rows.row, batch_num, row):
            self.replies.land(key)

    def user_files(self, files: dict[str, bytes]) -> None:
        self._write(self.rows.user_files, files)

    def discarded(self, record: dict) -> None:
        if self._write(self.rows.side[DISCARDED].append, record):
            self.replies.land(record["prompt_key"])

    def failed(self, record: dict) -> None:
        self._write(self.rows.side[FAILURES].append, record)

    def journal(self, entry: dict) -> None:
        self._write(self.replies.append, entry)

    def _compact_later(self) -> None:
        """Queued after the rows of the landed prompts, so their entries go only once they are on disk."""
        if self.replies.landed:
            self._jobs.put(("compact", self.replies.take_landed()))

    def end_batch(self, batch_num: int) -> None:
        self._jobs.put((batch_num, self.rows.batches.pop(batch_num, None)))
        if self.replies.grown():
            self._compact_later()

    def checkpoint(self, payload: dict) -> None:
        """Written after everything queued before it is on disk: the payload travels in its job, so
        the thread never writes it ahead of a batch that ended before it."""
        self._jobs.put(("checkpoint", payload))

    def _sync_loop(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self.checkpoints.due())
            except queue.Empty:  # the waiting checkpoint is due
                job = ("checkpoint", None)
            if job == "stop":
                return
            try:
                if job[0] == "checkpoint":
                    if job[1] is not None:
                        self.checkpoints.offer(job[1])
                    if self.checkpoints.due() == 0:  # else written when due: the queue's timeout
                        self.checkpoints.write_waiting(self.rows.synced)
                elif job[0] == "compact":
                    self.replies.compact(job[1])
                else:
                    self.rows.sync_side()
                    self.replies.sync()
                    batch_num, file = job
                    if file is not None:
                        self.rows.finish(batch_num, file)
            except BaseException as e:
                self.error = self.error or e

    def close(self, final_checkpoint: dict) -> None:
        """Flush everything; the final checkpoint is written last, after every batch is on disk
        (a checkpoint still queued may be ahead of the last batches)."""
        for batch_num in list(self.rows.batches):
            self.end_batch(batch_num)
        self._compact_later()
        self._jobs.put((None, None))
        self._jobs.put("stop")
        self._thread.join()
        try:
            self.checkpoints.write(final_checkpoint, self.rows.synced)
        except BaseException as e:
            self.error = self.error or e
        self.rows.close()
        self.replies.close()
        if self.error:
            raise self.error
