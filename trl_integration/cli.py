"""`bitune-sft`: TRL's `trl sft` command for Bitune adapters.

It parses the same arguments with TRL's own parser and configs (`ScriptArguments`, the SFT training config,
`ModelConfig`, `DatasetMixtureConfig`, `--config file.yaml`), plus the Bitune settings, and always trains a Bitune
adapter (`--use_peft` is implied). The `--lora_*` flags configure the method of both weight sets; their defaults are
Bitune's (LoRA r=8, alpha=16, no dropout, all linear layers) rather than `trl sft`'s.

```bash
bitune-sft --model_name_or_path Qwen/Qwen2-0.5B --dataset_name trl-lib/tldr --output_dir Qwen2-0.5B-Bitune \
    --learning_rate 3e-4 --per_device_train_batch_size 8 --mix_init 0.01
accelerate launch --num_processes 8 -m trl_integration.cli --model_name_or_path ... # several GPUs
```
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from peft_bitune import BituneConfig
from peft_bitune.config import MULTI_TURN_MODES, SECOND_PASS_ATTENTIONS
from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser

from .config import BituneSFTConfig

_BITUNE_DEFAULTS = BituneConfig.__dataclass_fields__


@dataclass
class BituneArguments:
    """The Bitune settings of `BituneConfig` other than the weight-set method (which the `--lora_*` flags set)."""

    mix_init: float = field(
        default=_BITUNE_DEFAULTS["mix_init"].default, metadata={"help": "Initial value of every mixing scalar `w`."}
    )
    mix_scale: float = field(
        default=_BITUNE_DEFAULTS["mix_scale"].default, metadata={"help": "The constant `s` in alpha = |w| / (|w| + s)."}
    )
    shared_weights: bool = field(
        default=_BITUNE_DEFAULTS["shared_weights"].default,
        metadata={"help": "Ablation: one weight set (the causal one) serves both prompt passes."},
    )
    second_pass_attention: str = field(
        default=_BITUNE_DEFAULTS["second_pass_attention"].default,
        metadata={"help": "Mask of the second prompt pass.", "choices": list(SECOND_PASS_ATTENTIONS)},
    )
    train_mixing: bool = field(
        default=_BITUNE_DEFAULTS["train_mixing"].default,
        metadata={"help": "Ablation: False freezes the mixing scalars at `mix_init`."},
    )
    multi_turn: str = field(
        default=_BITUNE_DEFAULTS["multi_turn"].default,
        metadata={
            "help": "Training on rows with several instruction/answer segments: 'alternating' or whole 'history'.",
            "choices": list(MULTI_TURN_MODES),
        },
    )


@dataclass
class BituneModelConfig(ModelConfig):
    """TRL's `ModelConfig` with Bitune's (the paper's) LoRA defaults for both weight sets."""

    lora_r: int = field(default=8, metadata={"help": "LoRA R value of both weight sets."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha of both weight sets."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout of both weight sets."})
    lora_target_modules: list[str] | None = field(
        default_factory=lambda: ["all-linear"], metadata={"help": "LoRA target modules of both weight sets."}
    )


def make_parser(prog: str | None = "bitune-sft") -> TrlParser:
    dataclass_types = (ScriptArguments, BituneSFTConfig, BituneModelConfig, DatasetMixtureConfig, BituneArguments)
    return TrlParser(dataclass_types, prog=prog)


def build_peft_config(model_args: ModelConfig, bitune_args: BituneArguments) -> BituneConfig:
    """The Bitune adapter the flags describe: `trl sft`'s LoRA config for both weight sets, plus the mixing settings."""
    from trl import get_peft_config

    adapter_config = get_peft_config(dataclasses.replace(model_args, use_peft=True))
    return BituneConfig(adapter_config=adapter_config, **dataclasses.asdict(bitune_args))


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the arguments (`argv`, or the command line) and train, save and optionally push, as `trl sft` does."""
    parser = make_parser()
    script_args, training_args, model_args, dataset_args, bitune_args = parser.parse_args_and_config(
        args=argv, fail_with_unknown_args=True
    )
    run(script_args, training_args, model_args, dataset_args, bitune_args)


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
    main()
