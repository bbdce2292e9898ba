"""Train a model on this run's export with TRL's SFTTrainer, the loss on the assistant turns only.

Written beside the export by `batch_runner.py --export=hf` (or `--export=parquet`); needs `pip install trl`.
The chat template beside it, chat_template.jinja (TRL's qwen3_training.jinja), renders the tools, the calls
and the reasoning, and carries the {% generation %} markers that assistant_only_loss needs.
"""
import argparse
from pathlib import Path

import torch
from datasets import load_dataset
from trl import SFTConfig, SFTTrainer

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model on the Hub or a local folder")
    parser.add_argument("--data", required=True, help="the export: export_hf.jsonl or export.parquet")
    parser.add_argument("--output_dir", default=str(HERE / "trl-out"), help="where the trained model goes")
    parser.add_argument("--max_steps", type=int, default=-1, help="stop after this many steps (-1: one epoch)")
    args = parser.parse_args()
    kind = "parquet" if args.data.endswith(".parquet") else "json"
    # the other columns are outcome and provenance, not training input
    dataset = load_dataset(kind, data_files=args.data, split="train").select_columns(["messages", "tools"])
    config = SFTConfig(
        output_dir=args.output_dir,
        max_length=4096,  # rows with tool schemas run 1,000-2,100 tokens; the default 1024 cuts most
        assistant_only_loss=True,
        chat_template_path=str(HERE / "chat_template.jinja"),
        max_steps=args.max_steps,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=8,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = SFTTrainer(model=args.model, train_dataset=dataset, args=config)
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
