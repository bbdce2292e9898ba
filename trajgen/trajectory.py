"""Turn an API conversation into a ShareGPT-style row.

A gpt turn's `value` is self-contained training text in the Hermes form: one leading
`<think>…</think>`, the content, then each call as `<tool_call>{json}</tool_call>`; tool turns
are `<tool_response>{json}</tool_response>`. JSON inside the envelope escapes `<` as \\u003c,
and free text has `<` of our own tags written as `&lt;`, so no content can break the envelope.
Each turn also keeps `message`, the OpenAI message exactly as sent, so nothing is ever parsed
back out of a `value`.
"""
from __future__ import annotations

import re

import orjson

FORMAT_VERSION = 2
ENVELOPE_TAGS = ("think", "tool_call", "tool_response")
REASONING_TAGS = ("think", "thinking", "reasoning", "REASONING_SCRATCHPAD")
LATENCY_KEYS = ("first_byte", "first_token", "generation")  # seconds per reply, in row metadata (trajgen/chat_calls.py)
_REASONING_BLOCK = re.compile(
    r"<(" + "|".join(REASONING_TAGS) + r")>(.*?)(?:</\1>|\Z)", re.DOTALL
)
_ENVELOPE_TAG = re.compile(r"<(/?(?:" + "|".join(ENVELOPE_TAGS) + r"))>")


def reply_reasoning(message: dict) -> str:
    """The reasoning the endpoint returned beside the content (its fields, not inline tags)."""
    parts: list[str] = []
    for name in ("reasoning", "reasoning_content"):
        if isinstance(message.get(name), str) and message[name].strip():
            parts.append(message[name].strip())
    if not parts:  # reasoning_details usually repeats `reasoning`; use it only when that is missing
        for detail in message.get("reasoning_details") or []:
            if isinstance(detail, dict):
                text = detail.get("text") or detail.get("summary")
                if isinstance(text, str) and text.strip():
                    parts.append(text.strip())
    return "\n\n".join(parts)


def split_reasoning(message: dict) -> tuple[str, str]:
    """(reasoning, content without reasoning blocks) from the reply's fields and inline tags."""
    parts = [r] if (r := reply_reasoning(message)) else []
    content = message.get("content") or ""
    if not isinstance(content, str):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    inline = [m.group(2).strip() for m in _REASONING_BLOCK.finditer(content)]
    parts.extend(p for p in inline if p)
    if inline:
        content = _REASONING_BLOCK.sub("", content).strip()
    return "\n\n".join(parts), content


def escape_text(text: str) -> str:
    return _ENVELOPE_TAG.sub(r"&lt;\1>", text)


def envelope_json(obj) -> str:
    return orjson.dumps(obj).decode().replace("<", "\\u003c")


def parse_arguments(raw: str):
    """The call's arguments as an object; text that is not a JSON object is kept under `_raw`."""
    try:
        value = orjson.loads(raw or "{}")
    except orjson.JSONDecodeError:
        return {"_raw": raw}
    return value if isinstance(value, dict) else {"_raw": raw}


def gpt_turn(reasoning: str, content: str, calls: list[dict]) -> dict:
    """calls: [{id, name, arguments (object)}]."""
    pieces = []
    if reasoning:
        pieces.append(f"<think>\n{escape_text(reasoning)}\n</think>")
    if content:
        pieces.append(escape_text(content))
    for call in calls:
        pieces.append(f"<tool_call>\n{envelope_json({'name': call['name'], 'arguments': call['arguments']})}\n</tool_call>")
    turn: dict = {"from": "gpt", "value": "\n".join(pieces)}
    if calls:
        turn["tool_calls"] = calls
    return turn


BLOCKS = "content_blocks"  # a result's parts that are not text (an MCP image...): kept in the row, never sent


def sent_result(result: dict) -> dict:
    """What the model is sent of a tool result: all of it but its BLOCKS, which its text names."""
    return {k: v for k, v in result.items() if k != BLOCKS}


def tool_turn(call_id: str, name: str, result: dict) -> dict:
    body = envelope_json({"tool_call_id": call_id, "name": name, "content": sent_result(result)})
    turn = {"from": "tool", "value": f"<tool_response>\n{body}\n</tool_response>", "tool_call_id": call_id}
    return {**turn, BLOCKS: result[BLOCKS]} if BLOCKS in result else turn


HERMES_TOOLS_PREAMBLE = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML "
    "tags. You may call one or more functions to assist with the user query. Don't make assumptions about what "
    "values to plug into functions. Here are the available tools:")
HERMES_CALL_FORMAT = (
    "For each function call return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags as follows:\n<tool_call>\n{"name": <function-name>, "arguments": <args-dict>}\n</tool_call>')


def hermes_system(system_prompt: str, tools: list[dict]) -> str:
    """The system turn in the Hermes function-calling form: the prompt, then the `<tools>` list
    (the schemas as sent, `<` escaped like all envelope JSON) and how calls are written."""
    listing = f"{HERMES_TOOLS_PREAMBLE}\n<tools>\n{envelope_json(tools)}\n</tools>\n{HERMES_CALL_FORMAT}"
    return f"{system_prompt}\n\n{listing}" if system_prompt else listing


def tool_stat() -> dict[str, int]:
    """One tool's counts in a row's `tool_stats`: calls, and how many succeeded or failed."""
    return {"count": 0, "success": 0, "failure": 0}


def empty_tool_stats(tool_names: tuple[str, ...]) -> dict[str, dict[str, int]]:
    return {name: tool_stat() for name in tool_names}
