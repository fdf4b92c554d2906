"""`bitune-eval`: the lm-evaluation-harness command line, with the `bitune` model and the paper's task formats.

The harness discovers no model plugins, so `lm_eval --model bitune` cannot work by itself; `bitune-eval` registers
the model and then runs the harness's own command line with the same arguments:

    bitune-eval --model bitune --model_args pretrained=BASE,peft=ADAPTER --tasks piqa,arc_challenge

It also puts the paper-format tasks (`bitune_piqa`, ..., `bitune_gsm8k`) on the task path, unless you pass your own
`--include_path` (the harness takes one folder; give ours as YAML paths in `--tasks` then, see `TASKS_DIR`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from . import TASKS_DIR

logger = logging.getLogger(__name__)

def main(argv: Sequence[str] | None = None) -> None:
    """Run the harness's command line (`lm_eval`) on `argv` (default: this process's arguments)."""
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as error:
        raise SystemExit(
            "bitune-eval needs the lm-evaluation-harness: `pip install 'peft-bitune[eval]'`."
        ) from error
    from . import harness  # noqa: F401  (registers the `bitune` model)

    arguments = with_paper_tasks(list(sys.argv[1:] if argv is None else argv))
    with _program_arguments(arguments):
        cli_evaluate()


def with_paper_tasks(arguments: list[str]) -> list[str]:
    """`arguments` plus `--include_path TASKS_DIR` where the harness would run, list or validate tasks."""
    if any(argument == "--include_path" or argument.startswith("--include_path=") for argument in arguments):
        logger.info("`--include_path` given: the bitune_* tasks are available as YAML paths under %s.", TASKS_DIR)
        return arguments
    if len(arguments) < 2:  # bare `run`/`ls`, `--help`, or nothing: the harness prints its help
        return arguments
    return [*arguments, "--include_path", TASKS_DIR]


@contextmanager
def _program_arguments(arguments: list[str]) -> Iterator[None]:
    """The harness's command line reads `sys.argv` itself; set it for the call and restore it afterwards."""
    saved = sys.argv
    sys.argv = [saved[0] if saved else "bitune-eval", *arguments]
    try:
        yield
    finally:
        sys.argv = saved
