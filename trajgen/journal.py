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
from dataclasses import replace
from pathlib import Path
from typing import Callable

import orjson

from trajgen import chat_calls, locks, store
from trajgen.errors import MalformedResponse, Unwritable, UsageError
from trajgen.messages import Event, Notice, Replied
from trajgen.model import USAGE_KEYS, ModelClient, Reply, checked, counted
from trajgen.task import ModelSettings, Task


def request_hash(args: dict) -> str:
    """sha256 of the request body as sent (`chat_calls.request_args`: model, messages with the system prompt,
    tool schemas, tool_choice, sampling settings, extra body), as canonical JSON. The endpoint's address is
    not part of it: a local server's port changes between runs."""
    return hashlib.sha256(orjson.dumps(args, option=orjson.OPT_SORT_KEYS)).hexdigest()


class Cache:
    """The cross-run cache: one file per reply, named by the prompt's identity and the request hash
    (so a prompt repeated in the dataset for more samples is never given its twin's replies), written
    atomically, so runners sharing the directory never see half an entry. `trim` keeps it under
    `max_mb`, and a reply larger than that is never stored."""

    def __init__(self, directory: str, max_mb: float):
        self.dir, self.max_bytes = Path(directory), int(max_mb * 2**20)
        self.said: set[str] = set()  # the topics of the notices `put` returned

    def open(self) -> None:
        """Create the directory, or say in one line why it cannot be."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--cache_dir {self.dir} cannot be created: {e.strerror or e}") from None

    def path(self, key: str, digest: str) -> Path:
        name = hashlib.sha256(f"{key}:{digest}".encode()).hexdigest()
        return self.dir / name[:2] / f"{name}.json"

    def get(self, key: str, digest: str) -> bytes | None:
        """The entry's bytes, unchecked (`replayed` checks them), or None when there is none."""
        path = self.path(key, digest)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        try:
            os.utime(path)  # recently used: trimmed last
        except OSError:  # a cache shared read-only: its replies are used all the same
            pass
        return data

    def evict(self, key: str, digest: str, why: Exception) -> Notice | None:
        """Delete an entry that is not a sound reply: it would fail its prompt on every run."""
        try:
            self.path(key, digest).unlink(missing_ok=True)
        except OSError:  # read-only: the entry stays, and is asked of the endpoint again each time
            pass
        return self._once("cache damaged", f"--cache_dir {self.dir}: a damaged entry was deleted and its reply "
                                           f"asked of the endpoint ({why}); any other is treated alike")

    def put(self, key: str, digest: str, reply: Reply) -> Notice | None:
        """A cache that cannot be written (full, read-only) costs the next run a call, not this prompt;
        what it could not do is returned, once per kind, for the user."""
        data = orjson.dumps(_record(reply))
        if len(data) > self.max_bytes:
            return self._once("cache too large", f"a reply of {len(data) / 2**20:.1f} MB is larger than the whole "
                                                 f"cache (--cache_max_mb={self.max_bytes / 2**20:g}): not cached, "
                                                 "nor any reply that large")
        path = self.path(key, digest)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            store.atomic_write(path, data)
        except (OSError, Unwritable) as e:
            why = e.__cause__ if isinstance(e, Unwritable) else e
            return self._once("cache unwritable", f"--cache_dir {self.dir} cannot be written ({why.strerror or why}): "
                                                  "the replies of this run are not kept for the next")
        return None

    def _once(self, topic: str, text: str) -> Notice | None:
        if topic in self.said:
            return None
        self.said.add(topic)
        return Notice(topic, text)

    def trim(self) -> None:
        """Delete the least recently used entries until the cache fits; one trimmer at a time."""
        try:
            fd = locks.acquire(self.dir / ".trim.lock")
        except (locks.LockHeld, OSError):
            return  # another runner is trimming it now, or the directory cannot be written
        try:
            entries = []
            for path in self.dir.glob("??/*.json"):
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime_ns, st.st_size, path))
            for _, size, path in entries:
                if size > self.max_bytes:  # stored under a larger --cache_max_mb: it could never fit
                    path.unlink(missing_ok=True)
            fits = sorted(e for e in entries if e[1] <= self.max_bytes)  # least recently used first
            total = sum(size for _, size, _ in fits)
            for _, size, path in fits:
                if total <= self.max_bytes:
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
                 cache: Cache | None, role: str = "agent"):
        self.model, self.settings, self.key, self.send, self.cache = model, settings, task.key, send, cache
        self.role = role  # the journal's entries of another role are not this model's (trajgen/roles.py)
        self.journaled: dict[tuple[int, str], Reply] = {}
        for entry in task.replay:
            if entry.get("role", "agent") != role:
                continue
            try:
                self.journaled[(entry["turn"], entry["hash"])] = replayed(entry)
            except MalformedResponse as e:  # as if never journaled: asked again, and the new reply journaled
                send(Notice("journal damaged", f"{store.JOURNAL} holds a damaged reply of prompt {self.key} ({e}): "
                                               "it is asked for, and paid for, again; any other is treated alike"))
        self.turn = 0
        self.replayed = empty_replayed()  # what this prompt did not pay for again; its usage still counts it

    async def complete(self, messages: list[dict], tools: list[dict], forbid_tools: bool) -> Reply:
        turn, self.turn = self.turn, self.turn + 1
        args = chat_calls.request_args(self.settings, messages, tools, forbid_tools)  # built once: hashed, then sent
        digest = request_hash(args)
        reply = self.journaled.get((turn, digest))
        if reply is None and self.cache is not None:
            reply = await self._cached(digest)
        if reply is not None and (reply.tokens is not None or not self.settings.token_ids):  # no ids: asked again
            self._count(reply)
            return reply
        reply = await self.model.complete(messages, tools, forbid_tools, args)
        self.send(Replied(self.key, turn, digest, reply, self.role))
        if self.cache is not None and (notice := await asyncio.to_thread(self.cache.put, self.key, digest, reply)):
            self.send(notice)
        return reply

    async def _cached(self, digest: str) -> Reply | None:
        """The cached reply to this request, if there is a sound one; a damaged one is evicted."""
        data = await asyncio.to_thread(self.cache.get, self.key, digest)
        if data is None:
            return None
        try:
            return replayed(orjson.loads(data))
        except (orjson.JSONDecodeError, MalformedResponse) as e:
            if notice := await asyncio.to_thread(self.cache.evict, self.key, digest, e):
                self.send(notice)
            return None

    def _count(self, reply: Reply) -> None:
        self.replayed["turns"] += 1
        for key in USAGE_KEYS:
            self.replayed[key] += reply.usage.get(key, 0)
        if reply.usage.get("cost") is not None:
            self.replayed["cost"] = (self.replayed["cost"] or 0.0) + reply.usage["cost"]


