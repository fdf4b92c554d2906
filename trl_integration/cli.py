"""`bitune-sft`: TRL's `trl sft` command for Bitune adapters.

It parses the same arguments with TRL's own parser and configs (and `--config file.yaml`), plus the Bitune settings,
and always trains a Bitune adapter, whose two weight sets the `--lora_*` flags configure, with Bitune's defaults
(`BituneModelConfig`). Like `trl sft`, it launches itself through `accelerate launch` (`main`). Flags that cannot
work are refused with one line before anything is launched or loaded (`refuse_before_any_work`); a dataset's empty
data files and missing splits by name before the model loads (`run`).

```bash
bitune-sft --model_name_or_path Qwen/Qwen2-0.5B --dataset_name trl-lib/tldr --output_dir Qwen2-0.5B-Bitune \
    --learning_rate 3e-4 --per_device_train_batch_size 8 --mix_init 0.01 --num_processes 8
accelerate launch --config_file my_config.yaml -m trl_integration.cli --model_name_or_path ...  # the same, by hand
```
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import typing
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peft import PeftConfig
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, SFTConfig, TrlParser

from peft_bitune import BituneConfig, compat
from peft_bitune.utils.command_line_numbers import number_problem

from .config import REFUSED_VALUES, BituneSFTConfig

# What `bitune-sft` hands to `accelerate launch --module`: this module, whose `__main__` block trains.
TRAINING_MODULE = "trl_integration.cli"


def _bitune_arguments() -> type:
    """The Bitune settings of `BituneConfig` (not the weight-set method, which the `--lora_*` flags set, nor the base
    model's records) as a dataclass for TRL's parser, with their names, types (a `Literal` gives its flag the
    choices), defaults and help texts."""
    peft_fields = {f.name for f in dataclasses.fields(PeftConfig)}
    types = typing.get_type_hints(BituneConfig)
    settings = [
        (f.name, types[f.name], field(default=f.default, metadata=f.metadata))
        for f in dataclasses.fields(BituneConfig)
        if f.name not in peft_fields and f.name != "adapter_config" and not f.metadata.get("recorded")
    ]
    arguments = dataclasses.make_dataclass("BituneArguments", settings)
    arguments.__module__ = __name__
    arguments.__doc__ = "The Bitune settings of `BituneConfig` other than the weight-set method (`--lora_*` flags)."
    return arguments


BituneArguments = _bitune_arguments()


def _bitune_lora_default(what: str, trl_default: str, **default: Any) -> Any:
    """A `--lora_*` field with Bitune's default, whose help says what `trl sft`'s is."""
    help_text = f"LoRA {what} of both weight sets (Bitune's default; `trl sft` uses {trl_default})."
    return field(**default, metadata={"help": help_text})


@dataclass
class BituneModelConfig(ModelConfig):
    """TRL's `ModelConfig` with Bitune's (the paper's) LoRA defaults for both weight sets, which the help texts
    compare with `trl sft`'s. `--use_peft` is always on (a Bitune adapter is a PEFT adapter), so it is hidden from
    `--help`; turning it off is refused."""

    use_peft: bool = field(default=True, metadata={"help": argparse.SUPPRESS})
    lora_r: int = _bitune_lora_default("R value", "16", default=8)
    lora_alpha: int = _bitune_lora_default("alpha", "32", default=16)
    lora_dropout: float = _bitune_lora_default("dropout", "0.05", default=0.0)
    lora_target_modules: list[str] | None = _bitune_lora_default(
        "target modules", "PEFT's per-architecture default, usually the attention projections only",
        default_factory=lambda: ["all-linear"],
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.use_peft:
            raise ValueError(
                "`bitune-sft` always trains a Bitune adapter, which is a PEFT adapter: `--use_peft` cannot be turned "
                "off. Remove `--use_peft false` / `--no_use_peft`; to fine-tune without PEFT, use `trl sft`."
            )


USAGE = "bitune-sft --model_name_or_path MODEL --dataset_name DATA --output_dir DIR [OPTIONS] [LAUNCHER OPTIONS]"
DESCRIPTION = """\
Train a Bitune adapter with TRL's SFTTrainer, as `trl sft` does: the same arguments (and `--config file.yaml`),
launched through `accelerate launch` (its options, e.g. `--num_processes 8` or `--accelerate_config fsdp2`, go to the
launcher). Bitune's options come first, then those with values Bitune refuses, then TRL's and transformers' options, as
in `trl sft --help`. Numbers that cannot work are refused in one line before anything loads.

example:
  bitune-sft --model_name_or_path Qwen/Qwen2-0.5B --dataset_name trl-lib/tldr --output_dir Qwen2-0.5B-Bitune \\
      --learning_rate 3e-4 --mix_init 0.01
"""
BITUNE_SECTION = "Bitune options"
REFUSED_SECTION = "Options with values bitune-sft refuses"
OTHER_SECTION = "TRL's and transformers' options (as `trl sft`)"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default (as `trl sft` shows them), and the description's lines as written."""


class BituneSFTParser(TrlParser):
    """TRL's parser of `trl sft`'s arguments and Bitune's, whose help starts with what `bitune-sft` does and Bitune's
    options, and marks the values Bitune refuses (with why) before TRL's and transformers' several hundred."""

    def __init__(self, prog: str | None = "bitune-sft") -> None:
        dataclass_types = (ScriptArguments, BituneSFTConfig, BituneModelConfig, DatasetMixtureConfig, BituneArguments)
        super().__init__(dataclass_types, prog=prog, usage=USAGE, description=DESCRIPTION,
                         formatter_class=_HelpFormatter)
        for action in self._actions:
            for value, reason in REFUSED_VALUES.get(action.dest, {}).items():
                action.help = f"{action.help} Refused: {value!r}, since {reason}."

    def format_help(self) -> str:
        """argparse's help (usage, description, sections of options), with the options in the sections above."""
        formatter = self._get_formatter()
        formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        formatter.add_text(self.description)
        for title, actions in self.help_sections().items():
            formatter.start_section(title)
            formatter.add_arguments(actions)
            formatter.end_section()
        return formatter.format_help()

    def help_sections(self) -> dict[str, list[argparse.Action]]:
        """Bitune's options (its adapter settings, the LoRA flags with Bitune's defaults, its training settings), those
        with refused values, and all the others, each in the parser's order."""
        trl_fields = {f.name for f in dataclasses.fields(SFTConfig)}
        bitune = [
            *(f.name for f in dataclasses.fields(BituneArguments)),
            "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",  # Bitune's defaults, not `trl sft`'s
            *(f.name for f in dataclasses.fields(BituneSFTConfig) if f.name not in trl_fields),
        ]
        return {
            BITUNE_SECTION: sorted((a for a in self._actions if a.dest in bitune), key=lambda a: bitune.index(a.dest)),
            REFUSED_SECTION: [action for action in self._actions if action.dest in REFUSED_VALUES],
            OTHER_SECTION: [action for action in self._actions if action.dest not in {*bitune, *REFUSED_VALUES}],
        }


make_parser = BituneSFTParser  # the name of TRL's scripts' parser factory


def build_peft_config(model_args: ModelConfig, bitune_args: BituneArguments) -> BituneConfig:
    """The Bitune adapter the flags describe: `trl sft`'s LoRA config for both weight sets, plus the mixing
    settings."""
    from trl import get_peft_config

    adapter_config = get_peft_config(dataclasses.replace(model_args, use_peft=True))
    return BituneConfig(adapter_config=adapter_config, **dataclasses.asdict(bitune_args))


def main(argv: Sequence[str] | None = None) -> None:
    """`bitune-sft`: launch a training run through `accelerate launch`, the way `trl sft` does: the arguments that
    the training parser knows (and `--config`) go to the training script, `python -m trl_integration.cli`; the others
    (`--num_processes`, `--config_file`, ... and TRL's `--accelerate_config zero2|fsdp2|<file>`) to the launcher. When
    a training process fails, the error it recorded (`@record`) is printed last (not the launcher's), and
    `bitune-sft` exits with the process's status."""
    from accelerate.commands.launch import launch_command, launch_command_parser
    from accelerate.utils import patch_environment
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    argv = list(sys.argv[1:] if argv is None else argv)
    *configs, config_remaining, cli_remaining = _parse_or_refuse(
        argv, return_remaining_strings=True, separate_remaining_strings=True
    )
    refuse_before_any_work(configs)
    launch_args = resolve_accelerate_config_argument(config_remaining + cli_remaining)
    training_script_args = compat.without_launcher_arguments(argv, cli_remaining)
    launch_parser = launch_command_parser()
    _, unknown = launch_parser.parse_known_args([*launch_args, "--module", TRAINING_MODULE])
    if unknown:
        raise ValueError(
            f"Unknown arguments {unknown}: neither a training argument of `bitune-sft` (see `bitune-sft --help`) nor "
            "an `accelerate launch` argument (see `accelerate launch --help`)."
        )
    launch_args = launch_parser.parse_args([*launch_args, "--module", TRAINING_MODULE, *training_script_args])
    # A single process (accelerate's simple launcher) records its error in the file named here; several (torchrun) in
    # files of torch's own, which their `ChildFailedError` reads.
    with tempfile.TemporaryDirectory(prefix="bitune-sft-") as folder:
        error_file = os.path.join(folder, "error.json")
        try:
            with patch_environment(TORCHELASTIC_ERROR_FILE=error_file):
                launch_command(launch_args)
        except (subprocess.CalledProcessError, SystemExit, ChildFailedError) as failure:
            status = _exit_status(failure)
            if status == 0:
                raise
            error = _recorded_error(failure, error_file) or (
                f"the training process exited with status {status} without reporting an error (it was killed, e.g. "
                "out of memory, or failed while starting); its output above says what happened."
            )
            print(f"bitune-sft: training failed: {error}", file=sys.stderr)
            raise SystemExit(status) from None


def _exit_status(failure: BaseException) -> int:
    """The exit status of what `accelerate launch` raised: `CalledProcessError` (one process), `ChildFailedError`
    (several), `SystemExit` (`--quiet`)."""
    if isinstance(failure, subprocess.CalledProcessError):
        return failure.returncode or 1
    if isinstance(failure, SystemExit):
        return failure.code if isinstance(failure.code, int) else (0 if failure.code is None else 1)
    return 1


def _recorded_error(failure: BaseException, error_file: str) -> str | None:
    """The error the (first) failed training process recorded with `@record`, as "Type: message"; `None` if none."""
    if isinstance(failure, ChildFailedError):
        recorded = failure.get_first_failure()[1].error_file_data
    elif os.path.isfile(error_file):
        recorded = json.loads(Path(error_file).read_text(encoding="utf-8"))
    else:
        return None
    message = recorded.get("message")
    return message.get("message") if isinstance(message, dict) else None


def train(argv: Sequence[str] | None = None) -> None:
    """The training script that `bitune-sft` launches (`python -m trl_integration.cli`, in every process): parse the
    arguments (`argv`, or the command line) and train, save and optionally push, as `trl sft`'s script does."""
    configs = _parse_or_refuse(argv, fail_with_unknown_args=True)
    refuse_before_any_work(configs)
    run(*configs)


def _refusal(error: BaseException) -> SystemExit:
    """The one line `bitune-sft` exits with when a flag cannot work."""
    return SystemExit(f"bitune-sft: {' '.join(str(error).split())}")


def _parse_or_refuse(argv: Sequence[str] | None, **kwargs: Any) -> list[Any]:
    """The parsed configs; a value that a config's own checks refuse while it is made (e.g. `--mixing_warmup_steps`
    above `--max_steps`, TRL's and transformers' checks) is refused with its message in one line, not a traceback."""
    try:
        return list(make_parser().parse_args_and_config(argv, **kwargs))
    except ValueError as error:
        raise _refusal(error) from None


def refuse_before_any_work(configs: Sequence[Any]) -> None:
    """Refuse, with one line and before anything is launched or loaded, an unusable number and a Bitune adapter that
    cannot be built, including `--mixed_layers` naming a layer the model does not have (`_model_depth`)."""
    _, training_args, model_args, _, bitune_args = configs
    refuse_unusable_config_numbers(configs)
    try:
        peft_config = build_peft_config(model_args, bitune_args)
        if peft_config.mixed_layers is not None and (depth := _model_depth(model_args, training_args)) is not None:
            peft_config.check_depth(depth)
    except (ValueError, TypeError) as error:
        raise _refusal(error) from None


def _model_depth(model_args: ModelConfig, training_args: BituneSFTConfig) -> int | None:
    """The number of decoder layers of `--model_name_or_path`, from its config alone; None where the config cannot be
    read here (the training process then checks `mixed_layers` once the model has loaded, and reports why it cannot
    load it)."""
    from transformers import AutoConfig

    if not model_args.model_name_or_path:
        return None
    try:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision,
                                            trust_remote_code=training_args.trust_remote_code)
    except (OSError, ValueError, KeyError):
        return None
    return getattr(config.get_text_config(), "num_hidden_layers", None)


def refuse_unusable_config_numbers(configs: Sequence[Any]) -> None:
    """Refuse, with one line and before anything is launched or loaded, a numeric flag (or `--config` value) that
    parsed but cannot be used: nan, inf (also a float that overflowed, e.g. 1e999) or an integer beyond 64 bits. The
    parser takes them all (Python's `float` and `int`), and each failed later, or trained on nan."""
    for config in configs:
        for config_field in dataclasses.fields(config):
            if problem := number_problem(getattr(config, config_field.name, None)):
                raise SystemExit(f"bitune-sft: `--{config_field.name}` {problem}.")


def run(
    script_args: ScriptArguments,
    training_args: BituneSFTConfig,
    model_args: ModelConfig,
    dataset_args: DatasetMixtureConfig,
    bitune_args: BituneArguments,
) -> None:
    """`trl sft`'s script (`trl/scripts/sft.py`'s `main`) with the Bitune trainer, adapter and data checks."""
    # Not TRL's `main` itself: it names `SFTTrainer` and `get_peft_config` in its body, with no parameter for either.
    import transformers
    from packaging.version import Version
    from trl import get_dataset, get_quantization_config

    from .trainer import BituneSFTTrainer

    peft_config = build_peft_config(model_args, bitune_args)  # validated before any loading
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision, "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation, "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }

    if dataset_args.datasets:
        if script_args.dataset_name:
            warnings.warn(
                "Both `datasets` (from the config file) and `--dataset_name` are set; `datasets` is used and "
                "`--dataset_name` is ignored, as in `trl sft`."
            )
        dataset = get_dataset(dataset_args)
    elif script_args.dataset_name:
        dataset = _load_dataset(script_args)
    else:
        raise ValueError(
            "Pass a dataset: `--dataset_name` (a Hub id or a local path) or `datasets` in a `--config` file."
        )
    evaluating = training_args.eval_strategy != "no"
    _check_splits(dataset, script_args, evaluating)

    trainer = BituneSFTTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if evaluating else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=peft_config,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Bitune adapter saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
        trainer.accelerator.print(f"Pushed to https://huggingface.co/{trainer.hub_model_id}.")
    if Version(transformers.__version__) >= Version("5.18.0"):
        trainer.end()


