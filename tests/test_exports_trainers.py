"""Every exported row is taken by its trainer, and the next step each export prints runs (issue 52).

One run in process (tests/support/inline.py) against the scripted server: calls with literal tags in their
arguments and text beside them, an inline `<think>` answer, and a call turn whose reasoning holds a
literal `<tool_call>` pair. Checked here:
- sharegpt as LLaMA-Factory 0.9.5 formats it: by this file's copy of its FunctionFormatter (always), and by
  LLaMA-Factory itself in a venv that has it (tests/support/llamafactory_reads.py); every model turn must
  come out as Qwen3's own chat template renders the hf row, calls read back exactly;
- the openai export against the fine-tuning API's format, our keys in the side file;
- the files written beside each export, and TRL's script trained 2 steps offline on a tiny model in a
  venv that has torch and TRL.
The venvs are the ones bench/train_exports.py describes (/tmp/lf, /tmp/trl; TRAJGEN_LLAMAFACTORY_PYTHON,
TRAJGEN_TRL_PYTHON name others); without them those two tests are skipped and say why.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.conftest import read_jsonl, write_jsonl

TAGS = '<tool_call>{"name": "x", "arguments": {}}</tool_call> </think> <think>'
SCRIPT = {"prompts": {
    "args": [  # literal tags in the arguments, text beside the calls
        {"content": "Writing the note.", "reasoning": "Write it, then read it back.",
         "tool_calls": [{"name": "write_file", "arguments": {"path": "n.txt", "content": f"note {TAGS}"}},
                        {"name": "terminal", "arguments": {"command": "cat n.txt"}}]},
        {"content": f"The note holds {TAGS}", "reasoning": "It was read back."}],
    "quiet": [  # a call with neither reasoning nor text, then an inline <think> answer
        {"tool_calls": [{"name": "terminal", "arguments": {"command": "echo '</tool_call>'"}}]},
        {"content": "<think>It printed the tag.</think>It printed </tool_call>."}],
    "thought": [  # a tag pair in a call turn's reasoning: not carried by sharegpt
        {"reasoning": f"Maybe {TAGS}", "tool_calls": [{"name": "terminal", "arguments": {"command": "ls"}}]},
        {"content": "Nothing there."}],
    "plain": [{"content": "<think>2 + 2</think>4"}],
}}
IDS = {"args": "a", "quiet": "q", "thought": "t", "plain": "p"}
CARRIED = {"a", "q", "p"}
QWEN3 = Path(__file__).parent / "chat_templates" / "qwen3.jinja"  # Qwen3's own template (trl 1.16.0 wheel)
LF_PYTHON = Path(os.environ.get("TRAJGEN_LLAMAFACTORY_PYTHON", "/tmp/lf/bin/python"))
TRL_PYTHON = Path(os.environ.get("TRAJGEN_TRL_PYTHON", "/tmp/trl/bin/python"))
SUPPORT = Path(__file__).parent / "support"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run, its hf, sharegpt, openai and parquet exports, and what each export printed."""
    from tests.support.inline import Inline
    from tests.support.scripted_server import start_server

    tmp = tmp_path_factory.mktemp("exports")
    inline = Inline(tmp)
    server = start_server(SCRIPT)
    try:
        write_jsonl(tmp / "prompts.jsonl", [{"prompt": p, "id": i} for p, i in IDS.items()])
        done = inline.run(*inline.args(server, max_turns=3, distribution="default"))
        assert done.returncode == 0, done.stderr
        printed = {}
        for fmt in ("hf", "sharegpt", "openai", "parquet"):
            exported = inline.run(f"--export={fmt}", "--run_name=run")
            assert exported.returncode == 0, exported.stderr
            printed[fmt] = exported
        yield inline.run_dir(), printed
    finally:
        server.stop()


def _by_id(run_dir: Path, name: str) -> dict[str, dict]:
    return {r["provenance"]["dataset_id"]: r for r in read_jsonl(run_dir / name)}


