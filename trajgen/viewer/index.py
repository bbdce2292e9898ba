"""A byte-offset index over a run directory's JSONL files, for paging 100,000 rows without
loading them.

The files only grow by whole lines appended (store.Writer), so each file is read once from where
the index last stopped; a last line without its newline is still being written and is left for
the next refresh. Every prompt has one entry, with the precedence the merge uses: a batch row
beats a discarded record, which beats a failure (the latest failure of a prompt counts). Each
entry keeps what the list, the filters and the summary need; the conversation itself is read
back from its file at its offset when it is opened.
"""
from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from trajgen import merge, rewards, store, verify
from trajgen.verify import Verdict

PROMPT_CHARS = 2000  # of each prompt, kept for search
PREVIEW_CHARS = 160
ROW, DISCARDED, FAILED = "row", "discarded", "failed"
SOURCES = (store.DISCARDED, store.FAILURES)
VERDICTS = {v.value: v for v in Verdict}  # an entry holds the shared member, not a string per row


@dataclass(frozen=True, slots=True)
class Entry:
    key: str | None
    kind: str  # ROW, DISCARDED or FAILED
    file: str  # the file's name in the run directory
    line: int  # 1-based, for provenance
    offset: int
    length: int
    prompt_index: int | None
    order: int  # the prompt index, unknown ones last: the list's order
    batch_num: int | None
    dataset_id: str | None
    preview: str
    search: str  # the prompt, lower-cased
    reason: str | None  # the discard reason or the failure's error class
    tools: tuple[str, ...]  # tools called at least once
    toolsets_offered: tuple[str, ...]
    toolsets_sampled: tuple[str, ...]
    hallucinated: bool
    reasoned: bool  # some assistant turn has reasoning: what --require_reasoning keeps
    verdict: Verdict  # of its verify command; passed is what --require_verified keeps
    partial: bool
    turns: int
    tokens: int

    @property
    def passed(self) -> bool:
        return self.verdict is Verdict.PASSED


@dataclass
class _File:
    size: int = 0  # bytes indexed so far (always the end of a whole line)
    lines: int = 0


@dataclass
class Tallies:
    """merge.Tally per group, fed as rows arrive; the rows by (called a tool not offered, has reasoning,
    verify passed), which the summary sorts into kept and filtered as the run's filters did."""

    rows: dict[tuple[bool, bool, bool], merge.Tally] = field(default_factory=dict)
    discarded: merge.Tally = field(default_factory=merge.Tally)
    failed_attempts: merge.Tally = field(default_factory=merge.Tally)  # every failure record, as the merge counts them
    verification: merge.Verification = field(default_factory=merge.Verification)  # rows and discarded rows
    rewards: rewards.Rewards = field(default_factory=rewards.Rewards)  # rows, as the merge counts them
    duplicates: int = 0
    torn: list[str] = field(default_factory=list)


class _Restart(Exception):
    """What was counted no longer holds: index the run directory again from the start."""


