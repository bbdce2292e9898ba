"""Rows and exports replay exactly what the model saw, with the tools it was given, and each export
is taken as it is by the trainer of its convention.

One whole run in process (tests/support/inline.py) against the scripted server (its request log
is the ground truth): a row with two calls in one assistant turn, envelope tags and their escaped
forms in the model's text, reasoning, arguments and tool outputs; a partial row; a failed prompt.
Then every export (the hf one by the real CLI), rendered with the chat templates TRL ships
(tests/chat_templates, through transformers' own rendering) and checked against LLaMA-Factory's
documented sharegpt rules.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import read_jsonl, write_jsonl
from trajgen.agent import FINAL_ANSWER_REQUEST
from trajgen import conventions

TRICKY = "</think> <tool_call> </tool_response> &lt;think>"
SCRIPT = {"prompts": {
    "edit": [
        {"content": f"Let me write {TRICKY} safely.", "reasoning": f"plan {TRICKY} it",
         "tool_calls": [{"name": "write_file", "arguments": {"path": "a.txt", "content": f"x{TRICKY}y"}},
                        {"name": "terminal", "arguments": {"command": "cat a.txt"}}]},
        {"content": f"All done: {TRICKY}", "reasoning": f"check {TRICKY}"},
    ],
    "tags": [{"content": f"<think>inline</think>final {TRICKY}", "model": "scripted-2026-01", "provider": "Acme"}],
    "budget": [
        {"reasoning": "look", "tool_calls": [{"name": "terminal", "arguments": {"command": "printf '</tool_response>'"}}]},
        {"reasoning": "again", "tool_calls": [{"name": "terminal", "arguments": {"command": "echo '&lt;think>'"}}]},
        {"content": f"forced {TRICKY}", "reasoning": f"wrap {TRICKY}"},
    ],
    "broken": [{"status": 400, "error": "refused"}],
}}
PROMPTS = {"edit": "row-1", "tags": "row-2", "budget": "row-3", "broken": "row-4"}
EXPORTED = {"row-1", "row-2", "row-3"}  # row-4 failed
FORMATS = ("hf", "openai", "sharegpt", "hermes", "parquet")
FILES = {"hf": "export_hf.jsonl", "openai": "export_openai.jsonl", "sharegpt": "export_sharegpt.jsonl",
         "hermes": "export_hermes.jsonl", "parquet": "export.parquet"}
TEMPLATES = Path(__file__).parent / "chat_templates"  # as shipped in the trl 1.16.0 wheel (Apache-2.0)
TRAINING_TEMPLATE = Path(conventions.__file__).parent / "trainers" / "qwen3_training.jinja"  # exports write it beside them
LLAMA_FACTORY_TAGS = ({"human", "observation"}, {"gpt", "function_call"})  # odd and even positions after the system turn


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run and its exports (partial rows included), made once for the module's tests: the hf export
    by the real CLI, the run and the other exports in process."""
    from tests.conftest import CLI
    from tests.support.inline import Inline
    from tests.support.scripted_server import start_server

    tmp = tmp_path_factory.mktemp("rows")
    inline = Inline(tmp)
    server = start_server(SCRIPT, log_path=tmp / "requests.jsonl")
    try:
        write_jsonl(tmp / "prompts.jsonl", [{"prompt": p, "id": i} for p, i in PROMPTS.items()])
        done = inline.run(*inline.args(server, temperature=0.3, max_turns=2, distribution="default", max_retries=0))
        assert done.returncode == 1, done.stderr  # the broken prompt failed
        for fmt in FORMATS:
            runner = CLI(tmp) if fmt == "hf" else inline
            exported = runner.run(f"--export={fmt}", "--run_name=run", "--export_partial")
            assert exported.returncode == 0, exported.stderr
        yield inline, [r for r in server.requests() if r["status"] == 200]
    finally:
        server.stop()


def _by_id(records: list[dict]) -> dict[str, dict]:
    return {r["provenance"]["dataset_id"]: r for r in records}


