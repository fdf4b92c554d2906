"""What `BituneSFTTrainer` refuses before any work (trl_integration/checks.py): settings that break the three-pass
forward, non-Bitune PEFT configs, and data that carries no instruction/answer boundary."""

from __future__ import annotations

import types

import datasets
import pytest
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

import trl_helpers as helpers
from trl_helpers import (
    first_batch,
    make_trainer,
    never_loaded,
)
from trl_integration import BituneSFTTrainer

datasets.disable_progress_bars()



def test_wrapped_packing_set_after_the_config_was_made_is_refused_by_the_trainer(tmp_path):
    args = helpers.training_args(tmp_path)
    args.packing, args.packing_strategy = True, "wrapped"  # after `__post_init__`, which refuses it in the constructor
    with pytest.raises(ValueError, match=r"`packing_strategy='wrapped'` is not supported by Bitune"):
        BituneSFTTrainer(
            model=never_loaded(tmp_path),
            args=args,
            train_dataset=datasets.Dataset.from_list(helpers.prompt_completion_rows(4)),
            processing_class=helpers.build_tokenizer(),
            peft_config=helpers.small_bitune_config(),
        )


def test_refuses_a_non_bitune_peft_config(tmp_path):
    with pytest.raises(ValueError, match=r"must be a `BituneConfig`, got LoraConfig.*BituneConfig\(adapter_config="):
        make_trainer(never_loaded(tmp_path), tmp_path, peft_config=LoraConfig(r=4))


def test_refuses_a_peft_model_with_another_adapter(tmp_path, trl_model_dir):
    lora_model = get_peft_model(AutoModelForCausalLM.from_pretrained(trl_model_dir), LoraConfig(r=4))
    with pytest.raises(ValueError, match="LoraConfig adapter; BituneSFTTrainer trains Bitune adapters"):
        BituneSFTTrainer(
            model=lora_model,
            args=helpers.training_args(tmp_path),
            train_dataset=datasets.Dataset.from_list(helpers.prompt_completion_rows(4)),
            processing_class=helpers.build_tokenizer(),
        )


def test_refuses_a_frozen_adapter_naming_is_trainable(tmp_path, trl_model_dir):
    """A loaded adapter is frozen unless `is_trainable=True`; training it failed in torch's backward instead."""
    get_peft_model(AutoModelForCausalLM.from_pretrained(trl_model_dir), helpers.small_bitune_config()).save_pretrained(
        tmp_path / "adapter"
    )
    frozen = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trl_model_dir), tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"`default` of `model` has no trainable weights, so BituneSFTTrainer.*"
                                         r"is_trainable=True"):
        BituneSFTTrainer(
            model=frozen,
            args=helpers.training_args(tmp_path),
            train_dataset=datasets.Dataset.from_list(helpers.prompt_completion_rows(4)),
            processing_class=helpers.build_tokenizer(),
        )


@pytest.mark.parametrize(
    ("rows", "args", "message"),
    [
        ([{"text": "what is 1 plus 2 ? 3"}], {}, r"columns \['text'\]: plain-text language modelling data"),
        (helpers.conversation_rows(2), {}, "Set `assistant_only_loss=True`"),
        (
            helpers.prompt_completion_rows(2),
            {"completion_only_loss": False},
            "`completion_only_loss=False` supervises",
        ),
        ([{"input_ids": [1, 27, 28]}], {}, "is tokenized but has no `labels` column"),
        ([{"prompt": "what is", "completion": " 1", "images": []}], {}, "holds images"),
    ],
    ids=["text", "conversation-without-assistant-only-loss", "completion-only-loss-off", "tokenized-no-labels",
         "vision"],
)
def test_refuses_data_without_an_instruction_boundary(tmp_path, rows, args, message):
    with pytest.raises(ValueError, match=message) as error:
        make_trainer(never_loaded(tmp_path), tmp_path, rows=rows, **args)
    if "Formats that work" in str(error.value):
        assert "prompt-completion rows" in str(error.value) and "assistant_only_loss=True" in str(error.value)


def test_refuses_a_loss_type_it_does_not_implement(tmp_path, trl_model_dir):
    """TRL refuses names it does not know when the trainer is made; a name a later TRL knows would pass its check and,
    without this refusal, train as plain NLL. Refused before TRL's own check, and again in `compute_loss` after TRL
    has accepted the trainer's arguments (the name is set then, as a newer TRL would have let it through)."""
    message = r"`loss_type='focal'` is not implemented by BituneSFTTrainer.*\['nll', 'dft'\]"
    with pytest.raises(ValueError, match=message):
        make_trainer(never_loaded(tmp_path), tmp_path, loss_type="focal")
    trainer = make_trainer(trl_model_dir, tmp_path)
    trainer.args.loss_type = "focal"
    batch = first_batch(trainer)
    forwards = []
    trainer.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    with pytest.raises(ValueError, match=message):
        trainer.compute_loss(trainer.model, dict(batch))
    assert not forwards  # refused before the forward


