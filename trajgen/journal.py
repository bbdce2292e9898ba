"""Never pay for a reply twice: a request already answered gets that answer again without a call.

`JournalModel` wraps the real `ModelClient` for one prompt. Each request is keyed by the hash of
exactly what is sent (`request_hash`); a reply in the prompt's journal entries for that turn and
hash (attached to its `Task` on --resume), or in the --cache_dir cache, is returned as it is.
Every reply paid for is sent to the parent (`Replied`), which appends it to the run's journal,
unless the prompt's row travels with it (messages.without_landed_replies).
Tools run again; while their results are the same, so is the next request, and the first
request that differs goes to the endpoint.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Callable

import orjson

from trajgen import llm, locks, store
from trajgen.errors import DiskFull, UsageError
from trajgen.messages import Event, Replied
from trajgen.model import USAGE_KEYS, ModelClient, Reply
from trajgen.work import ModelSettings, Task


def request_hash(settings: ModelSettings, messages: list[dict], tools: list[dict], forbid_tools: bool) -> str:
    """sha256 of the request body as sent (model, messages with the system prompt, tool schemas,
    tool_choice, sampling settings, extra body), as canonical JSON. The endpoint's address is not
    part of it: a local server's port changes between runs."""
    body = llm.request_args(settings, messages, tools, forbid_tools)
    return hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


class Cache:
    """The cross-run cache: one file per reply, named by the prompt's identity and the request
    hash (so a prompt repeated in the dataset for more samples is never given its twin's replies),
    written atomically, so runners sharing the directory never see half an entry. `trim` keeps it
    under its size."""

    def __init__(self, directory: str):
        self.dir = Path(directory)

    def open(self) -> None:
        """Create the directory, or say in one line why it cannot be used."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise UsageError(f"--cache_dir {self.dir} cannot be written: {e.strerror or e}") from None

    def path(self, key: str, digest: str) -> Path:
        name = hashlib.sha256(f"{key}:{digest}".encode()).hexdigest()
        return self.dir / name[:2] / f"{name}.json"

    def get(self, key: str, digest: str) -> Reply | None:
        path = self.path(key, digest)
        try:
            entry = orjson.loads(path.read_bytes())
            os.utime(path)  # recently used: trimmed last
            return _reply(entry)
        except (OSError, ValueError, KeyError, TypeError):  # absent, or damaged: ask the endpoint
            return None

    def put(self, key: str, digest: str, reply: Reply) -> None:
        """A cache that cannot be written (full, read-only) costs the next run a call, not this prompt."""
        path = self.path(key, digest)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            store.atomic_write(path, orjson.dumps(_record(reply)))
        except (OSError, DiskFull):
            pass

    def trim(self, max_bytes: int) -> None:
        """Delete the least recently used entries until the cache fits; one trimmer at a time."""
        try:
            fd = locks.acquire(self.dir / ".trim.lock")
        except (locks.LockHeld, OSError):
            return  # another runner is trimming it now, or the directory is gone
        try:
            entries = []
            for path in self.dir.glob("??/*.json"):
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime, st.st_size, path))
            total = sum(size for _, size, _ in entries)
            for _, size, path in sorted(entries):
                if total <= max_bytes:
                    break
                path.unlink(missing_ok=True)
                total -= size
        finally:
            locks.release(fd)


def empty_replayed() -> dict:
    return {"turns": 0, **dict.fromkeys(USAGE_KEYS, 0), "cost": None}


class JournalModel:
    """One prompt's model: journaled or cached replies first, the endpoint otherwise."""

    def __init__(self, model: ModelClient, settings: ModelSettings, task: Task, send: Callable[[Event], None],
                 cache: Cache | None):
        self.model, self.settings, self.key, self.send, self.cache = model, settings, task.key, send, cache
        self.journaled = {(e["turn"], e["hash"]): _reply(e) for e in task.replay}
        self.turn = 0
        self.replayed = empty_replayed()  # what this prompt did not pay for again; its usage still counts it

    async def complete(self, messages: list[dict], tools: list[dict], forbid_tools: bool) -> Reply:
        turn, self.turn = self.turn, self.turn + 1
        digest = request_hash(self.settings, messages, tools, forbid_tools)
        reply = self.journaled.get((turn, digest))
        if reply is None and self.cache is not None:
            reply = await asyncio.to_thread(self.cache.get, self.key, digest)
        if reply is not None:
            self._count(reply)
            return reply
        reply = await self.model.complete(messages, tools, forbid_tools)
        self.send(Replied(self.key, turn, digest, reply))
        if self.cache is not None:
            await asyncio.to_thread(self.cache.put, self.key, digest, reply)
        return reply

    def _count(self, reply: Reply) -> None:
        self.replayed["turns"] += 1
        for key in USAGE_KEYS:
            self.replayed[key] += reply.usage.get(key, 0)
        if reply.usage.get("cost") is not None:
            self.replayed["cost"] = (self.replayed["cost"] or 0.0) + reply.usage["cost"]


def entry(message: Replied) -> dict:
    """The journal line of a reply."""
    return {"key": message.key, "turn": message.turn, "hash": message.request_hash, **_record(message.reply)}


def _record(reply: Reply) -> dict:
    """Everything a reply carries into its row: a replayed reply must render the row a paid one did."""
    return {"message": reply.message, "usage": reply.usage, "served_by": reply.served_by, "timing": reply.timing}


def _reply(record: dict) -> Reply:
    return Reply(record["message"], record["usage"], record.get("served_by", {}), record.get("timing", {}))