def entry(message: Replied) -> dict:
    """The journal line of a reply (an agent's reply names no role: journals of older runs replay as they are)."""
    role = {} if message.role == "agent" else {"role": message.role}
    return {"key": message.key, "turn": message.turn, **role, "hash": message.request_hash, **_record(message.reply)}


def _record(reply: Reply) -> dict:
    """Everything a reply carries into its row: a replayed reply must render the row a paid one did."""
    record = {"message": reply.message, "usage": reply.usage, "served_by": reply.served_by, "timing": reply.timing,
              "finish_reason": reply.finish_reason}
    return record if reply.tokens is None else {**record, "tokens": reply.tokens}


def replayed(record) -> Reply:
    """A reply kept by `_record`, checked as a live one is (model.checked), since a file may have been
    damaged or edited since: MalformedResponse when it is not a reply the loop can use."""
    if not isinstance(record, dict):
        raise MalformedResponse(f"the stored reply is not an object: {str(record)[:200]}")
    message, usage = record.get("message"), record.get("usage")
    served_by, timing = record.get("served_by", {}), record.get("timing", {})
    for name, value in (("message", message), ("usage", usage), ("served_by", served_by), ("timing", timing)):
        if not isinstance(value, dict):
            raise MalformedResponse(f"the stored reply's {name} is not an object: {str(value)[:200]}")
    if not all(type(seconds) in (int, float) for seconds in timing.values()):
        raise MalformedResponse(f"the stored reply's timing is not in seconds: {str(timing)[:200]}")
    tokens = record.get("tokens")
    if tokens is not None and not (isinstance(tokens, dict) and isinstance(tokens.get("prompt_ids"), list)
                                   and isinstance(tokens.get("completion_ids"), list)):
        raise MalformedResponse(f"the stored reply's tokens are not ids: {str(tokens)[:200]}")
    reply = checked(message, counted(usage) if usage else {})  # a reply without usage replays without it
    return replace(reply, served_by=served_by, timing=timing, finish_reason=record.get("finish_reason"), tokens=tokens)
