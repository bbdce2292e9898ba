"""Run a tool-using LLM agent over a JSONL dataset of prompts and write ShareGPT trajectories.

    python batch_runner.py --dataset_file=data/example_prompts.jsonl --run_name=demo --base_url=http://127.0.0.1:8000/v1

The flow is one way: dataset -> plan -> workers -> results -> this process, the single writer
of the run directory -> merge -> statistics. The flags are the fields of `trajgen.options.RunOptions`;
`trajgen/run.py` is the same run for a library user.
"""
from __future__ import annotations

import math
import os
import shlex
import sys

from trajgen import command_line, options
from trajgen.errors import Unwritable, UsageError
from trajgen.options import DEFAULT_BASE_URL, DEFAULT_SYSTEM_PROMPT, RunOptions  # noqa: F401  (public names)
from trajgen.sandbox import BackendUnreachable

# The run's modules and rich are imported where they are used: the workers' fork server imports
# this file (their __main__), and every worker forked from it would carry them.


def main(**flag_values) -> None:
    from trajgen import console, modes

    try:
        code = modes.main(RunOptions(**flag_values))
    except UsageError as e:
        console.error(str(e))
        sys.exit(2)
    except Unwritable as e:  # a full disk, a run directory turned read-only
        console.stopped(f"{e}. Every row already written is kept; {e.fix}, then resume with:")
        sys.exit(1)
    except BackendUnreachable as e:  # found when the images were checked, before any prompt was sent
        console.error(f"{e}; nothing was sent. Fix it, then run the same command again")
        sys.exit(1)
    except KeyboardInterrupt:  # before the scheduler took over Ctrl-C: nothing was started
        console.error("interrupted before any prompt was sent; run the same command again to start")
        sys.exit(130)
    except Exception as e:  # one line for the user; TRAJGEN_DEBUG=1 shows the traceback
        if os.environ.get("TRAJGEN_DEBUG"):
            raise
        console.error(f"{type(e).__name__}: {e} (a bug: TRAJGEN_DEBUG=1 shows where; every row already written is kept)")
        sys.exit(1)
    sys.exit(code)


SUMMARY = "Run a tool-using agent over every prompt of a JSONL dataset and write trajectories."
main.__signature__ = options.signature()
main.__doc__ = options.docstring(SUMMARY)


def cli(argv: list[str]) -> None:
    """Every argument is checked before anything starts, then Fire calls `main` with the checked
    values as Python literals (so its own parsing cannot turn --run_name=001 into 1); --help is
    printed from RunOptions, with no pager."""
    from trajgen import console

    if command_line.wants_help(argv):
        from trajgen import help_text

        print(help_text.help_text(shlex.join(console.invocation()), SUMMARY))
        return
    try:
        parsed = command_line.parse(argv)
    except UsageError as e:
        console.error(str(e))
        sys.exit(2)
    import fire

    fire.Fire(main, command=[f"--{name}={_literal(value)}" for name, value in parsed.items()], name="batch_runner.py")


def _literal(value) -> str:
    """`value` as a Python literal that Fire reads back as it is (Python has none for infinity)."""
    if isinstance(value, float) and math.isinf(value):
        return "-1e999" if value < 0 else "1e999"
    return repr(value)


if __name__ == "__main__":
    cli(sys.argv[1:])