def _load_dataset(script_args: ScriptArguments) -> Any:
    """`load_dataset(--dataset_name)`, refusing empty data files by name: the JSON builder of `datasets` fails on them
    with a bare `StopIteration`."""
    from datasets import load_dataset

    name = script_args.dataset_name
    empty = _empty_data_files(name)
    if empty:
        more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
        raise ValueError(f"`--dataset_name {name}`: the data file {empty[0]} is empty{more}. Put the training rows in "
                         "it (one JSON object per line for .jsonl), or remove it.")
    try:
        return load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)
    except StopIteration:
        raise ValueError(
            f"`--dataset_name {name}`: a data file of this dataset is empty, so `datasets` cannot read its columns. "
            "Give every data file its rows, or remove the empty ones."
        ) from None


def _empty_data_files(path: str) -> list[str]:
    """The data files of a local dataset folder (or a local data file) that hold nothing but whitespace."""
    files = [path] if os.path.isfile(path) else []
    for folder, subfolders, names in os.walk(path):  # nothing for a path that is no folder
        subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
        files += [os.path.join(folder, name) for name in sorted(names) if not name.startswith(".")]
    return [file for file in files if file.endswith(_DATA_FILE_SUFFIXES) and _is_blank(file)]


# The files `datasets` reads as rows (its packaged builders), as opposed to a README.md or a loading script.
_DATA_FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".tsv", ".txt", ".parquet", ".arrow")


