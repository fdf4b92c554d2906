"""`BituneSFTConfig`, and the model and settings `BituneSFTTrainer` makes of its arguments."""

from __future__ import annotations

import datasets
import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM
from trl import SFTConfig

import trl_helpers as helpers
from peft_bitune import BituneConfig, BituneModel, compat
from trl_helpers import (
    trainable_state,
    weight_set_state,
)
from trl_integration import BituneSFTConfig, BituneSFTTrainer
from trl_integration.cli import BituneArguments
from trl_integration.trainer import keep_mixing_scalars_in_float32

datasets.disable_progress_bars()


def test_config_makes_checkpointing_non_reentrant(tmp_path):
    kwargs_name = compat.CHECKPOINTING_KWARGS_ARGUMENT  # `activation_checkpointing_kwargs` from transformers 5.23
    config = BituneSFTConfig(output_dir=str(tmp_path), use_cpu=True)
    assert getattr(config, compat.CHECKPOINTING_ARGUMENT) is True  # TRL's default, kept
    for name in compat.CHECKPOINTING_KWARGS_ARGUMENTS:  # the deprecated alias, where there is one, mirrors it
        assert getattr(config, name) == {"use_reentrant": False}
    config = BituneSFTConfig(output_dir=str(tmp_path), use_cpu=True, **{kwargs_name: {"every_n_layers": 1}})
    assert getattr(config, kwargs_name) == {"every_n_layers": 1, "use_reentrant": False}
    with pytest.raises(ValueError, match=f"non-reentrant gradient checkpointing.*`{kwargs_name}`"):
        BituneSFTConfig(output_dir=str(tmp_path), use_cpu=True, **{kwargs_name: {"use_reentrant": True}})


def test_config_takes_the_checkpointing_switch_under_either_name(tmp_path):
    """TRL's default (on) goes to the current name, so that an explicit deprecated `gradient_checkpointing=False`
    still turns checkpointing off."""
    for name in ("gradient_checkpointing", compat.CHECKPOINTING_ARGUMENT):
        config = BituneSFTConfig(output_dir=str(tmp_path), use_cpu=True, **{name: False})
        assert [getattr(config, flag) for flag in compat.CHECKPOINTING_ARGUMENTS] == [False] * len(
            compat.CHECKPOINTING_ARGUMENTS
        )


@pytest.mark.parametrize("setting", ["packing", "eval_packing"])
def test_config_refuses_wrapped_packing_and_accepts_the_strategies_that_keep_examples_whole(tmp_path, setting):
    with pytest.raises(ValueError, match=r"`packing_strategy='wrapped'` is not supported by Bitune: it cuts examples"):
        BituneSFTConfig(output_dir=str(tmp_path), use_cpu=True, packing_strategy="wrapped", **{setting: True})
    for strategy in ("bfd", "bfd_split"):
        config = BituneSFTConfig(output_dir=str(tmp_path), use_cpu=True, packing_strategy=strategy, **{setting: True})
        assert getattr(config, setting) and config.packing_strategy == strategy
    assert BituneSFTConfig(output_dir=str(tmp_path), use_cpu=True, padding_free=True).padding_free
    # Not packing, the strategy is not used.
    assert BituneSFTConfig(output_dir=str(tmp_path), use_cpu=True, packing_strategy="wrapped").packing_strategy


def test_config_refuses_a_negative_per_layer_interval(tmp_path):
    with pytest.raises(ValueError, match="mixing_logging_steps"):
        BituneSFTConfig(output_dir=str(tmp_path), use_cpu=True, mixing_logging_steps=-1)


# ---------------------------------------------------------------------- the model the trainer builds
def test_peft_config_defaults_to_bitune_config(tmp_path, trl_model_dir):
    sft_args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, learning_rate=3e-4, report_to=[])
    trainer = BituneSFTTrainer(
        model=trl_model_dir,
        args=sft_args,  # a plain SFTConfig is converted, keeping its values
        train_dataset=datasets.Dataset.from_list(helpers.prompt_completion_rows(4)),
        processing_class=helpers.build_tokenizer(),
    )
    assert isinstance(trainer.model.base_model, BituneModel)
    config, default = trainer.model.peft_config["default"], BituneConfig()
    assert isinstance(config, BituneConfig)
    for field in BituneArguments.__dataclass_fields__:  # every Bitune setting of its own
        assert getattr(config, field) == getattr(default, field)
    assert (config.adapter_config.r, config.adapter_config.lora_alpha) == (8, 16)
    trainable = trainable_state(trainer.model)
    assert weight_set_state(trainer.model, "causal") and weight_set_state(trainer.model, "bidirectional")
    assert any("bitune_mixers" in name for name in trainable)
    assert isinstance(trainer.args, BituneSFTConfig) and trainer.args.learning_rate == 3e-4
    assert getattr(trainer.args, compat.CHECKPOINTING_KWARGS_ARGUMENT) == {"use_reentrant": False}


def test_mixing_scalars_stay_float32(tmp_path, trl_model_dir):
    """TRL casts the trainable parameters of quantized models to bf16; the trainer restores float32 scalars."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(trl_model_dir), helpers.small_bitune_config())
    mixer = model.base_model.mixer
    expected = mixer.key_weights.detach().clone()
    for parameter in mixer.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    keep_mixing_scalars_in_float32(model)
    assert mixer.key_weights.dtype == mixer.value_weights.dtype == torch.float32
    torch.testing.assert_close(mixer.key_weights.detach(), expected.to(torch.bfloat16).float())
