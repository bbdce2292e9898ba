"""The simulated user: after each final answer of the agent it writes the next human turn, or ends
the episode (tau2-bench's `###STOP###`).

It sees what a user would: its own messages (the dataset's prompt and its follow-ups) and the
agent's texts to it, never the tool calls, results or reasoning. Its prompt is in
docs/simulated-user.md; its model is a side model (trajgen/roles.py), counted apart.
"""
from __future__ import annotations

from dataclasses import dataclass

from trajgen import trajectory
from trajgen.errors import EmptyAnswer
from trajgen.model import ModelClient

STOP = "###STOP###"
ENDINGS = ("user_stop", "max_user_turns", "user_empty")  # the simulator's; the agent's own are its row's
SYSTEM_PROMPT = """You are playing a user who talks with an AI assistant. Stay in character: write only what \
this user would write next to the assistant, in the first person, briefly, as plain text. Do not solve the \
task yourself and do not mention that you are simulated.
{about}
When your goal is met, or the assistant clearly cannot help any further, reply with {stop} and nothing else."""
ABOUT_FOR_ALL = "Your goal: get the assistant to do well what your first message asks."


@dataclass(frozen=True)
class FollowUp:
    text: str


@dataclass(frozen=True)
class Ended:
    reason: str  # one of ENDINGS


def system_prompt(user: dict | None) -> str:
    """The simulator's instructions for this row's user (persona, goal, instructions; any of them)."""
    if not user:
        return SYSTEM_PROMPT.format(about=ABOUT_FOR_ALL, stop=STOP)
    about = "\n".join(f"Your {key}: {user[key].strip()}" for key in ("persona", "goal", "instructions") if key in user)
    return SYSTEM_PROMPT.format(about=about, stop=STOP)


def users_view(system: str, messages: list[dict], replies: list[dict], simulated_from: int) -> list[dict]:
    """The conversation as the simulator sees it, roles swapped (it plays the user, so its own turns are
    `assistant`): the human turns from the dataset's prompt on (`simulated_from` is its index), and each
    text the agent wrote, without reasoning and without its tool calls."""
    view = [{"role": "system", "content": system}]
    answers = iter(replies)
    for message in messages[simulated_from:]:
        if message["role"] == "user":
            view.append({"role": "assistant", "content": message["content"]})
        elif message["role"] == "assistant":
            text = trajectory.split_reasoning(next(answers))[1].strip()
            if text:
                view.append({"role": "user", "content": text})
    return view


class Simulator:
    """One episode's simulated user: `follow_up` after each final answer of the agent."""

    def __init__(self, model: ModelClient, user: dict | None, max_turns: int, model_name: str):
        self.model, self.system, self.max_turns, self.model_name = model, system_prompt(user), max_turns, model_name
        self.turns = 0  # simulated human turns written so far

    async def follow_up(self, messages: list[dict], replies: list[dict], prompt_at: int) -> FollowUp | Ended:
        if self.turns >= self.max_turns:
            return Ended("max_user_turns")
        try:
            reply = await self.model.complete(users_view(self.system, messages, replies, prompt_at), [], False)
        except EmptyAnswer:  # paid for (Metered counts it) and nothing to say: the episode ends
            return Ended("user_empty")
        text = trajectory.split_reasoning(reply.message)[1].strip()  # a thinking simulator's thoughts stay its own
        if STOP in text:
            return Ended("user_stop")
        if not text:  # a reply of tool calls only: nothing a user says
            return Ended("user_empty")
        self.turns += 1
        return FollowUp(text)