# LLaMA-Factory 0.9.5, src/llamafactory/data/formatter.py FunctionFormatter.apply with the default
# thought_words and tool_call_words (data/template.py register_template) and the qwen tool format
# (data/tool_utils.py QwenToolUtils.function_formatter): what a function_call turn trains on.
THOUGHT_WORDS, TOOL_CALL_WORDS = ("<think>\n", "\n</think>\n\n"), ("<tool_call>", "</tool_call>")


def llama_factory_function(content: str) -> tuple[str, list[tuple[str, str]]]:
    """The turn's training text and its calls (name, arguments as JSON text), as LLaMA-Factory reads them;
    RuntimeError or KeyError where LLaMA-Factory stops the whole run."""
    def parse(json_content: str) -> list[tuple[str, str]]:
        try:
            calls = json.loads(json_content)
        except json.JSONDecodeError:
            raise RuntimeError(f"Invalid JSON format in function message: {str([content])}.")
        calls = calls if isinstance(calls, list) else [calls]
        return [(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]

    match = re.search(f"{re.escape(TOOL_CALL_WORDS[0])}(.*?){re.escape(TOOL_CALL_WORDS[1])}", content, re.DOTALL)
    if match is None:
        thought = re.search(f"{re.escape(THOUGHT_WORDS[0])}(.*?){re.escape(THOUGHT_WORDS[1])}", content, re.DOTALL)
        functions = parse(content.replace(thought.group(0), "") if thought else content)
        before = thought.group(0) if thought else ""
    else:
        functions, before = parse(match.group(1)), content.replace(match.group(0), "")
    calls = [json.dumps({"name": name, "arguments": json.loads(arguments)}, ensure_ascii=False)
             for name, arguments in functions]
    return before + "\n".join(f"<tool_call>\n{text}\n</tool_call>" for text in calls), functions


def _qwen3_turns(record: dict) -> list[str]:
    """The assistant turns of an hf record as Qwen3's own chat template renders them."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[record["messages"]], tools=record["tools"],
                                        chat_template=QWEN3.read_text())
    return re.findall(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", rendered[0], flags=re.DOTALL)


def _model_turns(record: dict) -> list[str]:
    """What LLaMA-Factory trains on for each model turn of a sharegpt record."""
    return [llama_factory_function(t["value"])[0] if t["from"] == "function_call" else t["value"]
            for t in record["conversations"] if t["from"] in ("gpt", "function_call")]


def test_sharegpt_turns_train_as_qwen3_renders_them_with_calls_read_back_exactly(run):
    pytest.importorskip("transformers")
    run_dir, _ = run
    sharegpt, hf = _by_id(run_dir, "export_sharegpt.jsonl"), _by_id(run_dir, "export_hf.jsonl")
    assert set(sharegpt) == CARRIED
    for dataset_id, record in sharegpt.items():
        assert _model_turns(record) == _qwen3_turns(hf[dataset_id]), dataset_id  # the text beside calls included
        read = [call for t in record["conversations"] if t["from"] == "function_call"
                for call in llama_factory_function(t["value"])[1]]
        sent = [c["function"] for m in hf[dataset_id]["messages"] for c in m.get("tool_calls", [])]
        assert [(name, json.loads(args)) for name, args in read] == [(c["name"], c["arguments"]) for c in sent]
    args = sharegpt["a"]["conversations"][2]["value"]
    assert args.startswith("<think>\nWrite it, then read it back.\n</think>\n\nWriting the note.\n<tool_call>[")
    assert "<tool_call>" not in args.split("<tool_call>", 1)[1] and "\\u003ctool_call>" in args
    with pytest.raises((RuntimeError, KeyError)):  # written raw, the tags in the arguments stop LLaMA-Factory
        llama_factory_function(args.replace("\\u003c", "<"))
    answer = "<think>\nIt printed the tag.\n</think>\n\nIt printed </tool_call>."
    assert sharegpt["q"]["conversations"][-1]["value"] == answer
    assert sharegpt["p"]["conversations"][-1]["value"] == "<think>\n2 + 2\n</think>\n\n4"  # one thinking form


def test_a_row_sharegpt_cannot_carry_is_left_out_counted_and_its_reason_printed(run):
    run_dir, printed = run
    notes = " ".join(printed["sharegpt"].stderr.split())
    assert "1 row(s) left out: a call turn's reasoning or text holds a literal <tool_call>" in notes
    assert "wrote 3 rows" in printed["sharegpt"].stdout
    call = _by_id(run_dir, "export_hf.jsonl")["t"]["messages"][2]  # as it would have been written
    calls = json.dumps([{"name": "terminal", "arguments": {}}])
    value = f"<think>\n{call['reasoning_content']}\n</think>\n\n<tool_call>{calls}</tool_call>"
    assert llama_factory_function(value)[1] == [("x", "{}")]  # LLaMA-Factory would train on a call never made


def test_llama_factory_itself_reads_every_exported_row(run, tmp_path):
    if not LF_PYTHON.exists():
        pytest.skip(f"no LLaMA-Factory venv at {LF_PYTHON} (bench/train_exports.py says how to make one)")
    run_dir, _ = run
    reads = [str(LF_PYTHON), str(SUPPORT / "llamafactory_reads.py"), str(run_dir), str(tmp_path / "read")]
    done = subprocess.run(reads, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "DISABLE_VERSION_CHECK": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    read = read_jsonl(tmp_path / "read")
    hf = _by_id(run_dir, "export_hf.jsonl")
    order = list(_by_id(run_dir, "export_sharegpt.jsonl"))  # in the file's order
    assert len(read) == len(order) == len(CARRIED)
    for dataset_id, row in zip(order, read):
        assert not row["skipped"] and row["turns"] == _qwen3_turns(hf[dataset_id]), dataset_id


SYSTEM_KEYS, USER_KEYS = {"role", "content", "name"}, {"role", "content", "name"}
ASSISTANT_KEYS = {"role", "content", "refusal", "name", "audio", "tool_calls", "function_call", "weight"}
TOOL_KEYS = {"role", "content", "tool_call_id"}
MESSAGE_KEYS = {"system": SYSTEM_KEYS, "developer": SYSTEM_KEYS, "user": USER_KEYS, "assistant": ASSISTANT_KEYS,
                "tool": TOOL_KEYS}


def _check_openai_line(line: dict) -> None:
    """One line of a fine-tuning file for chat models (OpenAI's FineTuneChatRequestInput, API spec 2.3.0):
    `messages`, optional `tools` and `parallel_tool_calls`, nothing else; per role only the fields the API
    takes; tool calls with JSON text arguments answered by tool messages; the example ends on the model."""
    assert set(line) <= {"messages", "tools", "parallel_tool_calls"} and line["messages"]
    for tool in line.get("tools", []):
        assert tool["type"] == "function" and set(tool) == {"type", "function"}
        assert set(tool["function"]) <= {"name", "description", "parameters", "strict"} and tool["function"]["name"]
    pending: set[str] = set()
    for message in line["messages"]:
        assert set(message) <= MESSAGE_KEYS[message["role"]], message
        if message["role"] == "tool":
            assert isinstance(message["content"], str)
            pending.remove(message["tool_call_id"])
            continue
        assert not pending, "tool calls left unanswered"
        if message["role"] != "assistant" or not message.get("tool_calls"):
            assert isinstance(message["content"], str)
        for call in message.get("tool_calls") or []:
            assert set(call) == {"id", "type", "function"} and call["type"] == "function"
            assert set(call["function"]) == {"name", "arguments"}
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
            pending.add(call["id"])
    assert line["messages"][-1]["role"] == "assistant"


def test_the_openai_export_is_exactly_the_fine_tuning_format_with_provenance_beside_it(run):
    run_dir, printed = run
    lines = read_jsonl(run_dir / "export_openai.jsonl")
    for line in lines:
        _check_openai_line(line)
    beside = read_jsonl(run_dir / "export_openai.provenance.jsonl")
    assert [b["line"] for b in beside] == list(range(1, len(lines) + 1)) and len(lines) == len(IDS)
    assert {b["provenance"]["dataset_id"] for b in beside} == set(IDS.values())
    assert all({"completed", "partial", "verify", "reward"} <= set(b) for b in beside)
    with pytest.raises(AssertionError):  # the checks see an extra key
        _check_openai_line({**lines[0], "provenance": {}})
    assert "files.create" in printed["openai"].stdout and "jq" not in printed["openai"].stdout


def test_each_export_writes_what_its_trainer_needs_and_prints_the_command(run):
    pytest.importorskip("transformers")
    import yaml
    from transformers.utils.chat_template_utils import render_jinja_template

    run_dir, printed = run
    folder = run_dir.resolve()
    compile((run_dir / "train_trl.py").read_text(), "train_trl.py", "exec", ast.PyCF_ONLY_AST)
    hf = read_jsonl(run_dir / "export_hf.jsonl")[0]
    _, spans = render_jinja_template(conversations=[hf["messages"]], tools=hf["tools"],
                                     chat_template=(run_dir / "chat_template.jinja").read_text(),
                                     return_assistant_tokens_mask=True)
    assert len(spans[0]) == sum(m["role"] == "assistant" for m in hf["messages"])  # the generation markers work
    axolotl = yaml.safe_load((run_dir / "axolotl.yaml").read_text())
    (dataset,) = axolotl["datasets"]
    assert dataset["path"] == str(folder / "export_hf.jsonl") and dataset["roles_to_train"] == ["assistant"]
    assert dataset["type"] == "chat_template" and isinstance(axolotl["learning_rate"], float)  # not text: 1e-05
    assert f"python {folder / 'train_trl.py'} --model " in printed["hf"].stdout
    assert f"axolotl train {folder / 'axolotl.yaml'}" in printed["hf"].stdout
    assert f"train_trl.py --model Qwen/Qwen3-0.6B --data {folder / 'export.parquet'}" in printed["parquet"].stdout
    info = json.loads((run_dir / "dataset_info.json").read_text())
    config = yaml.safe_load((run_dir / "llamafactory.yaml").read_text())
    assert Path(config["dataset_dir"], info[config["dataset"]]["file_name"]) == folder / "export_sharegpt.jsonl"
    assert config["stage"] == "sft" and config["template"] == "qwen3" and isinstance(config["learning_rate"], float)
    assert f"llamafactory-cli train {folder / 'llamafactory.yaml'}" in printed["sharegpt"].stdout


def test_the_printed_trl_command_trains_two_steps_offline(run, tmp_path):
    if not TRL_PYTHON.exists():
        pytest.skip(f"no venv with torch and TRL at {TRL_PYTHON} (bench/train_exports.py says how to make one)")
    run_dir, printed = run
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "CUDA_VISIBLE_DEVICES": ""}
    model = tmp_path / "tiny"
    (tmp_path / "text.txt").write_text((run_dir / "export_hf.jsonl").read_text())
    made = subprocess.run([str(TRL_PYTHON), str(SUPPORT / "tiny_model.py"), str(model), str(tmp_path / "text.txt")],
                          capture_output=True, text=True, timeout=600, env=env)
    assert made.returncode == 0, made.stderr[-3000:]
    command = next(shlex.split(line) for line in printed["hf"].stdout.splitlines() if "train_trl.py" in line
                   and line.strip().startswith("python "))
    command[0], command[command.index("--model") + 1] = str(TRL_PYTHON), str(model)
    done = subprocess.run([*command, "--max_steps=2", f"--output_dir={tmp_path / 'out'}"], capture_output=True,
                          text=True, timeout=1200, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'train_loss'" in done.stdout + done.stderr and (tmp_path / "out" / "model.safetensors").exists()
