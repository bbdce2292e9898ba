"""Read the JSONL dataset as a stream, validate it, and give every prompt its identity.

A prompt's identity (`key`) is a hash of its task content (prompt, image, cwd, and its
`verify` command and simulated `user` when it has them, so datasets without them keep their keys) plus its
occurrence number among identical rows, so the k-th copy of a repeated prompt is done or
not on its own, and resume survives inserted, deleted and reordered lines.
"""
from __future__ import annotations

import difflib
import hashlib
from dataclasses import dataclass, field
from typing import Iterator

import orjson

TASK_FIELDS = ("prompt", "image", "docker_image", "cwd", "verify")


@dataclass
class Entry:
    index: int  # 0-based line number in the dataset file
    prompt: str
    image: str | None
    cwd: str | None
    extra: dict  # the row's other fields, carried into the row's metadata
    verify: str | None = None  # the shell command that checks the sample (trajgen/verify.py)
    user: dict | None = None  # the simulated user's persona, goal and instructions (trajgen/simulated_user.py)
    key: str = ""


@dataclass
class DatasetCheck:
    """What the validation pass found; duplicates holds the content hashes seen more than once."""

    valid: int = 0
    errors: list[str] = field(default_factory=list)
    error_count: int = 0
    duplicates: set[int] = field(default_factory=set)
    fingerprint: str = ""


def parse_line(raw: bytes, index: int, path: str) -> Entry | str:
    """An Entry, or a one-line reason the line is bad."""
    where = f"{path}:{index + 1}"
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return f"{where}: not valid JSON ({e})"
    if not isinstance(obj, dict):
        return f"{where}: not a JSON object"
    prompt = obj.get("prompt")
    if "prompt" not in obj:
        near = difflib.get_close_matches("prompt", [k for k in obj if isinstance(k, str)], n=1, cutoff=0.6)
        return f"{where}: no 'prompt' field" + (f" (is {near[0]!r} meant to be 'prompt'?)" if near else "")
    if not isinstance(prompt, str) or not prompt.strip():
        return f"{where}: field 'prompt' must be a non-empty string"
    image = obj.get("image", obj.get("docker_image"))
    for name in ("image", "docker_image", "cwd", "verify", "rubric"):
        value = obj.get(name)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            return f"{where}: field '{name}' must be a non-empty string"
    cwd = obj.get("cwd")
    if cwd is not None and not cwd.startswith("/"):
        return f"{where}: field 'cwd' must be an absolute path"
    user = simulated_user(obj.get("user"))
    if isinstance(user, str):
        return f"{where}: field 'user' {user}"
    extra = {k: v for k, v in obj.items() if k not in TASK_FIELDS}  # `user` too: rows keep the field they had
    return Entry(index, prompt, image, cwd, extra, obj.get("verify"), user)


USER_KEYS = ("persona", "goal", "instructions")


def simulated_user(value) -> dict | None | str:
    """A row's `user` field as {persona, goal, instructions} (a string is the instructions), or why not."""
    if value is None:
        return None
    if isinstance(value, str):
        value = {"instructions": value}
    if not isinstance(value, dict):
        return f"must be a string or an object of {', '.join(USER_KEYS)}"
    unknown = [k for k in value if k not in USER_KEYS]
    if unknown:
        return f"has {unknown[0]!r}, not one of {', '.join(USER_KEYS)}"
    if not value or not all(isinstance(v, str) and v.strip() for v in value.values()):
        return f"must give {', '.join(USER_KEYS)} (any of them) as non-empty strings"
    return value


def content_hash(entry: Entry) -> bytes:
    verify = {"verify": entry.verify} if entry.verify is not None else {}
    user = {"user": entry.user} if entry.user is not None else {}  # an episode's user is part of its task
    content = orjson.dumps({"prompt": entry.prompt, "image": entry.image, "cwd": entry.cwd, **verify, **user},
                           option=orjson.OPT_SORT_KEYS if user else 0)
    return hashlib.blake2b(content, digest_size=16).digest()


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        for index, raw in enumerate(f):
            if raw.strip():
                yield index, raw


def read(path: str, result: DatasetCheck, max_samples: int | None = None,
         max_errors_shown: int = 20) -> Iterator[Entry]:
    """The valid entries with their keys, each line validated into `result` on the way, which is
    complete once they are all read: the check and the plan's count in one pass. It holds every
    prompt's 8-byte content head (a set), not the prompts."""
    seen: set[int] = set()
    repeats: dict[int, int] = {}  # heads met more than once -> the copies met after the first
    digest = hashlib.blake2b(digest_size=16)
    for index, raw in _lines(path):
        parsed = parse_line(raw, index, path)
        if isinstance(parsed, str):
            result.error_count += 1
            if len(result.errors) < max_errors_shown:
                result.errors.append(parsed)
            continue
        if max_samples is not None and result.valid >= max_samples:
            continue
        result.valid += 1
        h = content_hash(parsed)
        digest.update(h)
        head = int.from_bytes(h[:8], "little")
        if head in seen:
            occurrence = repeats[head] = repeats.get(head, 0) + 1
        else:
            occurrence = 0
            seen.add(head)
        parsed.key = f"{h.hex()}-{occurrence}"
        yield parsed
    result.fingerprint = digest.hexdigest()
    result.duplicates = set(repeats)


def check(path: str, max_samples: int | None = None, max_errors_shown: int = 20) -> DatasetCheck:
    """Validate every line and find repeated prompts."""
    result = DatasetCheck()
    for _ in read(path, result, max_samples, max_errors_shown):
        pass
    return result


def entries(path: str, duplicates: set[int], max_samples: int | None = None) -> Iterator[Entry]:
    """The valid entries in file order, each with its identity key (bad lines are skipped)."""
    seen: dict[int, int] = {}
    count = 0
    for index, raw in _lines(path):
        parsed = parse_line(raw, index, path)
        if isinstance(parsed, str):
            continue
        if max_samples is not None and count >= max_samples:
            return
        count += 1
        h = content_hash(parsed)
        head = int.from_bytes(h[:8], "little")
        occurrence = 0
        if head in duplicates:
            occurrence = seen.get(head, 0)
            seen[head] = occurrence + 1
        parsed.key = f"{h.hex()}-{occurrence}"
        yield parsed
