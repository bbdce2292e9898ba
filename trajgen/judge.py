"""The judge: a side model (trajgen/roles.py) that scores a finished sample against a rubric.

It sees the task, the trajectory (each tool call and tool result cut to TOOL_CHARS characters) and
the rubric, and answers JSON `{"score": number in [0, 1], "reason": string}`, asked for as a
JSON-schema `response_format` and parsed strictly whatever the endpoint made of it: a reply that
is anything else is a `judge_error` on the row, never a guessed score. With --judge_mode=group it
sees every sample of a prompt at once (ART's RULER) and scores each, the samples cut in proportion
so that a group of up to 16 fits GROUP_CHARS.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import orjson

from trajgen import trajectory
from trajgen.errors import APIError, EndpointUnreachable, FatalAPIError, MalformedResponse, ProviderError, UsageError
from trajgen.journal import JournalModel
from trajgen.model import Reply
from trajgen.task import JudgeConfig

TOOL_CHARS = 2000  # of each tool call's arguments and each tool result the judge sees
GROUP_CHARS = 192_000  # of all the samples of a group together (about 48k tokens)
SYSTEM = ("You grade an AI agent's work against a rubric. Read the task, the agent's trajectory and the rubric, "
          "then answer with one JSON object and nothing else.")
ANSWER = 'Answer with exactly {"score": <a number from 0 to 1>, "reason": "<one or two sentences>"}.'
GROUP_ANSWER = ('Score every sample on its own merits, comparing them with each other. Answer with exactly '
                '{"scores": [{"sample": <its number>, "score": <a number from 0 to 1>, "reason": "<why>"}, ...]}, '
                "one entry per sample.")
_SCORE = {"type": "object", "additionalProperties": False, "required": ["score", "reason"],
          "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}, "reason": {"type": "string"}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "judgement", "strict": True, "schema": _SCORE}}
GROUP_FORMAT = {"type": "json_schema", "json_schema": {"name": "judgements", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": ["scores"],
    "properties": {"scores": {"type": "array", "items": {
        **_SCORE, "required": ["sample", "score", "reason"],
        "properties": {"sample": {"type": "integer"}, **_SCORE["properties"]}}}}}}}


class JudgeError(Exception):
    """The judge's answer is not a score: the row gets `judge_error`, no score."""


@dataclass(frozen=True)
class Score:
    score: float
    reason: str


def load_rubric(flag: str | None) -> str:
    """--rubric's text, or the text of the file after `@`."""
    if not flag or not flag.startswith("@"):
        return flag or ""
    try:
        text = Path(flag[1:]).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--rubric {flag}: cannot read the rubric file ({getattr(e, 'strerror', None) or e})") from None
    if not text.strip():
        raise UsageError(f"--rubric {flag}: the rubric file is empty")
    return text


def rubric_of(row: dict, config: JudgeConfig) -> str:
    """The row's own rubric (its dataset field), else the run's."""
    return row["metadata"].get("rubric") or config.rubric


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def cut(text: str, limit: int) -> str:
    """`text`, its middle left out past `limit` characters, saying how much."""
    if len(text) <= limit:
        return text
    head = limit // 2
    return f"{text[:head]}\n[... {len(text) - limit} characters cut ...]\n{text[len(text) - (limit - head):]}"


def task_of(row: dict) -> str:
    return next(t["value"] for t in row["conversations"] if t["from"] == "human")


def rendered(row: dict, tool_chars: int = TOOL_CHARS) -> str:
    """The trajectory after the task as the judge reads it: the agent's text whole, each tool call and
    result cut to `tool_chars`."""
    parts, seen_task = [], False
    for turn in row["conversations"]:
        message = turn.get("message") or {}
        if turn["from"] == "human":
            if seen_task:
                parts.append(f"[user]\n{turn['value']}")
            seen_task = True
        elif turn["from"] == "gpt":
            parts.append(f"[agent]\n{trajectory.split_reasoning(message)[1]}")
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                parts.append(f"[tool call {function.get('name')}]\n{cut(str(function.get('arguments')), tool_chars)}")
        elif turn["from"] == "tool":
            parts.append(f"[tool result]\n{cut(str(message.get('content', turn['value'])), tool_chars)}")
    return "\n\n".join(parts)


