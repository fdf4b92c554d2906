"""`bitune-sft`: TRL's `trl sft` command for Bitune adapters.

It parses the same arguments with TRL's own parser and configs (`ScriptArguments`, the SFT training config,
`ModelConfig`, `DatasetMixtureConfig`, `--config file.yaml`), plus the Bitune settings, and always trains a Bitune
adapter (`--use_peft` is implied and hidden). The `--lora_*` flags configure the method of both weight sets; their
defaults are Bitune's (LoRA r=8, alpha=16, no dropout, all linear layers) rather than `trl sft`'s (16, 32, 0.05,
PEFT's per-architecture target modules). Like `trl sft`, it launches itself through `accelerate launch`: arguments
that are not training arguments (`--num_processes`, `--config_file`, `--accelerate_config`) go to the launcher.

```bash
bitune-sft --model_name_or_path Qwen/Qwen2-0.5B --dataset_name trl-lib/tldr --output_dir Qwen2-0.5B-Bitune \
    --learning_rate 3e-4 --per_device_train_batch_size 8 --mix_init 0.01 --num_processes 8
accelerate launch --config_file my_config.yaml -m trl_integration.cli --model_name_or_path ...  # the same, by hand
```
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from peft import PeftConfig
from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser

from peft_bitune import BituneConfig

from .config import BituneSFTConfig

# What `bitune-sft` hands to `accelerate launch --module`: this module, whose `__main__` block trains.
TRAINING_MODULE = "trl_integration.cli"


def _bitune_arguments() -> type:
    """
    The Bitune settings of `BituneConfig` other than the weight-set method (which the `--lora_*` flags set) and the
    records of the base model (which are not settings), as a dataclass for TRL's parser: the same names, types (a
    `Literal` gives its flag the choices), defaults and help texts, taken from `BituneConfig` itself.
    """
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


@dataclass
class BituneModelConfig(ModelConfig):
    """
    TRL's `ModelConfig` with Bitune's (the paper's) LoRA defaults for both weight sets: r=8, alpha=16, no dropout, all
    linear layers, where `trl sft` uses r=16, alpha=32, dropout 0.05 and PEFT's per-architecture target modules.
    `--use_peft` is always on (a Bitune adapter is a PEFT adapter), so it is hidden from `--help`; turning it off is
    refused.
    """

    use_peft: bool = field(default=True, metadata={"help": argparse.SUPPRESS})
    lora_r: int = field(
        default=8, metadata={"help": "LoRA R value of both weight sets (Bitune's default; `trl sft` uses 16)."}
    )
    lora_alpha: int = field(
        default=16, metadata={"help": "LoRA alpha of both weight sets (Bitune's default; `trl sft` uses 32)."}
    )
    lora_dropout: float = field(
        default=0.0, metadata={"help": "LoRA dropout of both weight sets (Bitune's default; `trl sft` uses 0.05)."}
    )
    lora_target_modules: list[str] | None = field(
        default_factory=lambda: ["all-linear"],
        metadata={
            "help": "LoRA target modules of both weight sets (Bitune's default: all-linear, as in the paper; "
            "`trl sft` uses PEFT's per-architecture default, usually the attention projections only)."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.use_peft:
            raise ValueError(
                "`bitune-sft` always trains a Bitune adapter, which is a PEFT adapter: `--use_peft` cannot be turned "
                "off. Remove `--use_peft false` / `--no_use_peft`; to fine-tune without PEFT, use `trl sft`."
            )


def make_parser(prog: str | None = "bitune-sft") -> TrlParser:
    dataclass_types = (ScriptArguments, BituneSFTConfig, BituneModelConfig, DatasetMixtureConfig, BituneArguments)
    return TrlParser(dataclass_types, prog=prog)


def build_peft_config(model_args: ModelConfig, bitune_args: BituneArguments) -> BituneConfig:
    """The Bitune adapter the flags describe: `trl sft`'s LoRA config for both weight sets, plus the mixing
    settings."""
    from trl import get_peft_config

    adapter_config = get_peft_config(dataclasses.replace(model_args, use_peft=True))
    return BituneConfig(adapter_config=adapter_config, **dataclasses.asdict(bitune_args))


def main(argv: Sequence[str] | None = None) -> None:
    """
    `bitune-sft`: launch a training run through `accelerate launch`, the way `trl sft` does.

    The arguments (`argv`, or the command line) that the training parser knows (and `--config`) go to the training
    script, `python -m trl_integration.cli`; the others (`--num_processes`, `--config_file`, `--multi_gpu`, ... and
    TRL's `--accelerate_config zero2|fsdp2|<file>`) go to `accelerate launch`. `--help` lists the training arguments.
    """
    from accelerate.commands.launch import launch_command, launch_command_parser
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    argv = list(sys.argv[1:] if argv is None else argv)
    *_, config_remaining, cli_remaining = make_parser().parse_args_and_config(
        argv, return_remaining_strings=True, separate_remaining_strings=True
    )
    launch_args = resolve_accelerate_config_argument(config_remaining + cli_remaining)
    training_script_args = _without_subsequence(argv, cli_remaining)
    launch_parser = launch_command_parser()
    _, unknown = launch_parser.parse_known_args([*launch_args, "--module", TRAINING_MODULE])
    if unknown:
        raise ValueError(
            f"Unknown arguments {unknown}: neither a training argument of `bitune-sft` (see `bitune-sft --help`) nor "
            "an `accelerate launch` argument (see `accelerate launch --help`)."
        )
    launch_command(launch_parser.parse_args([*launch_args, "--module", TRAINING_MODULE, *training_script_args]))


def train(argv: Sequence[str] | None = None) -> None:
    """The training script that `bitune-sft` launches (`python -m trl_integration.cli`, in every process): parse the
    arguments (`argv`, or the command line) and train, save and optionally push, as `trl sft`'s script does."""
    parser = make_parser()
    script_args, training_args, model_args, dataset_args, bitune_args = parser.parse_args_and_config(
        args=argv, fail_with_unknown_args=True
    )
    run(script_args, training_args, model_args, dataset_args, bitune_args)


def _without_subsequence(items: list[str], subsequence: list[str]) -> list[str]:
    """`items` with the ordered `subsequence` removed (the launcher's arguments out of the command line)."""
    remaining = iter(subsequence)
    current = next(remaining, None)
    result = []
    for item in items:
        if current is not None and item == current:
            current = next(remaining, None)
        else:
            result.append(item)
    return result


def run(
    script_args: ScriptArguments,
    training_args: BituneSFTConfig,
    model_args: ModelConfig,
    dataset_args: DatasetMixtureConfig,
    bitune_args: BituneArguments,
) -> None:
    import transformers
    from datasets import load_dataset
    from packaging.version import Version
    from trl import get_dataset, get_quantization_config

    from .trainer import BituneSFTTrainer

    peft_config = build_peft_config(model_args, bitune_args)  # validated before any loading
    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs

    if dataset_args.datasets:
        if script_args.dataset_name:
            warnings.warn(
                "Both `datasets` (from the config file) and `--dataset_name` are set; `datasets` is used and "
                "`--dataset_name` is ignored, as in `trl sft`."
            )
        dataset = get_dataset(dataset_args)
    elif script_args.dataset_name:
        dataset = load_dataset(
            script_args.dataset_name, name=script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    else:
        raise ValueError(
            "Pass a dataset: `--dataset_name` (a Hub id or a local path) or `datasets` in a `--config` file."
        )

    trainer = BituneSFTTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
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


if __name__ == "__main__":
    train()
