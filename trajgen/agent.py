"""The agent loop for one prompt, and the row it becomes.

`run_conversation` asks the model, runs the tools it calls, and repeats until a reply without
tool calls (completed) or `max_turns` calls, when one last call without tools asks for a final
answer (partial), or until a reply cut by its token limit in the middle of its tool calls
(truncated: they are never run, their arguments may be cut short). It keeps one transcript, the
messages as sent; `render_row` turns that into the ShareGPT row, a pure function of the
conversation. Tool results are matched to calls by id.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable

from trajgen import context_budget, registry, samples, token_ids, tokenizer, trajectory, verify
from trajgen.model import ModelClient, Reply, add_usage, no_usage
from trajgen.simulated_user import FollowUp, Simulator
from trajgen.tools import ToolContext, ToolSpec
from trajgen.task import ModelSettings, Task

FINAL_ANSWER_REQUEST = "You have used all your tool-calling turns. Give your final answer now, without calling tools."


@dataclass
class Conversation:
    messages: list[dict]  # as sent: system, prefill, the prompt, then assistant/tool/user turns
    prompt_at: int  # index of the prompt's user message (what comes before it is never written)
    offered: tuple[str, ...]  # the tools offered
    tools: list[dict]  # their schemas, exactly as sent with every request
    replies: list[dict] = field(default_factory=list)  # each assistant message as the endpoint returned it
    served_by: list[dict] = field(default_factory=list)  # each distinct model/provider the responses named
    results: list[dict] = field(default_factory=list)  # each tool result, in the order of the tool messages
    usage: dict = field(default_factory=no_usage)
    timings: list[dict] = field(default_factory=list)  # each reply's timing (empty when it had none)
    finish_reasons: list = field(default_factory=list)  # each reply's finish reason, as the endpoint sent it
    simulated: list[int] = field(default_factory=list)  # indices of the messages a simulated user wrote
    episode_end: str = ""  # with a simulated user: why the episode ended (trajgen/simulated_user.py)
    user_model: str = ""  # the simulated user's model
    tokens: list = field(default_factory=list)  # each reply's ids (--token_ids, --tokenizer), None without them
    completed: bool = False  # ended on a reply without tool calls (else the forced final call ended it)
    truncated: bool = False  # ended on a reply whose tool calls the token limit cut (finish reason `length`)
    window: context_budget.Window | None = None  # --context_budget: the requests as sent, compacted
    wall_seconds: float = 0.0
    ended_at: str = ""

    def add_reply(self, reply: Reply, final_call: bool) -> list[dict]:
        """Append the assistant message as it will be sent back; returns its tool calls."""
        self.replies.append(reply.message)
        if reply.served_by and reply.served_by not in self.served_by:
            self.served_by.append(reply.served_by)
        add_usage(self.usage, reply.usage)
        self.timings.append(reply.timing)
        self.finish_reasons.append(reply.finish_reason)
        self.tokens.append(reply.tokens)
        calls = [] if final_call else [
            {"id": c.get("id") or f"call_{len(self.replies)}_{i}", "type": "function",
             "function": {"name": c["function"]["name"], "arguments": c["function"].get("arguments")}}
            for i, c in enumerate(reply.message.get("tool_calls") or [])]
        self.messages.append({"role": "assistant", "content": reply.message.get("content") or "",
                              **({"tool_calls": calls} if calls else {})})
        return calls


def start_messages(settings: ModelSettings, prompt: str) -> list[dict]:
    system = "\n\n".join(p for p in (settings.system_prompt, settings.ephemeral_system_prompt) if p)
    head = [{"role": "system", "content": system}] if system else []
    return [*head, *settings.prefill_messages, {"role": "user", "content": prompt}]


async def run_conversation(prompt: str, model: ModelClient, settings: ModelSettings, tools: list[ToolSpec],
                           schemas: list[dict], ctx: ToolContext, user: Simulator | None = None,
                           summarizer: Callable[[], ModelClient] | None = None) -> Conversation:
    """The agent's work on the prompt; with a simulated `user`, the whole episode: each final answer is
    followed up by the user's next message, until it stops, or the agent's own limits end it.
    `summarizer`: the prompt's summary model, for --context_budget's compactions."""
    started = time.monotonic()
    messages = start_messages(settings, prompt)
    conv = Conversation(messages, len(messages) - 1, tuple(t.name for t in tools), schemas)
    if settings.context_budget and summarizer:
        conv.window = context_budget.Window(settings.context_budget, settings.tokenizer, summarizer)
    offered = {t.name: t for t in tools}
    conv.user_model = user.model_name if user else ""
    while True:
        await _answer(conv, model, settings, offered, ctx)
        if user is None:
            break
        said = await user.follow_up(messages, conv.replies, conv.prompt_at) if conv.completed else None
        if not isinstance(said, FollowUp):
            conv.episode_end = said.reason if said else "truncated" if conv.truncated else "max_turns"
            break
        messages.append({"role": "user", "content": said.text})
        conv.simulated.append(len(messages) - 1)
    conv.wall_seconds = round(time.monotonic() - started, 3)
    conv.ended_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return conv


async def _answer(conv: Conversation, model: ModelClient, settings: ModelSettings, offered: dict[str, ToolSpec],
                  ctx: ToolContext) -> None:
    """One human turn's work: calls and tools until a reply without tool calls, or --max_turns calls and
    the forced final answer, or tool calls cut by the token limit."""
    messages = conv.messages
    reply = None
    for turn in range(settings.max_turns + 1):
        final_call = turn == settings.max_turns
        if final_call:
            messages.append({"role": "user", "content": FINAL_ANSWER_REQUEST})
        sent = messages if conv.window is None else await conv.window.fit(
            messages, conv.tools, reply and reply.usage.get("prompt_tokens"), len(conv.replies))
        reply = await model.complete(sent, conv.tools, forbid_tools=final_call)
        calls = conv.add_reply(reply, final_call)
        if not calls:
            conv.completed = not final_call
            break
        if reply.finish_reason == "length":
            conv.truncated = True
            break
        for call in calls:
            result = await registry.dispatch(call["function"]["name"], call["function"]["arguments"], offered, ctx)
            conv.results.append(result)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": trajectory.envelope_json(trajectory.sent_result(result))})


def final_answer(conv: Conversation) -> str:
    """The text of the last reply, without its reasoning: what a verify command checks."""
    return trajectory.split_reasoning(conv.replies[-1])[1]


def render_row(task: Task, conv: Conversation, settings: ModelSettings, mcp_tool_names: tuple[str, ...] = (), *,
               replayed: int = 0, stalls: int = 0, check: verify.Check = verify.UNVERIFIED) -> dict:
    """The trajectory row: ShareGPT turns (the system prompt as configured, never the ephemeral
    part or the prefill), each with its `message` exactly as sent (a gpt turn also with its
    `reasoning`), the tools offered, per-tool counts (of every tool of the run, the MCP servers'
    included, so every row has the same keys), the metadata the statistics read, and the verify check.
    `replayed`: calls the journal answered (counted in the usage, not paid again); `stalls`: calls
    abandoned for silence and asked again."""
    turns = [{"from": "system", "value": settings.system_prompt,
              "message": {"role": "system", "content": settings.system_prompt}}] if settings.system_prompt else []
    turns.append({"from": "human", "value": task.prompt, "message": conv.messages[conv.prompt_at]})
    stats = trajectory.empty_tool_stats((*registry.ALL_TOOL_NAMES, *mcp_tool_names))
    hallucinated: list[str] = []
    replies, results, pending = iter(conv.replies), iter(conv.results), iter(())
    with_ids = bool(settings.token_ids or settings.tokenizer)
    sampling = {"temperature": settings.temperature, "top_p": settings.top_p, "max_tokens": settings.max_tokens}
    tokens, finish_reasons, turn_ids = iter(conv.tokens), iter(conv.finish_reasons), []
    reasoning_turns = 0
    for at, message in enumerate(conv.messages[conv.prompt_at + 1:], conv.prompt_at + 1):
        if message["role"] == "user":
            simulated = {"simulated": True} if at in conv.simulated else {}
            turns.append({"from": "human", "value": message["content"], "message": message, **simulated})
        elif message["role"] == "assistant":
            reply = next(replies)
            reasoning, content = trajectory.split_reasoning(reply)
            reasoning_turns += bool(reasoning)
            calls = [{"id": c["id"], "name": c["function"]["name"],
                      "arguments": trajectory.parse_arguments(c["function"]["arguments"])}
                     for c in message.get("tool_calls", [])]
            pending = iter(calls)  # the tool messages that follow answer these calls, in order
            turns.append({**trajectory.gpt_turn(reasoning, content, calls), "message": message,
                          "reasoning": trajectory.reply_reasoning(reply)})
            ids, finish_reason = next(tokens), next(finish_reasons)
            if with_ids and ids is not None:
                turn_ids.append(ids)
                turns[-1]["tokens"] = token_ids.turn_tokens(ids, finish_reason, sampling)
        else:
            name, result = next(pending)["name"], next(results)
            entry = stats.setdefault(name, trajectory.tool_stat())
            entry["count"] += 1
            entry["success" if result.get("success") else "failure"] += 1
            if name not in conv.offered and name not in hallucinated:
                hallucinated.append(name)
            turns.append({**trajectory.tool_turn(message["tool_call_id"], name, result), "message": message})
    metadata = {
        "prompt_key": task.key, "batch_num": task.batch_num, "timestamp": conv.ended_at, "model": settings.model,
        **{k: v for k, v in task.extra.items() if k not in ("prompt_key", "batch_num", "timestamp", "model")},
        "group_id": task.group_id or task.key, "sample_index": task.sample_index,
        "format_version": trajectory.FORMAT_VERSION,
        "toolsets_sampled": task.toolsets_sampled, "toolsets_offered": task.toolsets_offered,
        "request": request_provenance(settings, conv.served_by),
        "dataset": {"fingerprint": task.dataset_fingerprint, "line": task.prompt_index + 1},
        "hallucinated_tools": hallucinated, "assistant_turns": len(conv.replies), "turns_with_reasoning": reasoning_turns,
        "finish_reasons": conv.finish_reasons,
        "usage": {**conv.usage, "api_calls": len(conv.replies), "wall_seconds": conv.wall_seconds,
                  "replayed": replayed, "stalls": stalls},
        "latency": {k: [t[k] for t in conv.timings if k in t] for k in trajectory.LATENCY_KEYS},
        **({"episode": {"ended": conv.episode_end, "user_turns": len(conv.simulated), "user_model": conv.user_model}}
           if conv.episode_end else {}),
    }
    if with_ids:
        tok = tokenizer.load(settings.tokenizer) if settings.tokenizer else None
        metadata["token_ids"] = token_ids.row_metadata(settings.token_ids, tok, turn_ids)
    if conv.window is not None:  # the requests sent shorter than the transcript, where and how (docs/compress.md)
        metadata["compactions"] = conv.window.compactions
        metadata["requests_over_budget"] = conv.window.over_budget
    if ids := [turn["tokens"] for turn in turns if "tokens" in turn]:  # --token_ids (trajgen/samples.py)
        compacted = {c["before_turn"] for c in conv.window.compactions} if conv.window else ()
        metadata.setdefault("token_ids", {}).update(samples.fields(ids, compacted))
    return {
        "prompt_index": task.prompt_index, "metadata": metadata, "conversations": turns, "tools": conv.tools,
        "completed": conv.completed, "partial": not (conv.completed or conv.truncated), "truncated": conv.truncated,
        "api_calls": len(conv.replies),
        "toolsets_used": task.toolsets_offered, "tool_stats": stats,
        "tool_error_counts": {name: s["failure"] for name, s in stats.items()}, "verify": check.as_row(),
    }


def request_provenance(settings: ModelSettings, served_by: list[dict]) -> dict:
    """What a re-run must send to ask the same thing: the settings as resolved into each request
    (the ephemeral system prompt and the prefill excluded by design), and who answered."""
    return {"model": settings.model, "served_by": served_by, "system_prompt": settings.system_prompt,
            "max_turns": settings.max_turns, "temperature": settings.temperature, "top_p": settings.top_p,
            "max_tokens": settings.max_tokens, "reasoning_effort": settings.reasoning_effort,
            "extra_body": settings.extra_body}