def _exported(inline, fmt: str) -> dict[str, dict]:
    """The export's records by dataset id; the openai export's with our keys from its side file, by line."""
    records = read_jsonl(inline.run_dir() / FILES[fmt])
    if fmt == "openai":
        side = read_jsonl(inline.run_dir() / "export_openai.provenance.jsonl")
        assert [s.pop("line") for s in side] == list(range(1, len(records) + 1))
        records = [{**record, **ours} for record, ours in zip(records, side)]
    return _by_id(records)


def _last_request(requests: list[dict], prompt: str) -> dict:
    return max((r for r in requests if r["prompt"] == prompt), key=lambda r: r["turn"])["body"]


def _loaded(inline, fmt: str) -> dict[str, dict]:
    """The export as `datasets` gives it to a trainer."""
    datasets = pytest.importorskip("datasets")
    loader = "parquet" if fmt == "parquet" else "json"
    return _by_id(datasets.load_dataset(loader, data_files=str(inline.run_dir() / FILES[fmt]), split="train",
                                        cache_dir=str(inline.cwd / "hf-cache")))


def _without_nulls(value):
    """A record without the null fields `datasets` adds where a message has no such key."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def test_openai_export_replays_the_last_request_and_the_reply(run):
    inline, requests = run
    exported = _exported(inline, "openai")
    assert set(exported) == EXPORTED
    for prompt, dataset_id in PROMPTS.items():
        if dataset_id not in exported:
            continue
        messages, sent = exported[dataset_id]["messages"], _last_request(requests, prompt)
        assert messages[:-1] == sent["messages"], prompt  # roles, contents byte for byte, call ids, names, arguments
        final = SCRIPT["prompts"][prompt][-1]
        assert messages[-1] == {"role": "assistant", "content": final["content"]}  # no reasoning: not the API's format
        assert exported[dataset_id]["tools"] == sent["tools"]
    edit = exported["row-1"]["messages"]
    assert "\\u003c/tool_response>" in edit[4]["content"]  # the tool result as the model received it
    budget = exported["row-3"]["messages"]
    assert budget[-2] == {"role": "user", "content": FINAL_ANSWER_REQUEST}  # the model saw it: the row has it


def test_every_export_record_carries_completion_outcome_and_provenance(run):
    inline, _ = run
    manifest = json.loads((inline.run_dir() / "manifest.json").read_text())
    for fmt in FORMATS:
        records = _exported(inline, fmt) if fmt != "parquet" else _loaded(inline, fmt)
        assert set(records) == EXPORTED - ({"row-1"} if fmt == "sharegpt" else set()), fmt  # see the sharegpt test
        for dataset_id, record in records.items():
            assert (record["completed"], record["partial"]) == ((False, True) if dataset_id == "row-3" else (True, False))
            assert (record["verify"]["status"], record["reward"]) == ("unverified", None), fmt
            origin = record["provenance"]
            assert origin["run_name"] == "run" and origin["group_id"] == origin["prompt_key"], fmt
            # pytest.approx: `datasets` decodes JSON-typed fields with pandas' ujson, which reads 0.3 as 0.30000000000000004
            assert origin["settings"]["temperature"] == pytest.approx(0.3), fmt
            assert origin["dataset"]["fingerprint"] == manifest["dataset"]["fingerprint"], fmt


def test_every_row_carries_the_tools_of_its_requests_and_its_provenance(run):
    inline, requests = run
    rows = {r["metadata"]["id"]: r for r in read_jsonl(inline.run_dir() / "trajectories.jsonl")}
    batch_rows = {r["metadata"]["id"]: r for r in read_jsonl(inline.run_dir() / "batch_0.jsonl")}
    manifest = json.loads((inline.run_dir() / "manifest.json").read_text())
    for prompt, dataset_id in PROMPTS.items():
        if dataset_id not in EXPORTED:
            continue
        row = rows[dataset_id]
        assert row == batch_rows[dataset_id]
        sent_tools = [r["body"]["tools"] for r in requests if r["prompt"] == prompt]
        assert sent_tools and all(tools == row["tools"] for tools in sent_tools)
        assert sorted(t["function"]["name"] for t in row["tools"]) == sorted(
            n for n, s in row["tool_stats"].items() if n in {t["function"]["name"] for t in row["tools"]})
        meta = row["metadata"]
        assert meta["format_version"] == 2
        assert meta["dataset"] == {"fingerprint": manifest["dataset"]["fingerprint"], "line": row["prompt_index"] + 1}
        request = meta["request"]
        assert request["model"] == "test-model" and request["temperature"] == 0.3 and request["max_turns"] == 2
        assert request["system_prompt"] == _last_request(requests, prompt)["messages"][0]["content"]
        assert meta["toolsets_offered"] and set(meta["toolsets_offered"]) <= set(meta["toolsets_sampled"])
    assert rows["row-2"]["metadata"]["request"]["served_by"] == [{"model": "scripted-2026-01", "provider": "Acme"}]
    assert rows["row-1"]["metadata"]["request"]["served_by"] == [{"model": "test-model"}]
    assert rows["row-3"]["partial"] and rows["row-3"]["conversations"][-2]["value"] == FINAL_ANSWER_REQUEST


def test_hf_export_has_arguments_as_objects_and_named_results(run):
    inline, _ = run
    hf, openai = _exported(inline, "hf"), _exported(inline, "openai")
    for dataset_id, record in hf.items():
        sent = openai[dataset_id]["messages"]
        assert len(record["messages"]) == len(sent) and record["tools"] == openai[dataset_id]["tools"]
        for ours, theirs in zip(record["messages"], sent):
            if theirs.get("tool_calls"):
                assert [c["function"]["arguments"] for c in ours["tool_calls"]] == [
                    json.loads(c["function"]["arguments"]) for c in theirs["tool_calls"]]
            elif theirs["role"] == "tool":
                assert ours == {**theirs, "name": ours["name"]}
            else:  # the reasoning is the one difference: the hf convention has it, the API's has not
                assert {k: v for k, v in ours.items() if k != "reasoning_content"} == theirs
    edit = hf["row-1"]["messages"]
    assert [m["name"] for m in edit if m["role"] == "tool"] == ["write_file", "terminal"]
    assert edit[2]["tool_calls"][0]["function"]["arguments"] == {"path": "a.txt", "content": f"x{TRICKY}y"}


def test_hf_and_parquet_exports_load_with_datasets_as_they_were_written(run):
    inline, _ = run
    written = _exported(inline, "hf")
    for fmt in ("hf", "parquet"):
        loaded = _loaded(inline, fmt)
        for dataset_id, record in loaded.items():  # no json.loads: arguments and schemas come back as objects
            assert _without_nulls({k: record[k] for k in ("messages", "tools")}) == {
                k: written[dataset_id][k] for k in ("messages", "tools")}, fmt


def _template(name: str) -> Path:
    return TRAINING_TEMPLATE if name == TRAINING_TEMPLATE.name else TEMPLATES / name


def _render(template: str, record: dict, mask: bool = False):
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, spans = render_jinja_template(conversations=[record["messages"]], tools=record["tools"],
                                            chat_template=_template(template).read_text(),
                                            return_assistant_tokens_mask=mask)
    return rendered[0], spans[0] if mask else None


@pytest.mark.parametrize("template", ["qwen2_5.jinja", "qwen3.jinja", "qwen2_5_training.jinja", "qwen3_training.jinja"])
def test_hf_export_renders_each_tool_call_and_result_once_with_trls_templates(run, template):
    pytest.importorskip("transformers")
    inline, _ = run
    for fmt in ("hf", "parquet"):
        for dataset_id, record in _loaded(inline, fmt).items():
            record = _without_nulls(record)
            text, _ = _render(template, record)
            for tool in record["tools"]:
                assert text.count(json.dumps(tool, ensure_ascii=False)) == 1, (fmt, dataset_id)
            calls = [c["function"] for m in record["messages"] for c in m.get("tool_calls", [])]
            for call in calls:  # arguments as an object: once, and never a JSON string inside JSON
                rendered = f'{{"name": "{call["name"]}", "arguments": {json.dumps(call["arguments"], ensure_ascii=False)}}}'
                assert text.count(rendered) == 1, (fmt, dataset_id, rendered)
            assert '"arguments": "' not in text, (fmt, dataset_id)
            assert text.count("<tool_call>\n{") == len(calls) + 1, (fmt, dataset_id)  # + the system turn's example
            for result in (m["content"] for m in record["messages"] if m["role"] == "tool"):
                assert text.count(f"<tool_response>\n{result}\n</tool_response>") == 1, (fmt, dataset_id)
    edit = _render(template, _exported(inline, "hf")["row-1"])[0]
    assert edit.count("<tool_call>\n{") == 3  # two calls in one turn, and the system turn's example
    assert f'"content": "x{TRICKY}y"' in edit  # the literal tags of the arguments, unescaped


@pytest.mark.parametrize("template", ["qwen2_5_training.jinja", "qwen3_training.jinja"])
def test_assistant_only_masks_cover_exactly_the_assistant_turns(run, template):
    pytest.importorskip("transformers")
    inline, _ = run
    for dataset_id, record in _exported(inline, "hf").items():
        text, spans = _render(template, record, mask=True)
        assistants = [m for m in record["messages"] if m["role"] == "assistant"]
        assert len(spans) == len(assistants), dataset_id
        for (start, end), message in zip(spans, assistants):  # from the turn's header to its end, and nothing else
            assert text[:start].rstrip("\n").endswith("<|im_start|>assistant"), dataset_id
            span = text[start:end]
            assert span.endswith("<|im_end|>\n") and "<|im_start|>" not in span, dataset_id
            assert span.count("<tool_call>\n{") == len(message.get("tool_calls", [])), dataset_id
        outside = "".join(text[end:start] for (_, end), (start, _) in zip([(0, 0), *spans], [*spans, (len(text), 0)]))
        dialogue = outside.split("<|im_end|>", 1)[1]  # after the system turn and its tool list
        assert "<tool_call>" not in dialogue and "<tool_response>" in dialogue or dataset_id == "row-2", dataset_id
        for said in (m["content"].split("</think>")[-1].strip() for m in assistants):
            assert not said or said not in dialogue, dataset_id


def _llama_factory_accepts(record: dict) -> bool:
    """LLaMA-Factory's SharegptDatasetConverter checks with the default tags (its data/README.md)."""
    turns = record["conversations"]
    if turns and turns[0]["from"] == "system":
        turns = turns[1:]
    return len(turns) % 2 == 0 and all(t["from"] in LLAMA_FACTORY_TAGS[i % 2] for i, t in enumerate(turns))