def messages(row: dict, rubric: str) -> list[dict]:
    """The judge's request for one sample."""
    text = f"## Task\n{task_of(row)}\n\n## Trajectory\n{rendered(row)}\n\n## Rubric\n{rubric}\n\n{ANSWER}"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def group_messages(rows: list[dict], rubric: str) -> list[dict]:
    """The judge's request for every sample of one prompt: each trajectory cut to its share of GROUP_CHARS."""
    share = GROUP_CHARS // max(len(rows), 1)
    samples = "\n\n".join(f"### Sample {i}\n{cut(rendered(row), share)}" for i, row in enumerate(rows))
    text = f"## Task\n{task_of(rows[0])}\n\n## Samples\n{samples}\n\n## Rubric\n{rubric}\n\n{GROUP_ANSWER}"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def _answer(reply: Reply) -> object:
    text = trajectory.split_reasoning(reply.message)[1].strip()
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        raise JudgeError(f"the judge's answer is not JSON: {text[:200]!r}") from None


def _score(found: object, keys: frozenset[str] = frozenset({"score", "reason"})) -> Score:
    if not isinstance(found, dict) or set(found) != keys:
        raise JudgeError(f"the judge's answer is not {{{', '.join(sorted(keys))}}}: {_short(found)}")
    score, reason = found["score"], found["reason"]
    if type(score) not in (int, float) or not (0 <= score <= 1) or not math.isfinite(score):
        raise JudgeError(f"the judge's score {score!r} is not a number in [0, 1]")
    if not isinstance(reason, str):
        raise JudgeError("the judge's reason is not text")
    return Score(float(score), reason)


def _short(found: object) -> str:
    return orjson.dumps(found).decode()[:200]


def parse(reply: Reply) -> Score:
    """The one score a reply must be, or JudgeError."""
    return _score(_answer(reply))


def parse_group(reply: Reply, size: int) -> list[Score]:
    """One score per sample 0 .. size-1, each exactly once, or JudgeError."""
    found = _answer(reply)
    entries = found.get("scores") if isinstance(found, dict) and set(found) == {"scores"} else None
    if not isinstance(entries, list):
        raise JudgeError(f"the judge's answer is not {{scores: [...]}}: {_short(found)}")
    scores: dict[int, Score] = {}
    for entry in entries:
        sample = entry.get("sample") if isinstance(entry, dict) else None
        if type(sample) is not int or not 0 <= sample < size or sample in scores:
            raise JudgeError(f"the judge's answer names sample {sample!r}: samples are 0 to {size - 1}, once each")
        scores[sample] = _score({k: v for k, v in entry.items() if k != "sample"})
    if len(scores) != size:
        raise JudgeError(f"the judge scored {len(scores)} of the {size} samples")
    return [scores[i] for i in range(size)]


def fields(score: Score | JudgeError | Exception, model: str, rubric: str) -> dict:
    """What a judgement puts on the row: `judge` with `judge_error` null, or `judge` null with `judge_error`."""
    if isinstance(score, Score):
        return {"judge": {"score": score.score, "reason": score.reason, "model": model,
                          "rubric_sha256": sha256(rubric)}, "judge_error": None}
    return {"judge": None, "judge_error": str(score)[:2000] or type(score).__name__}


def unreachable(config: JudgeConfig, error: EndpointUnreachable) -> FatalAPIError:
    """The judge's endpoint out of reach: the run stops, naming the judge's flag."""
    return FatalAPIError(f"--judge_base_url={config.settings.base_url} cannot be reached: {error}")


async def judge(model: JournalModel, config: JudgeConfig, row: dict) -> dict:
    """The row's judgement through the worker's side model. An endpoint that refuses every call or cannot
    be reached stops the run, named by its flag; any other failure of the call is this row's judge_error."""
    rubric = rubric_of(row, config)
    if not rubric:
        return fields(JudgeError("no rubric: the row has no `rubric` field and the run no --rubric"), "", rubric)
    try:
        score: Score | Exception = parse(await model.complete(messages(row, rubric), [], False))
    except EndpointUnreachable as e:
        raise unreachable(config, e) from e
    except (JudgeError, MalformedResponse, ProviderError, APIError) as e:
        score = e
    return fields(score, config.settings.model, rubric)
