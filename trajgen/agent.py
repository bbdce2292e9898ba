"""The agent loop for one prompt: ask the model, run the tools it calls, repeat, build the row.

Ends on a reply without tool calls (completed) or after `max_turns` calls, when one last call
without tools asks for a final answer (partial). Tool results are matched to calls by id.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Callable

import openai

import model_tools
from trajgen import llm, trajectory
from trajgen.tools import ToolContext, ToolSpec
from trajgen.work import ModelSettings, Task

FINAL_ANSWER_REQUEST = "You have used all your tool-calling turns. Give your final answer now, without calling tools."


def _usage_add(total: dict, usage) -> None:
    if usage is None:
        return
    total["prompt_tokens"] += usage.prompt_tokens or 0
    total["completion_tokens"] += usage.completion_tokens or 0
    details = usage.completion_tokens_details
    total["reasoning_tokens"] += (details.reasoning_tokens or 0) if details else 0
    cost = (usage.model_extra or {}).get("cost")
    if isinstance(cost, (int, float)):
        total["cost"] = (total["cost"] or 0.0) + cost


def _run_messages(settings: ModelSettings, prompt: str) -> list[dict]:
    system = "\n\n".join(p for p in (settings.system_prompt, settings.ephemeral_system_prompt) if p)
    head = [{"role": "system", "content": system}] if system else []
    return [*head, *settings.prefill_messages, {"role": "user", "content": prompt}]


async def run_conversation(
    task: Task,
    client: openai.AsyncOpenAI,
    settings: ModelSettings,
    tools: list[ToolSpec],
    schemas: list[dict],
    ctx: ToolContext,
    on_throttle: Callable[[], None],
) -> dict:
    started = time.monotonic()
    messages = _run_messages(settings, task.prompt)
    conversation = [{"from": "system", "value": settings.system_prompt}] if settings.system_prompt else []
    conversation.append({"from": "human", "value": task.prompt})
    offered = {t.name: t for t in tools}
    stats = trajectory.empty_tool_stats(model_tools.ALL_TOOL_NAMES)
    hallucinated: list[str] = []
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "reasoning_tokens": 0, "cost": None}
    api_calls = reasoning_turns = assistant_turns = 0
    completed = False

    while True:
        final_call = api_calls == settings.max_turns
        if final_call:
            messages.append({"role": "user", "content": FINAL_ANSWER_REQUEST})
            conversation.append({"from": "human", "value": FINAL_ANSWER_REQUEST})
        # the last call still lists the tools (some providers refuse a history of tool calls without
        # them) but forbids using them
        response = await llm.complete(client, settings, messages, schemas, on_throttle, forbid_tools=final_call)
        api_calls += 1
        _usage_add(usage, response.usage)
        message = response.choices[0].message
        raw = message.model_dump(exclude_none=True)
        reasoning, content = trajectory.split_reasoning(raw)
        assistant_turns += 1
        reasoning_turns += bool(reasoning)
        calls = [] if final_call else [
            {"id": c.id or f"call_{api_calls}_{i}", "name": c.function.name, "raw": c.function.arguments}
            for i, c in enumerate(message.tool_calls or [])
        ]
        shown = [{"id": c["id"], "name": c["name"], "arguments": trajectory.parse_arguments(c["raw"])} for c in calls]
        conversation.append(trajectory.gpt_turn(reasoning, content, shown))
        sent = {"role": "assistant", "content": raw.get("content") or ""}
        if calls:
            sent["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["raw"]}} for c in calls
            ]
        messages.append(sent)
        if final_call:
            break
        if not calls:
            completed = True
            break
        for call in calls:
            result = await model_tools.dispatch(call["name"], call["raw"], offered, ctx)
            ok = bool(result.get("success"))
            entry = stats.setdefault(call["name"], {"count": 0, "success": 0, "failure": 0})
            entry["count"] += 1
            entry["success" if ok else "failure"] += 1
            if call["name"] not in offered and call["name"] not in hallucinated:
                hallucinated.append(call["name"])
            body = trajectory.envelope_json(result)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": body})
            conversation.append(trajectory.tool_turn(call["id"], call["name"], result))

    usage["api_calls"] = api_calls
    usage["wall_seconds"] = round(time.monotonic() - started, 3)
    metadata = {
        "batch_num": task.batch_num,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": settings.model,
        **{k: v for k, v in task.extra.items() if k not in ("batch_num", "timestamp", "model")},
        "prompt_key": task.key,
        "format_version": trajectory.FORMAT_VERSION,
        "toolsets_sampled": task.toolsets_sampled,
        "toolsets_offered": task.toolsets_offered,
        "hallucinated_tools": hallucinated,
        "assistant_turns": assistant_turns,
        "turns_with_reasoning": reasoning_turns,
        "usage": usage,
    }
    return {
        "prompt_index": task.prompt_index,
        "conversations": conversation,
        "metadata": metadata,
        "completed": completed,
        "partial": not completed,
        "api_calls": api_calls,
        "toolsets_used": task.toolsets_offered,
        "tool_stats": stats,
        "tool_error_counts": {name: s["failure"] for name, s in stats.items()},
    }