def _calls(value: str) -> list[dict]:
    """A function_call turn's calls as LLaMA-Factory 0.9.5's FunctionFormatter reads them: its first
    <tool_call>…</tool_call> (tests/test_exports_trainers.py follows the formatter in full)."""
    return json.loads(re.search("<tool_call>(.*?)</tool_call>", value, flags=re.DOTALL).group(1))


def test_sharegpt_export_follows_llama_factorys_default_tags_with_the_text_the_model_saw(run):
    inline, _ = run
    sharegpt, hf = _exported(inline, "sharegpt"), _exported(inline, "hf")
    for dataset_id, record in sharegpt.items():
        assert _llama_factory_accepts(record), dataset_id
        assert json.loads(record["tools"]) == hf[dataset_id]["tools"]  # a JSON text column, as its ToolFormatter reads it
        messages = hf[dataset_id]["messages"]
        assert record["conversations"][0] == {"from": "system", "value": messages[0]["content"]}  # no <tools> text in it
        calls = [c["function"] for m in messages for c in m.get("tool_calls", [])]
        turns = [t for t in record["conversations"] if t["from"] == "function_call"]
        assert [c for t in turns for c in _calls(t["value"])] == calls
        results = [m["content"] for m in messages if m["role"] == "tool"]
        observed = "\n".join(t["value"] for t in record["conversations"] if t["from"] == "observation")
        assert all(observed.count(r) == 1 for r in results), dataset_id
    assert "row-1" not in sharegpt  # a call turn's reasoning holds <tool_call>: LLaMA-Factory would read it as the calls
    assert sharegpt["row-2"]["conversations"][-1]["value"] == f"<think>\ninline\n</think>\n\nfinal {TRICKY}"
    budget = sharegpt["row-3"]["conversations"]  # the forced request ends the last observation
    assert [t["from"] for t in budget] == ["system", "human", "function_call", "observation", "function_call",
                                           "observation", "gpt"]
    assert budget[-2]["value"].endswith(f"\n\n{FINAL_ANSWER_REQUEST}")