def _is_blank(path: str) -> bool:
    """Whether a file holds nothing but whitespace (one over 1 MiB is not blank in practice and is not read)."""
    return os.path.getsize(path) <= 1 << 20 and not Path(path).read_bytes().strip()


def _check_splits(dataset: Any, script_args: ScriptArguments, evaluating: bool) -> None:
    """Refuse a split the dataset does not have, naming the flag, the splits it has and the fix."""
    splits = sorted(dataset)
    where = f"`--dataset_name {script_args.dataset_name}`" if script_args.dataset_name else "The dataset"
    train_split, test_split = script_args.dataset_train_split, script_args.dataset_test_split
    if train_split not in dataset:
        raise ValueError(
            f"`--dataset_train_split {train_split}`: {where} has no split '{train_split}'; its splits are {splits}. "
            "Pass one of them with `--dataset_train_split`."
        )
    if evaluating and test_split not in dataset:
        raise ValueError(
            f"Evaluation is on (`--eval_strategy` is not 'no') and uses `--dataset_test_split {test_split}`, but "
            f"{where} has no split '{test_split}'; its splits are {splits}. Pass one of them with "
            "`--dataset_test_split`, or turn evaluation off with `--eval_strategy no`."
        )


if __name__ == "__main__":
    record(train)()  # a failure's error goes where `bitune-sft` (or torchrun) reads it: TORCHELASTIC_ERROR_FILE
