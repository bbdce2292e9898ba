"""Samples split exactly where the extension property breaks, and nowhere else, each break with its cause
(trajgen/samples.py).

The template cases render real conversations with Qwen3's chat template (tests/chat_templates, through
transformers' own rendering) and take each character as one token: the extension property is about
the text a template renders, and characters keep it free of any tokenizer's merges.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from trajgen.samples import Break, Cause, Sample, fields, split

TEMPLATE = Path(__file__).parent / "chat_templates" / "qwen3.jinja"
END = "<|im_end|>"  # Qwen3's end of turn, the last token of each completion


def call(prompt: list[int], completion: list[int]) -> dict:
    return {"prompt_ids": prompt, "completion_ids": completion}


def test_a_conversation_that_extends_stays_one_sample():
    turns = [call([1, 2], [3, 4]), call([1, 2, 3, 4, 5], [6]), call([1, 2, 3, 4, 5, 6], [7, 8])]
    assert split(turns) == ([Sample(0, 2)], [])
    assert split([]) == ([], [])


@pytest.mark.parametrize("prompt, cause", [
    ([1, 2, 5, 6, 9], Cause.REASONING_DROPPED),  # the leading 3, 4 of the completion left out, the rest kept
    ([1, 2, 3, 4, 7, 9], Cause.CALL_RERENDERED),  # the completion's 5, 6 written again as 7
    ([1, 0, 3, 4, 5, 6, 9], Cause.CONTEXT_CHANGED),  # a prompt token changed
    ([1, 2, 3], Cause.CONTEXT_CHANGED),  # the sequence cut short
])
def test_a_break_starts_a_sample_with_the_cause_read_where_the_prompt_differs(prompt, cause):
    turns = [call([1, 2], [3, 4, 5, 6]), call(prompt, [10]), call([*prompt, 10, 11], [12])]
    assert split(turns) == ([Sample(0, 0), Sample(1, 2)], [Break(1, cause)])


def test_an_earlier_completion_rendered_differently_names_that_completion():
    """The break is found in the first turn's completion although the second one's is intact."""
    turns = [call([1], [2, 3]), call([1, 2, 3, 4], [5]), call([1, 3, 4, 5, 6], [7])]
    assert split(turns) == ([Sample(0, 1), Sample(2, 2)], [Break(2, Cause.REASONING_DROPPED)])


def test_a_think_block_of_the_generation_prompt_dropped_before_an_intact_completion_is_reasoning():
    """An empty think block (8, 9) at the end of the prompt, left out when the reply is rendered again."""
    turns = [call([1, 2, 8, 9], [3, 4]), call([1, 2, 3, 4, 7], [5])]
    assert split(turns) == ([Sample(0, 0), Sample(1, 1)], [Break(1, Cause.REASONING_DROPPED)])


def test_a_compaction_always_starts_a_sample():
    turns = [call([1], [2]), call([1, 2, 3], [4]), call([1, 2, 3, 4, 5], [6])]
    assert split(turns, compactions={2}) == ([Sample(0, 1), Sample(2, 2)], [Break(2, Cause.COMPACTED)])
    assert fields(turns, compactions={2}) == {"samples": [{"first_turn": 0, "last_turn": 1},
                                                          {"first_turn": 2, "last_turn": 2}],
                                              "breaks": [{"turn": 2, "cause": "compacted"}]}


def _render(messages: list[dict], **options) -> list[int]:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], tools=None, chat_template=TEMPLATE.read_text(),
                                        add_generation_prompt=True, **options)
    return [ord(c) for c in rendered[0]]


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def _qwen3_turns(arguments_written: str) -> list[dict]:
    """A tool call, its result, an answer, then a new user message: what Qwen3's template renders for
    each call, the model's completions as it writes them (`arguments_written`: its call's arguments)."""
    call_text = f'<tool_call>\n{{"name": "terminal", "arguments": {arguments_written}}}\n</tool_call>'
    messages = [{"role": "user", "content": "list the files"}]
    first = call(_render(messages), _ids(f"<think>\nplan\n</think>\n\n{call_text}{END}"))
    terminal = {"type": "function", "function": {"name": "terminal", "arguments": {"command": "ls"}}}
    messages += [{"role": "assistant", "content": "", "reasoning_content": "plan", "tool_calls": [terminal]},
                 {"role": "tool", "content": "a.txt"}]
    second = call(_render(messages), _ids(f"<think>\ndone\n</think>\n\none file{END}"))
    messages += [{"role": "assistant", "content": "one file", "reasoning_content": "done"},
                 {"role": "user", "content": "and now?"}]
    return [first, second, call(_render(messages), _ids(f"nothing else{END}"))]


def test_qwen3_dropping_earlier_reasoning_after_a_user_turn_is_a_reasoning_break():
    pytest.importorskip("transformers")
    assert split(_qwen3_turns('{"command": "ls"}')) == ([Sample(0, 1), Sample(2, 2)],
                                                        [Break(2, Cause.REASONING_DROPPED)])


def test_qwen3_without_thinking_drops_the_empty_think_block_it_prompted_with():
    """With enable_thinking=False the generation prompt ends in an empty think block, which the
    template leaves out when it renders the reply again: every tool call breaks the sample."""
    pytest.importorskip("transformers")
    terminal = {"type": "function", "function": {"name": "terminal", "arguments": {"command": "ls"}}}
    messages = [{"role": "user", "content": "list the files"}]
    first = call(_render(messages, enable_thinking=False),
                 _ids(f'<tool_call>\n{{"name": "terminal", "arguments": {{"command": "ls"}}}}\n</tool_call>{END}'))
    messages += [{"role": "assistant", "content": "", "tool_calls": [terminal]}, {"role": "tool", "content": "a.txt"}]
    second = call(_render(messages, enable_thinking=False), _ids(f"one file{END}"))
    assert split([first, second]) == ([Sample(0, 0), Sample(1, 1)], [Break(1, Cause.REASONING_DROPPED)])


def test_a_call_the_template_writes_with_other_spacing_is_a_rerendered_call():
    """The reasoning dropped at the third call lies in the second sample's first prompt, outside its
    completions: there it reads as a changed context."""
    pytest.importorskip("transformers")
    assert split(_qwen3_turns('{"command":"ls"}')) == ([Sample(0, 0), Sample(1, 1), Sample(2, 2)],
                                                       [Break(1, Cause.CALL_RERENDERED),
                                                        Break(2, Cause.CONTEXT_CHANGED)])
