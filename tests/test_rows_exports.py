"""Rows and exports replay exactly what the model saw, with the tools it was given.

One real run of the CLI against the scripted server (its request log is the ground truth), with
envelope tags and their escaped forms in tool outputs, reasoning and answers; then every export.
"""
from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import read_jsonl, write_jsonl
from trajgen.agent import FINAL_ANSWER_REQUEST

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
}}
PROMPTS = {"edit": "row-1", "tags": "row-2", "budget": "row-3"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run and its three exports, made once for the module's tests."""
    from tests.conftest import CLI
    from trajgen.scripted_server import start_server

    tmp = tmp_path_factory.mktemp("rows")
    cli = CLI(tmp)
    server = start_server(SCRIPT, log_path=tmp / "requests.jsonl")
    try:
        write_jsonl(tmp / "prompts.jsonl", [{"prompt": p, "id": i} for p, i in PROMPTS.items()])
        done = cli.run(*cli.args(server, temperature=0.3, max_turns=2, distribution="default"))
        assert done.returncode == 0, done.stderr
        for fmt in ("openai", "sharegpt", "parquet"):
            exported = cli.run(f"--export={fmt}", "--run_name=run")
            assert exported.returncode == 0, exported.stderr
        yield cli, [r for r in server.requests() if r["status"] == 200]
    finally:
        server.stop()


def _by_id(records: list[dict]) -> dict[str, dict]:
    return {r["provenance"]["dataset_id"]: r for r in records}


def _last_request(requests: list[dict], prompt: str) -> dict:
    return max((r for r in requests if r["prompt"] == prompt), key=lambda r: r["turn"])["body"]


def test_openai_export_replays_the_last_request_and_the_reply(run):
    cli, requests = run
    exported = _by_id(read_jsonl(cli.run_dir() / "export_openai.jsonl"))
    assert set(exported) == set(PROMPTS.values())
    for prompt, dataset_id in PROMPTS.items():
        messages, sent = exported[dataset_id]["messages"], _last_request(requests, prompt)
        history = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages[:-1]]
        assert history == sent["messages"], prompt  # roles, contents byte for byte, call ids, names, arguments
        final = SCRIPT["prompts"][prompt][-1]
        assert messages[-1] == {"role": "assistant", "content": final["content"],
                                **({"reasoning_content": final["reasoning"]} if "reasoning" in final else {})}
        assert exported[dataset_id]["tools"] == sent["tools"]
    edit = exported["row-1"]["messages"]
    assert edit[2]["reasoning_content"] == f"plan {TRICKY} it"  # what the model produced in that turn
    assert "\\u003c/tool_response>" in edit[4]["content"]  # the tool result as the model received it
    budget = exported["row-3"]["messages"]
    assert budget[-2] == {"role": "user", "content": FINAL_ANSWER_REQUEST}  # the model saw it: the row has it


def test_every_row_carries_the_tools_of_its_requests_and_its_provenance(run):
    cli, requests = run
    rows = {r["metadata"]["id"]: r for r in read_jsonl(cli.run_dir() / "trajectories.jsonl")}
    batch_rows = {r["metadata"]["id"]: r for r in read_jsonl(cli.run_dir() / "batch_0.jsonl")}
    manifest = json.loads((cli.run_dir() / "manifest.json").read_text())
    for prompt, dataset_id in PROMPTS.items():
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


def test_sharegpt_export_has_a_self_contained_hermes_system_turn(run):
    cli, _ = run
    exported = _by_id(read_jsonl(cli.run_dir() / "export_sharegpt.jsonl"))
    rows = {r["metadata"]["id"]: r for r in read_jsonl(cli.run_dir() / "trajectories.jsonl")}
    for dataset_id, record in exported.items():
        system = record["conversations"][0]
        assert system["from"] == "system" and system["value"].startswith(rows[dataset_id]["conversations"][0]["value"])
        listing = system["value"].split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
        assert json.loads(listing) == record["tools"] == rows[dataset_id]["tools"]
        assert record["conversations"][1:] == rows[dataset_id]["conversations"][1:]
    edit = exported["row-1"]["conversations"]
    assert "&lt;/think> &lt;tool_call>" in edit[2]["value"] and "</think>" not in edit[2]["value"].split("\n</think>", 1)[1]


def test_parquet_export_carries_messages_and_tools_as_json_text(run):
    pq = pytest.importorskip("pyarrow.parquet")
    cli, _ = run
    openai = _by_id(read_jsonl(cli.run_dir() / "export_openai.jsonl"))
    for record in pq.read_table(cli.run_dir() / "export.parquet").to_pylist():
        expected = openai[record["dataset_id"]]
        assert json.loads(record["messages"]) == expected["messages"]
        assert json.loads(record["tools"]) == expected["tools"]


def test_every_export_loads_with_datasets(run):
    datasets = pytest.importorskip("datasets")
    cli, _ = run
    for name, loader in (("export_sharegpt.jsonl", "json"), ("export_openai.jsonl", "json"), ("export.parquet", "parquet")):
        loaded = datasets.load_dataset(loader, data_files=str(cli.run_dir() / name), split="train",
                                       cache_dir=str(cli.cwd / "hf-cache"))
        assert len(loaded) == 3, name
        if name == "export_openai.jsonl":  # TRL's conversational format: `messages` beside `tools`, loaded unaltered
            exported = _by_id(read_jsonl(cli.run_dir() / name))
            for record in loaded:
                assert {k: record[k] for k in ("messages", "tools")} == {
                    k: exported[record["provenance"]["dataset_id"]][k] for k in ("messages", "tools")}


def test_the_packaged_smollm2_template_renders_the_sharegpt_text_whole(run):
    """SmolLM2's chat template renders role and content only (no `tools`, no `tool_calls`): with it,
    train on the sharegpt export's Hermes text, which carries the tools and the calls."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from trajgen.local_model import model_path

    cli, _ = run
    template = llama_cpp.Llama(str(model_path()), vocab_only=True, verbose=False).metadata["tokenizer.chat_template"]
    render = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template).render
    roles = {"system": "system", "human": "user", "gpt": "assistant", "tool": "tool"}
    record = _by_id(read_jsonl(cli.run_dir() / "export_sharegpt.jsonl"))["row-1"]
    text = render(messages=[{"role": roles[t["from"]], "content": t["value"]} for t in record["conversations"]],
                  add_generation_prompt=False)
    system, dialogue = text.split("<|im_end|>", 1)
    assert "<tools>" in system and dialogue.count("<tool_call>\n") == 2 and dialogue.count("<tool_response>\n") == 2
    assert all(t["value"] in text for t in record["conversations"])
    openai = _by_id(read_jsonl(cli.run_dir() / "export_openai.jsonl"))["row-1"]
    assert "write_file" not in render(messages=openai["messages"], tools=openai["tools"])  # why not the openai export


def test_rows_of_an_older_format_are_refused_by_name(run):
    cli, _ = run
    old = cli.run_dir("old")
    shutil.copytree(cli.run_dir(), old, ignore=shutil.ignore_patterns("export*", ".runner.lock"))
    rows = read_jsonl(old / "trajectories.jsonl")
    rows[0]["metadata"]["format_version"] = 1
    write_jsonl(old / "trajectories.jsonl", rows)
    done = cli.run("--export=openai", "--run_name=old")
    assert done.returncode == 2 and "has row format 1, exports need 2" in done.stderr
    assert not list(old.glob("*export*"))  # nothing half-written