def test_hermes_export_has_a_self_contained_hermes_system_turn(run):
    inline, _ = run
    exported = _exported(inline, "hermes")
    rows = {r["metadata"]["id"]: r for r in read_jsonl(inline.run_dir() / "trajectories.jsonl")}
    for dataset_id, record in exported.items():
        system = record["conversations"][0]
        assert system["from"] == "system" and system["value"].startswith(rows[dataset_id]["conversations"][0]["value"])
        listing = system["value"].split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
        assert json.loads(listing) == record["tools"] == rows[dataset_id]["tools"]
        assert record["conversations"][1:] == rows[dataset_id]["conversations"][1:]
    edit = exported["row-1"]["conversations"]
    assert "&lt;/think> &lt;tool_call>" in edit[2]["value"] and "</think>" not in edit[2]["value"].split("\n</think>", 1)[1]


def test_the_packaged_smollm2_template_renders_the_hermes_text_whole(run):
    """SmolLM2's chat template renders role and content only (no `tools`, no `tool_calls`): with it,
    train on the hermes export's text, which carries the tools and the calls."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from trajgen.local_model import model_path

    inline, _ = run
    template = llama_cpp.Llama(str(model_path()), vocab_only=True, verbose=False).metadata["tokenizer.chat_template"]
    render = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template).render
    roles = {"system": "system", "human": "user", "gpt": "assistant", "tool": "tool"}
    record = _exported(inline, "hermes")["row-1"]
    text = render(messages=[{"role": roles[t["from"]], "content": t["value"]} for t in record["conversations"]],
                  add_generation_prompt=False)
    system, dialogue = text.split("<|im_end|>", 1)
    assert "<tools>" in system and dialogue.count("<tool_call>\n") == 2 and dialogue.count("<tool_response>\n") == 2
    assert all(t["value"] in text for t in record["conversations"])
    hf = _exported(inline, "hf")["row-1"]
    assert "write_file" not in render(messages=hf["messages"], tools=hf["tools"])  # why not the hf export


def test_an_export_leaves_partial_rows_out_and_says_what_comes_next(run):
    inline, _ = run
    run_dir = inline.run_dir()
    rows = run_dir / "trajectories.jsonl"
    os.utime(rows, ns=(rows.stat().st_atime_ns, (run_dir / FILES["hermes"]).stat().st_mtime_ns + 1))
    done = inline.run("--export=sharegpt", "--run_name=run")
    assert done.returncode == 0, done.stderr
    assert set(_exported(inline, "sharegpt")) == EXPORTED - {"row-3", "row-1"}
    notes = " ".join(done.stderr.split())
    assert "1 partial row(s) left out" in notes and "--export_partial includes them" in notes
    assert "1 row(s) left out: a call turn's reasoning or text holds a literal <tool_call>" in notes
    assert "the run has 1 failed and 0 not yet run prompt(s)" in notes
    assert "export_hermes.jsonl is older than trajectories.jsonl" in notes and "export_sharegpt.jsonl is older" not in notes
    assert f"llamafactory-cli train {run_dir.resolve() / 'llamafactory.yaml'}" in done.stdout


def test_rows_of_an_older_format_are_refused_by_name(run):
    inline, _ = run
    old = inline.run_dir("old")
    shutil.copytree(inline.run_dir(), old, ignore=shutil.ignore_patterns("export*", ".runner.lock"))
    rows = read_jsonl(old / "trajectories.jsonl")
    rows[0]["metadata"]["format_version"] = 1
    write_jsonl(old / "trajectories.jsonl", rows)
    done = inline.run("--export=hf", "--run_name=old")
    assert done.returncode == 2 and "has row format 1, exports need 2" in done.stderr
    assert not list(old.glob("*export*"))  # nothing half-written