def test_refuses_a_formatting_function(tmp_path):
    with pytest.raises(ValueError, match="`formatting_func` turns every row into plain text"):
        BituneSFTTrainer(
            model=never_loaded(tmp_path),
            args=helpers.training_args(tmp_path),
            train_dataset=datasets.Dataset.from_list(helpers.prompt_completion_rows(2)),
            processing_class=helpers.build_tokenizer(),
            formatting_func=lambda row: row["prompt"] + row["completion"],
        )


def test_refuses_deepspeed_zero3_with_gradient_checkpointing(tmp_path):
    args = helpers.training_args(tmp_path, checkpointing=True)
    args.deepspeed_plugin = types.SimpleNamespace(zero_stage=3)  # what `--deepspeed zero3.json` leaves on the args
    with pytest.raises(ValueError, match="DeepSpeed ZeRO-3 with gradient checkpointing is not supported"):
        BituneSFTTrainer(
            model=never_loaded(tmp_path),
            args=args,
            train_dataset=datasets.Dataset.from_list(helpers.prompt_completion_rows(2)),
            processing_class=helpers.build_tokenizer(),
        )


def test_refuses_ddp_without_unused_parameter_detection(tmp_path):
    with pytest.raises(ValueError, match="`ddp_find_unused_parameters=False` makes DDP fail"):
        make_trainer(never_loaded(tmp_path), tmp_path, ddp_find_unused_parameters=False)


def test_refuses_fsdp_activation_checkpointing(tmp_path, monkeypatch):
    # What `accelerate launch --use_fsdp --fsdp_activation_checkpointing true` sets.
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    with pytest.raises(ValueError, match="FSDP's own activation checkpointing"):
        make_trainer(never_loaded(tmp_path), tmp_path)


@pytest.mark.parametrize(
    ("labels", "message"),
    [([1, 27, 28, 13], "have no instruction: their first token"), ([-100] * 4, "have no supervised token")],
    ids=["supervised-from-the-first-token", "nothing-supervised"],
)
def test_refuses_tokenized_rows_without_instruction_or_answer(tmp_path, trl_model_dir, labels, message):
    rows = [
        {"input_ids": [1, 27, 28, 13, 14], "labels": [-100, -100, -100, 13, 14]},
        {"input_ids": [1, 27, 28, 13], "labels": labels},
    ]
    # Without `max_length`, TRL keeps rows that supervise nothing (it drops them only when truncating).
    with pytest.raises(ValueError, match=rf"Rows \[1\] of the prepared `train_dataset` {message}"):
        make_trainer(trl_model_dir, tmp_path, rows=rows, max_length=None)


def test_rows_that_truncation_leaves_without_an_answer_are_counted_in_a_warning(tmp_path, trl_model_dir):
    with pytest.warns(UserWarning, match=r"6 of the 16 rows of `train_dataset` were dropped .* `max_length=10`"):
        trainer = make_trainer(trl_model_dir, tmp_path, max_length=10)
    assert len(trainer.train_dataset) == 10


def test_an_empty_dataset_is_refused_by_name(tmp_path, trl_model_dir):
    with pytest.raises(ValueError, match="`train_dataset` is empty"):
        make_trainer(trl_model_dir, tmp_path, rows=[])


# ---------------------------------------------------------------------- TRL's own SFTTrainer: named by the forward
@pytest.mark.parametrize(
    ("rows", "args", "message"),
    [
        (helpers.prompt_completion_rows(8), {"completion_only_loss": False},
         r"are supervised at every token \(by `labels`\).*`completion_only_loss=False`"),
        ([{"text": f"{question} answer : {answer}"} for question, answer in helpers.arithmetic_rows(8)], {},
         r"are supervised at every token \(by `labels`\).*plain-text \(`text`\)"),
    ],
    ids=["completion-only-loss-off", "text"],
)
def test_trls_own_sft_trainer_is_refused_for_the_real_reason(tmp_path, trl_model_dir, rows, args, message):
    """`BituneSFTTrainer` refuses these before any work; TRL's `SFTTrainer` given a `BituneConfig` reaches the
    Bitune forward at step 1, which names the same cause (rows that are all answer), not a consequence (a row
    starting with an answer token)."""
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, report_to=[],
                       save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False, dataloader_num_workers=0,
                       **args)
    trainer = SFTTrainer(model=trl_model_dir, args=config, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=helpers.build_tokenizer(), peft_config=helpers.small_bitune_config())
    with pytest.raises(ValueError, match=message):
        trainer.train()