class RunIndex:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.version = 0  # bumped whenever an entry is added or replaced
        self._places: dict[str, tuple[int, int]] = {}  # file name -> its place in the merge's order
        self._reset()

    def _reset(self) -> None:
        self.files: dict[str, _File] = {}
        self.entries: list[Entry] = []
        self.by_key: dict[str | None, int] = {}
        self.tallies = Tallies()
        self.version += 1

    def refresh(self) -> None:
        """Read what has landed since the last refresh; start over if a file shrank (--overwrite)
        or a row arrived for a prompt already counted as discarded (not the merge's order)."""
        gc.disable()  # 100,000 new entries would set off many full collections, for nothing to free
        try:
            for _ in range(3):  # the files may change under us once more (an --overwrite going on)
                try:
                    return self._extend()
                except _Restart:
                    self._reset()
        finally:
            gc.enable()

    def _extend(self) -> None:
        sizes = self._sizes()
        if not self.files.keys() <= sizes.keys():  # a file went away: --overwrite
            raise _Restart
        grown = []
        for name, size in sizes.items():
            known = self.files.setdefault(name, _File())
            if size < known.size:
                raise _Restart
            if size > known.size:
                grown.append(name)
        for name in sorted(grown, key=self._places.__getitem__):  # the merge's order
            self._read(name, self.files[name])

    def _sizes(self) -> dict[str, int]:
        """The size of every file the index reads. One scandir and one stat per file, nothing more
        per file already seen: a run of 100,000 prompts has 10,000 batch files."""
        sizes: dict[str, int] = {}
        try:
            with os.scandir(self.run_dir) as listing:
                for item in listing:
                    if item.name in self._places or self._place(item.name):
                        sizes[item.name] = item.stat().st_size
        except FileNotFoundError:
            return {}
        return sizes

    def _place(self, name: str) -> bool:
        """Remember where a file comes in the merge's order (batches by number, then the side
        records); False for a file the index does not read."""
        if match := store.BATCH_FILE.match(name):
            self._places[name] = (0, int(match.group(1)))
        elif name in SOURCES:
            self._places[name] = (1, SOURCES.index(name))
        return name in self._places

    def _read(self, name: str, known: _File) -> None:
        try:
            f = open(self.run_dir / name, "rb", buffering=store.READ_BUFFER)
        except FileNotFoundError:
            raise _Restart
        with f:
            f.seek(known.size)
            for raw in f:
                if not raw.endswith(b"\n"):
                    return  # still being written: read again at the next refresh
                known.lines += 1
                try:
                    record = orjson.loads(raw)
                    if isinstance(record, dict):
                        self._add((name, known.lines, known.size, len(raw)), record)
                except (ValueError, TypeError, AttributeError, KeyError):
                    self.tallies.torn.append(f"{name}:{known.lines}")
                known.size += len(raw)

    def _add(self, where: tuple, record: dict) -> None:
        name = where[0]
        if name == store.FAILURES:
            self._add_failure(where, record)
        elif name == store.DISCARDED:
            self._add_discarded(where, record)
        else:
            self._add_row(where, record)

    def _add_row(self, where: tuple, row: dict) -> None:
        key = store.row_key(row)
        held = self.by_key.get(key, -1)
        if key is None or (held >= 0 and self.entries[held].kind == ROW):
            self.tallies.duplicates += 1
            return
        if held >= 0 and self.entries[held].kind == DISCARDED:
            raise _Restart
        entry = _entry(ROW, where, key, row, row, None)
        self.tallies.rows.setdefault((entry.hallucinated, entry.reasoned, entry.passed), merge.Tally()).add(row)
        self.tallies.verification.add(row)
        self.tallies.rewards.add(row)
        self._put(key, entry)

    def _add_discarded(self, where: tuple, record: dict) -> None:
        key = record.get("prompt_key")
        held = self.by_key.get(key, -1)
        if held >= 0 and self.entries[held].kind != FAILED:
            return
        row = record.get("row") if isinstance(record.get("row"), dict) else {}
        entry = _entry(DISCARDED, where, key, record, row, str(record.get("reason", "unknown")))
        self.tallies.discarded.add(row)
        self.tallies.verification.add(row)
        self._put(key, entry)

    def _add_failure(self, where: tuple, record: dict) -> None:
        self.tallies.failed_attempts.rows += 1
        self.tallies.failed_attempts.add_usage(record.get("usage") or {})
        key = record.get("prompt_key")
        held = self.by_key.get(key, -1)
        if held >= 0 and self.entries[held].kind != FAILED:
            return
        self._put(key, _entry(FAILED, where, key, record, {}, str(record.get("error_class", "Exception"))))

    def _put(self, key, entry: Entry) -> None:
        if (held := self.by_key.get(key)) is not None:
            self.entries[held] = entry
        else:
            self.by_key[key] = len(self.entries)
            self.entries.append(entry)
        self.version += 1

    def read(self, entry: Entry) -> dict:
        """The entry's record, read back from its file."""
        with open(self.run_dir / entry.file, "rb") as f:
            f.seek(entry.offset)
            return orjson.loads(f.read(entry.length))


_shared: dict[tuple, tuple] = {}


def _names(values) -> tuple[str, ...]:
    """The strings of `values` as a tuple shared between entries (100,000 rows name a few toolsets)."""
    if not isinstance(values, list):
        return ()
    names = tuple(v for v in values if isinstance(v, str))
    return _shared.setdefault(names, tuple(map(sys.intern, names)))


def _prompt(row: dict) -> str:
    for turn in row.get("conversations") or []:
        if isinstance(turn, dict) and turn.get("from") == "human" and isinstance(turn.get("value"), str):
            return turn["value"]
    return ""


def _entry(kind: str, where: tuple, key, record: dict, row: dict, reason: str | None) -> Entry:
    meta = row.get("metadata") if isinstance(row.get("metadata"), dict) else {}
    usage = meta.get("usage") if isinstance(meta.get("usage"), dict) else {}
    stats = row.get("tool_stats") if isinstance(row.get("tool_stats"), dict) else {}
    prompt = (_prompt(row) or str(record.get("prompt") or ""))[:PROMPT_CHARS]  # a failure record has no row
    dataset_id = meta.get("id", record.get("id"))
    dataset_id = None if dataset_id is None else str(dataset_id)
    index = row.get("prompt_index", record.get("prompt_index"))
    batch = meta.get("batch_num", record.get("batch_num"))
    return Entry(
        key=key, kind=kind, file=where[0], line=where[1], offset=where[2], length=where[3],
        prompt_index=index if isinstance(index, int) else None,
        order=index if isinstance(index, int) else sys.maxsize,
        batch_num=batch if isinstance(batch, int) else None,
        dataset_id=dataset_id,
        preview=" ".join(prompt[:PREVIEW_CHARS].split()),
        search=prompt.lower(),
        reason=reason,
        tools=_names([name for name, s in stats.items() if isinstance(s, dict) and s.get("count")]),
        toolsets_offered=_names(meta.get("toolsets_offered")),
        toolsets_sampled=_names(meta.get("toolsets_sampled")),
        hallucinated=bool(meta.get("hallucinated_tools")),
        reasoned=merge.reasoned(row),
        verdict=VERDICTS.get(verify.status(row), Verdict.UNVERIFIED),
        partial=bool(row.get("partial")),
        turns=int(meta.get("assistant_turns") or 0),
        tokens=int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0),
    )
