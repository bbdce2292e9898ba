"""Run by a venv's python that has llamafactory: the sharegpt export as LLaMA-Factory itself reads it.

`python llamafactory_reads.py DATASET_DIR OUT` loads DATASET_DIR/dataset_info.json as `llamafactory-cli train`
does (data/parser.py get_dataset_list), converts each line of the file it names with the sharegpt converter
(data/converter.py), and formats each model turn with the qwen3 template's formatters (data/template.py
Template._encode), as training would. Writes OUT, one JSON line per row: {"skipped": bool, "turns": [text...]}
(stdout has LLaMA-Factory's log), or exits non-zero with LLaMA-Factory's own error, which stops a training run.
"""
import json
import sys
from pathlib import Path

from llamafactory.data.converter import get_dataset_converter
from llamafactory.data.data_utils import Role
from llamafactory.data.parser import get_dataset_list
from llamafactory.data.template import TEMPLATES
from llamafactory.hparams import DataArguments


def main(dataset_dir: str, out: str) -> None:
    (attr,) = get_dataset_list(["trajgen"], dataset_dir)
    convert = get_dataset_converter(attr.formatting, attr, DataArguments(dataset_dir=dataset_dir))
    template = TEMPLATES["qwen3"]
    rows = []
    for line in (Path(dataset_dir) / attr.dataset_name).read_text().splitlines():
        example = convert(json.loads(line))
        turns = []
        for message in example["_prompt"] + example["_response"]:
            if message["role"] == Role.FUNCTION.value:
                slots = template.format_function.apply(content=message["content"], thought_words=template.thought_words,
                                                       tool_call_words=template.tool_call_words)
            elif message["role"] == Role.ASSISTANT.value:
                slots = template.format_assistant.apply(content=message["content"])
            else:
                continue
            turns.append("".join(s for s in slots if isinstance(s, str)).removesuffix("<|im_end|>\n"))
        rows.append(json.dumps({"skipped": not example["_response"], "turns": turns}) + "\n")
    Path(out).write_text("".join(rows))


if __name__ == "__main__":
    main(*sys.argv[1:])
