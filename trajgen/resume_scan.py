"""The resume scan: what a run directory already holds, read once before a run goes on. Resume trusts
the rows, not the checkpoint: a prompt is done when a batch file holds its row or discarded.jsonl its
record, and the journal's replies of the prompts not done are replayed. The files themselves, and
their one writer, are store.py's."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trajgen.store import (CHECKPOINT, FAILURES, JOURNAL, UnreadableFile, batch_files, final_keys, journal_entries,
                           read_checkpoint, read_json, read_records)


@dataclass
class Scan:
    """What the run directory already holds: the keys with a final record, and where to go on."""

    done: set[str] = field(default_factory=set)
    next_batch: int = 0
    torn: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # damaged or missing files, said at the start
    journal: dict[str, list[dict]] = field(default_factory=dict)  # prompt key -> its journaled replies, if not done


def scan(run_dir: Path) -> Scan:
    result = Scan()
    result.done = final_keys(run_dir, result.torn)
    present = {number for number, _ in batch_files(run_dir)}
    result.next_batch = max(present, default=-1) + 1
    unreadable: list[str] = []
    result.journal = journal_entries(run_dir, result.done, unreadable)
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


def anything_paid(run_dir: Path, found: Scan) -> bool:
    """Whether the run directory holds something an endpoint was paid for: a row or a discard, a
    journaled reply, a torn line, or a failure whose attempts used tokens. Settings that paid for
    nothing are not the run's: a resume may change them freely."""
    if found.done or found.journal or found.torn:
        return True
    return any(isinstance(usage := record.get("usage"), dict)
               and any(usage.get(k) for k in ("prompt_tokens", "completion_tokens", "reasoning_tokens", "cost"))
               for record in read_records(run_dir / FAILURES, []))
