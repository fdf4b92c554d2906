"""`BituneSFTTrainer` / `BituneSFTConfig` / `bitune-sft`: TRL's SFT pipeline training Bitune adapters, on CPU, offline.

The loss and TRL's metrics are checked against the one-row-at-a-time references (tests/reference.py, and the multi-turn
one of tests/test_multi_turn.py), with the instruction/answer segments taken from the labels TRL builds; training,
saving, resumption, gradient checkpointing, bf16 and DDP are checked end to end on a tiny Llama with a local
word-level tokenizer. FSDP is tested in test_sharding.py (accelerate runs it only on accelerators).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import datasets
import pytest
import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
from torch.nn import functional as F
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments
from transformers.trainer_pt_utils import LabelSmoother
from trl import SFTConfig

import trl_helpers as helpers
from peft_bitune import BituneConfig, BituneMixingCallback, BituneModel, compat
from peft_bitune.visualize import mixing_history
from reference import reference_alternating, reference_row
from trl_integration import BituneSFTConfig, BituneSFTTrainer
from trl_integration.cli import BituneArguments, make_parser
from trl_integration.cli import main as cli_main
from trl_integration.cli import train as cli_train
from trl_integration.trainer import keep_mixing_scalars_in_float32

datasets.disable_progress_bars()

IGNORE_INDEX = -100


# ---------------------------------------------------------------------- fixtures and small helpers
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return helpers.save_model_and_tokenizer(tmp_path_factory.mktemp("trl_model"))


def make_trainer(model_dir, output_dir, rows=None, peft_config=None, **args) -> BituneSFTTrainer:
    rows = helpers.prompt_completion_rows(16) if rows is None else rows
    return BituneSFTTrainer(
        model=model_dir,
        args=helpers.training_args(output_dir, **args),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=helpers.build_tokenizer(),
        peft_config=helpers.small_bitune_config() if peft_config is None else peft_config,
    )


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def adapter_state(model) -> dict[str, torch.Tensor]:
    """Both weight sets and the mixing scalars, trainable or not (a loaded adapter is frozen)."""
    return {n: p.detach() for n, p in model.named_parameters() if "lora_" in n or "bitune_mixers" in n}


def weight_set_state(model, weight_set: str) -> dict[str, torch.Tensor]:
    return {name: p for name, p in trainable_state(model).items() if f"default__{weight_set}" in name}


def receives_gradient(name: str, num_layers: int = helpers.model_config().num_hidden_layers) -> bool:
    """Every trainable weight gets a gradient except, by construction, the bidirectional weights of the last layer
    outside its key/value projections: the bidirectional pass is used only for the keys/values it writes, and the last
    layer's attention output and MLP feed no further layer."""
    last_layer = f".layers.{num_layers - 1}."
    writes_the_cache = "k_proj" in name or "v_proj" in name
    return not ("default__bidirectional" in name and last_layer in name and not writes_the_cache)


def mixer_state(model) -> torch.Tensor:
    mixer = model.base_model.mixer
    return torch.cat([mixer.key_weights.detach(), mixer.value_weights.detach()]).clone()


def first_batch(trainer) -> dict[str, torch.Tensor]:
    return next(iter(trainer.get_train_dataloader()))


def loss_and_logged_metrics(trainer, batch) -> tuple[torch.Tensor, dict[str, float]]:
    """`compute_loss` on `batch` (without gradients), and the training log written right after it: TRL's metrics of
    that batch, as the trainer reports them. Whatever an earlier call left unlogged is logged first."""
    assert trainer.model.training, "the metrics would be logged as evaluation metrics"
    trainer.log({})
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, dict(batch))
    trainer.log({})
    return loss, trainer.state.log_history[-1]


def randomize_adapters(model, seed: int = 0) -> None:
    """Non-trivial, different weight sets and mixing scalars (LoRA's B starts at zero otherwise)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.requires_grad:
                parameter.copy_(0.002 + 0.05 * torch.rand(parameter.shape, generator=generator))


def turns_from_labels(labels: torch.Tensor) -> tuple[list[tuple[int, int]], int]:
    """(instruction length, answer length) of each turn of one unpadded row, and its trailing unsupervised tokens:
    the instruction/answer segments exactly as the labels mark them."""
    supervised = (labels != IGNORE_INDEX).tolist()
    runs, start = [], 0
    for position in range(1, len(supervised) + 1):
        if position == len(supervised) or supervised[position] != supervised[start]:
            runs.append((supervised[start], position - start))
            start = position
    trailing = runs.pop()[1] if not runs[-1][0] else 0
    assert [is_answer for is_answer, _ in runs] == [False, True] * (len(runs) // 2)
    return [(runs[i][1], runs[i + 1][1]) for i in range(0, len(runs), 2)], trailing


def reference_predictions(model, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits predicting each supervised token of one unpadded row, and those tokens, from the per-row references."""
    turns, trailing = turns_from_labels(labels)
    if len(turns) == 1:
        (instruction, answer), = turns
        logits, _ = reference_row(model, tokens, instruction)
        return logits[:answer], tokens[instruction : instruction + answer]
    _, turn_logits = reference_alternating(model, tokens, turns, trailing)
    logits, targets, position = [], [], 0
    for (instruction, answer), turn in zip(turns, turn_logits):
        logits.append(turn[:answer])
        targets.append(tokens[position + instruction : position + instruction + answer])
        position += instruction + answer
    return torch.cat(logits), torch.cat(targets)


def reference_statistics(model, batch) -> dict[str, float]:
    """Loss (plain, DFT, label-smoothed), entropy and top-1 accuracy over the supervised tokens, one row at a time
    with the reference forwards; each row's segments are those its labels mark."""
    entropies, correct, nll, dft, uniform = [], [], [], [], []
    for row in range(batch["input_ids"].shape[0]):
        length = int(batch["attention_mask"][row].sum())
        logits, targets = reference_predictions(model, batch["input_ids"][row, :length], batch["labels"][row, :length])
        log_probs = F.log_softmax(logits.float(), dim=-1)
        target_log_probs = log_probs.gather(1, targets[:, None]).squeeze(1)
        nll += (-target_log_probs).tolist()
        dft += (-target_log_probs * target_log_probs.exp()).tolist()
        uniform += (-log_probs.mean(-1)).tolist()
        entropies += (-(log_probs.exp() * log_probs).sum(-1)).tolist()
        correct += (log_probs.argmax(-1) == targets).tolist()
    count = len(nll)
    return {
        "loss": sum(nll) / count,
        "dft_loss": sum(dft) / count,
        "smoothed_loss": 0.9 * sum(nll) / count + 0.1 * sum(uniform) / count,  # label smoothing 0.1
        "entropy": sum(entropies) / count,
        "mean_token_accuracy": sum(correct) / count,
    }


# ---------------------------------------------------------------------- config
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


@pytest.mark.parametrize("setting", ["packing", "padding_free", "eval_packing"])
def test_config_refuses_packing_and_padding_free(tmp_path, setting):
    with pytest.raises(ValueError, match=f"`{setting}=True` is not supported by Bitune"):
        BituneSFTConfig(output_dir=str(tmp_path), use_cpu=True, **{setting: True})


def test_config_refuses_a_negative_per_layer_interval(tmp_path):
    with pytest.raises(ValueError, match="mixing_logging_steps"):
        BituneSFTConfig(output_dir=str(tmp_path), use_cpu=True, mixing_logging_steps=-1)


# ---------------------------------------------------------------------- refusals before any work
# The model path does not exist: these must fail before anything is loaded.
def never_loaded(tmp_path) -> str:
    return str(tmp_path / "never-loaded")


@pytest.mark.parametrize("setting", ["packing", "padding_free"])
def test_packing_set_after_the_config_was_made_is_refused_by_the_trainer(tmp_path, setting):
    args = helpers.training_args(tmp_path)
    setattr(args, setting, True)  # after `__post_init__`, which refuses it in the constructor
    with pytest.raises(ValueError, match=f"`{setting}=True` is not supported by Bitune"):
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


def test_refuses_a_peft_model_with_another_adapter(tmp_path, model_dir):
    lora_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=4))
    with pytest.raises(ValueError, match="LoraConfig adapter; BituneSFTTrainer trains Bitune adapters"):
        BituneSFTTrainer(
            model=lora_model,
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


def test_refuses_a_loss_type_it_does_not_implement(tmp_path, model_dir):
    """TRL refuses names it does not know when the trainer is made; a name a later TRL knows would pass its check and,
    without this refusal, train as plain NLL. Refused before TRL's own check, and again in `compute_loss` after TRL
    has accepted the trainer's arguments (the name is set then, as a newer TRL would have let it through)."""
    message = r"`loss_type='focal'` is not implemented by BituneSFTTrainer.*\['nll', 'dft'\]"
    with pytest.raises(ValueError, match=message):
        make_trainer(never_loaded(tmp_path), tmp_path, loss_type="focal")
    trainer = make_trainer(model_dir, tmp_path)
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
def test_refuses_tokenized_rows_without_instruction_or_answer(tmp_path, model_dir, labels, message):
    rows = [
        {"input_ids": [1, 27, 28, 13, 14], "labels": [-100, -100, -100, 13, 14]},
        {"input_ids": [1, 27, 28, 13], "labels": labels},
    ]
    # Without `max_length`, TRL keeps rows that supervise nothing (it drops them only when truncating).
    with pytest.raises(ValueError, match=rf"Rows \[1\] of the prepared `train_dataset` {message}"):
        make_trainer(model_dir, tmp_path, rows=rows, max_length=None)


# ---------------------------------------------------------------------- the model the trainer builds
def test_peft_config_defaults_to_bitune_config(tmp_path, model_dir):
    sft_args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, learning_rate=3e-4, report_to=[])
    trainer = BituneSFTTrainer(
        model=model_dir,
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


def test_mixing_scalars_stay_float32(tmp_path, model_dir):
    """TRL casts the trainable parameters of quantized models to bf16; the trainer restores float32 scalars."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), helpers.small_bitune_config())
    mixer = model.base_model.mixer
    expected = mixer.key_weights.detach().clone()
    for parameter in mixer.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    keep_mixing_scalars_in_float32(model)
    assert mixer.key_weights.dtype == mixer.value_weights.dtype == torch.float32
    torch.testing.assert_close(mixer.key_weights.detach(), expected.to(torch.bfloat16).float())


# ---------------------------------------------------------------------- loss and TRL's metrics
@pytest.fixture(scope="module")
def random_adapter_trainer(model_dir, tmp_path_factory):
    adapter = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    trainer = make_trainer(
        model_dir, tmp_path_factory.mktemp("metrics"), peft_config=BituneConfig(adapter_config=adapter)
    )
    randomize_adapters(trainer.model)
    return trainer


@pytest.mark.parametrize("loss", ["loss", "dft_loss", "smoothed_loss"])
def test_loss_and_metrics_match_the_reference_forward(random_adapter_trainer, loss):
    trainer = random_adapter_trainer
    batch = first_batch(trainer)
    assert bool((batch["attention_mask"] == 0).any()), "the batch must hold right-padded rows"
    trainer.args.loss_type = "dft" if loss == "dft_loss" else "nll"
    trainer.label_smoother = LabelSmoother(epsilon=0.1) if loss == "smoothed_loss" else None
    try:
        value, logged = loss_and_logged_metrics(trainer, batch)
    finally:
        trainer.args.loss_type, trainer.label_smoother = "nll", None
    expected = reference_statistics(trainer.model, batch)
    assert value.item() == pytest.approx(expected[loss], abs=1e-5)
    assert logged["entropy"] == pytest.approx(expected["entropy"], abs=1e-5)
    assert logged["mean_token_accuracy"] == pytest.approx(expected["mean_token_accuracy"])
    assert logged["num_tokens"] >= int(batch["attention_mask"].sum())


def test_accuracy_metric_counts_correct_predictions(random_adapter_trainer):
    """Accuracy on random weights is near zero; make some predictions right to check the metric sees them."""
    trainer = random_adapter_trainer
    batch = first_batch(trainer)
    with torch.no_grad():
        logits = trainer.model(**batch).logits
    predicted = batch["labels"].clone()
    predicted[:, 1:] = torch.where(batch["labels"][:, 1:] != IGNORE_INDEX, logits[:, :-1].argmax(-1), IGNORE_INDEX)
    _, logged = loss_and_logged_metrics(trainer, {**batch, "labels": predicted})
    assert logged["mean_token_accuracy"] == pytest.approx(1.0)


@pytest.mark.parametrize("conversation_format", ["messages", "prompt-completion"])
def test_single_turn_conversations_train_on_the_assistant_answer(tmp_path, model_dir, conversation_format):
    rows = helpers.conversation_rows(8)
    if conversation_format == "prompt-completion":
        rows = [{"prompt": row["messages"][:1], "completion": row["messages"][1:]} for row in rows]
    adapter = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    trainer = make_trainer(
        model_dir, tmp_path, rows=rows, peft_config=BituneConfig(adapter_config=adapter),
        assistant_only_loss=conversation_format == "messages",
    )
    randomize_adapters(trainer.model)
    batch = first_batch(trainer)
    tokenizer = helpers.build_tokenizer()
    for row in range(batch["input_ids"].shape[0]):
        first = int((batch["labels"][row] != IGNORE_INDEX).nonzero()[0])
        # The instruction the model reads ends with the assistant marker; the answer is the assistant's words.
        assert tokenizer.convert_ids_to_tokens(int(batch["input_ids"][row, first - 1])) == "<|assistant|>"
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, dict(batch))
    assert loss.item() == pytest.approx(reference_statistics(trainer.model, batch)["loss"], abs=1e-5)


def test_multi_turn_conversations_train_on_every_assistant_answer(tmp_path, model_dir):
    """Two-turn conversations: both answers are supervised, and the loss and metrics are those of the alternating
    multi-turn reference with the segments the labels mark."""
    adapter = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    trainer = make_trainer(
        model_dir, tmp_path, rows=helpers.conversation_rows(4, turns=2),
        peft_config=BituneConfig(adapter_config=adapter), assistant_only_loss=True,
    )
    randomize_adapters(trainer.model)
    batch = first_batch(trainer)
    for row in range(batch["input_ids"].shape[0]):
        length = int(batch["attention_mask"][row].sum())
        assert len(turns_from_labels(batch["labels"][row, :length])[0]) == 2
    loss, logged = loss_and_logged_metrics(trainer, batch)
    expected = reference_statistics(trainer.model, batch)
    assert loss.item() == pytest.approx(expected["loss"], abs=1e-5)
    assert logged["entropy"] == pytest.approx(expected["entropy"], abs=1e-5)
    assert logged["mean_token_accuracy"] == pytest.approx(expected["mean_token_accuracy"])


# ---------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def trained(model_dir, tmp_path_factory):
    """Six steps of training, with the state before and after, and the mean loss on the training rows before/after."""
    rows = helpers.prompt_completion_rows(16)
    trainer = BituneSFTTrainer(
        model=model_dir,
        args=helpers.training_args(tmp_path_factory.mktemp("trained"), max_steps=6, mixing_logging_steps=2),
        train_dataset=datasets.Dataset.from_list(rows),
        eval_dataset=datasets.Dataset.from_list(rows),
        processing_class=helpers.build_tokenizer(),
        peft_config=helpers.small_bitune_config(),
    )
    before = {
        "causal": weight_set_state(trainer.model, "causal"),
        "bidirectional": weight_set_state(trainer.model, "bidirectional"),
        "mixer": mixer_state(trainer.model),
        "eval_loss": trainer.evaluate()["eval_loss"],
    }
    trainer.train()
    after = {
        "causal": weight_set_state(trainer.model, "causal"),
        "bidirectional": weight_set_state(trainer.model, "bidirectional"),
        "mixer": mixer_state(trainer.model),
        "eval_loss": trainer.evaluate()["eval_loss"],
    }
    return trainer, before, after


def test_training_reduces_the_loss_and_changes_both_weight_sets_and_the_mixing(trained):
    trainer, before, after = trained
    assert after["eval_loss"] < before["eval_loss"] - 0.05
    for weight_set in ("causal", "bidirectional"):
        assert before[weight_set]
        for name in before[weight_set]:
            changed = not torch.equal(before[weight_set][name], after[weight_set][name])
            assert changed == receives_gradient(name), name
    assert bool((before["mixer"] != after["mixer"]).all())
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 6 and losses[-1] < losses[0]


def test_mixing_coefficients_are_logged(trained):
    trainer = trained[0]
    train_logs = [log for log in trainer.state.log_history if "loss" in log]
    assert all("bitune/alpha_keys_mean" in log and "bitune/alpha_values_mean" in log for log in train_logs)
    per_layer_steps = [log["step"] for log in train_logs if "bitune/alpha_keys/layer_0" in log]
    assert per_layer_steps == [1, 3, 5]  # the first log, then every `mixing_logging_steps=2` steps
    for log in trainer.state.log_history:
        if "loss" not in log:  # eval logs and the end-of-training summary carry no mixing values
            assert not any(key.startswith("bitune/") for key in log)
    # The last log was written after the last optimizer step: it holds the final coefficients.
    coefficients = trainer.model.base_model.get_mixing_coefficients()
    assert train_logs[-1]["bitune/alpha_keys_mean"] == pytest.approx(coefficients["keys"].mean().item())
    assert train_logs[-1]["bitune/alpha_values_mean"] == pytest.approx(coefficients["values"].mean().item())
    last_per_layer = [log for log in train_logs if "bitune/alpha_keys/layer_0" in log][-1]
    assert last_per_layer["step"] == 5 and last_per_layer["bitune/alpha_values/layer_1"] != last_per_layer[
        "bitune/alpha_values/layer_0"
    ]
    assert "entropy" in train_logs[-1] and "mean_token_accuracy" in train_logs[-1]
    history = mixing_history(trainer.state.log_history)  # what `plot_mixing_history` draws
    assert history.steps == [1, 3, 5] and history.mean_steps == [1, 2, 3, 4, 5, 6]
    assert history.values[-1, 1].item() == last_per_layer["bitune/alpha_values/layer_1"]


def test_the_trainer_adds_one_mixing_callback_first(tmp_path, model_dir):
    trainer = make_trainer(model_dir, tmp_path)
    callbacks = trainer.callback_handler.callbacks
    assert isinstance(callbacks[0], BituneMixingCallback)
    assert sum(isinstance(callback, BituneMixingCallback) for callback in callbacks) == 1
    own = BituneMixingCallback(per_layer_steps=None)
    trainer = BituneSFTTrainer(
        model=model_dir, args=helpers.training_args(tmp_path), callbacks=[own],
        train_dataset=datasets.Dataset.from_list(helpers.prompt_completion_rows(4)),
        processing_class=helpers.build_tokenizer(), peft_config=helpers.small_bitune_config(),
    )
    assert [c for c in trainer.callback_handler.callbacks if isinstance(c, BituneMixingCallback)] == [own]


def test_a_plain_transformers_trainer_logs_the_mixing_coefficients_with_the_callback(tmp_path, model_dir):
    tokenizer = helpers.build_tokenizer()
    rows = []
    for row in helpers.prompt_completion_rows(8):
        prompt = tokenizer(row["prompt"])["input_ids"]
        completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
        rows.append({"input_ids": prompt + completion, "labels": [IGNORE_INDEX] * len(prompt) + completion})
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), helpers.small_bitune_config())
    args = TrainingArguments(
        str(tmp_path), per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, remove_unused_columns=False,
    )
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True)
    trainer = Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), data_collator=collator,
                      callbacks=[BituneMixingCallback(per_layer_steps=2)])
    trainer.train()
    train_logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(train_logs) == 3
    assert [log["step"] for log in train_logs if "bitune/alpha_values/layer_1" in log] == [1, 3]
    coefficients = model.base_model.get_mixing_coefficients()
    assert train_logs[-1]["bitune/alpha_keys_mean"] == pytest.approx(coefficients["keys"].mean().item())
    assert train_logs[-1]["bitune/alpha_values/layer_1"] == pytest.approx(coefficients["values"][1].item())
    assert not any(key.startswith("bitune/") for key in trainer.state.log_history[-1])  # the end-of-training summary


def test_the_mixing_callback_refuses_a_model_without_a_bitune_adapter(model_dir):
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=2, target_modules="all-linear")
    )
    state = types.SimpleNamespace(global_step=1, log_history=[{"loss": 1.0, "step": 1}])
    with pytest.raises(ValueError, match="holds none"):
        BituneMixingCallback().on_log(None, state, None, logs={"loss": 1.0}, model=model.train())
    with pytest.raises(ValueError, match="per_layer_steps"):
        BituneMixingCallback(per_layer_steps=-1)


def test_save_model_writes_an_adapter_peft_loads_back(trained, model_dir, tmp_path):
    trainer = trained[0]
    trainer.save_model(str(tmp_path))
    saved_config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved_config["peft_type"] == "BITUNE"
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(tmp_path))
    assert isinstance(loaded.base_model, BituneModel)
    loaded_state = {name: p for name, p in loaded.named_parameters()}
    for name, value in trainable_state(trainer.model).items():
        assert torch.equal(loaded_state[name], value), name
    batch = first_batch(trainer)
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(**batch).logits
        actual = loaded.eval()(**batch).logits
    trainer.model.train()
    torch.testing.assert_close(actual, expected)


@pytest.fixture(scope="module")
def plain_run(model_dir, tmp_path_factory):
    """Two fp32 steps without gradient checkpointing, saving a checkpoint after each: the baseline of the
    resumption, checkpointing and bf16 tests."""
    output_dir = tmp_path_factory.mktemp("plain")
    trainer = make_trainer(model_dir, output_dir, max_steps=2, save_strategy="steps", save_steps=1)
    trainer.train()
    return trainer


def test_resume_from_checkpoint_gives_the_weights_of_an_uninterrupted_run(plain_run, tmp_path, model_dir):
    resumed = make_trainer(model_dir, tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    resumed.train(resume_from_checkpoint=str(Path(plain_run.args.output_dir) / "checkpoint-1"))
    assert resumed.state.global_step == 2
    expected, actual = trainable_state(plain_run.model), trainable_state(resumed.model)
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=1e-7, msg=name)


def test_gradient_checkpointing_trains_like_plain_training(plain_run, tmp_path, model_dir):
    checkpointed = make_trainer(model_dir, tmp_path, max_steps=2, checkpointing=True)
    checkpointed.train()
    layers = [m for m in checkpointed.model.modules() if hasattr(m, "gradient_checkpointing")]
    assert layers and all(layer.gradient_checkpointing for layer in layers)
    expected, actual = trainable_state(plain_run.model), trainable_state(checkpointed.model)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_training_with_checkpointing(plain_run, tmp_path, model_dir):
    trainer = make_trainer(model_dir, tmp_path, max_steps=2, bf16=True, checkpointing=True)
    before = trainable_state(trainer.model)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    fp32_losses = [log["loss"] for log in plain_run.state.log_history if "loss" in log]
    # The first loss is computed before any update: bf16 autocast must give nearly the fp32 value.
    assert losses[0] == pytest.approx(fp32_losses[0], rel=2e-2)
    after = trainable_state(trainer.model)
    assert all(torch.equal(before[name], after[name]) != receives_gradient(name) for name in before)
    assert trainer.model.base_model.mixer.key_weights.dtype == torch.float32


# ---------------------------------------------------------------------- distributed
@pytest.mark.slow
def test_ddp_on_two_processes_matches_one_process(tmp_path, model_dir):
    """`accelerate launch` with 2 CPU processes (gloo), 2 rows each, against one process with 4 rows per step.

    On CPU, accelerate starts several processes only through its torchrun launcher (`--multi_gpu`); with
    `use_cpu=True` the processes then train with DistributedType.MULTI_CPU over gloo.
    """
    steps = 3
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
        str(Path(helpers.__file__)), model_dir, str(tmp_path / "ddp"), "2", str(steps),
        json.dumps({"checkpointing": True}),  # TRL's default, with DDP's search for unused parameters
    ]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    distributed = json.loads((tmp_path / "ddp" / "log_history.json").read_text())
    single = helpers.run_training(
        model_dir, str(tmp_path / "single"), per_device_train_batch_size=4, max_steps=steps, checkpointing=True
    )
    distributed_logs = [log for log in distributed if "loss" in log]
    single_logs = [log for log in single if "loss" in log]
    assert len(distributed_logs) == len(single_logs) == steps
    for ours, theirs in zip(distributed_logs, single_logs):
        assert ours["epoch"] == theirs["epoch"]  # the same global batch of 4 rows per step
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-4)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-3)
        assert ours["num_tokens"] == theirs["num_tokens"]
    adapters = [
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(directory / "adapter"))
        for directory in (tmp_path / "ddp", tmp_path / "single")
    ]
    expected = adapter_state(adapters[1])
    assert expected
    for name, value in adapter_state(adapters[0]).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-6, msg=name)


# ---------------------------------------------------------------------- command line
def write_jsonl_dataset(directory: Path, rows: list[dict]) -> Path:
    directory.mkdir()
    with open(directory / "train.jsonl", "w") as file:
        for row in rows:
            file.write(json.dumps(row) + "\n")
    return directory


CLI_TRAINING_FLAGS = [
    "--max_steps", "2", "--per_device_train_batch_size", "4", "--learning_rate", "1e-2", "--bf16", "false",
    f"--{compat.CHECKPOINTING_ARGUMENT}", "false", "--use_cpu", "--report_to", "none", "--save_strategy", "no",
]


def test_cli_trains_and_saves_a_bitune_adapter(tmp_path, model_dir):
    data = write_jsonl_dataset(tmp_path / "data", helpers.prompt_completion_rows(8))
    output = tmp_path / "out"
    cli_train([
        "--model_name_or_path", model_dir, "--dataset_name", str(data), "--output_dir", str(output),
        *CLI_TRAINING_FLAGS, "--lora_r", "4", "--mix_init", "0.02", "--second_pass_attention", "causal",
    ])
    saved = json.loads((output / "adapter_config.json").read_text())
    assert saved["peft_type"] == "BITUNE"
    assert saved["mix_init"] == 0.02 and saved["second_pass_attention"] == "causal"
    assert saved["adapter_config"]["r"] == 4 and saved["adapter_config"]["lora_alpha"] == 16  # Bitune's default alpha
    assert saved["adapter_config"]["target_modules"] == "all-linear"
    assert (output / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_bitune_sft_launches_through_accelerate_like_trl_sft(tmp_path, model_dir):
    """`--num_processes 1` (an `accelerate launch` flag, refused before) goes to the launcher, the rest to the
    training script, which runs in a process of its own; `--use_peft` (as in `trl sft` commands) is accepted."""
    data = write_jsonl_dataset(tmp_path / "data", helpers.prompt_completion_rows(8))
    output = tmp_path / "out"
    command = [
        sys.executable, "-c", "from trl_integration.cli import main; main()",
        "--model_name_or_path", model_dir, "--dataset_name", str(data), "--output_dir", str(output),
        *CLI_TRAINING_FLAGS, "--num_processes", "1", "--use_peft", "--lora_r", "4",
    ]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"Bitune adapter saved to {output}" in result.stdout
    saved = json.loads((output / "adapter_config.json").read_text())
    assert saved["peft_type"] == "BITUNE" and saved["adapter_config"]["r"] == 4


def test_bitune_sft_refuses_arguments_neither_training_nor_launcher_knows(tmp_path):
    with pytest.raises(ValueError, match=r"Unknown arguments \['--learnin_rate'.*accelerate launch"):
        cli_main(["--output_dir", str(tmp_path), "--use_cpu", "--learnin_rate", "1"])


def test_cli_refuses_to_turn_peft_off(tmp_path):
    for flags in (["--use_peft", "false"], ["--no_use_peft"]):
        with pytest.raises(ValueError, match="always trains a Bitune adapter"):
            make_parser().parse_args_and_config(["--output_dir", str(tmp_path), "--use_cpu", *flags])


def test_cli_covers_every_bitune_setting():
    """Each `BituneConfig` field of its own (not PEFT's, not the weight-set method) is a `bitune-sft` flag."""
    own_fields = set(BituneConfig.__dataclass_fields__) - set(PeftConfig.__dataclass_fields__) - {"adapter_config"}
    assert set(BituneArguments.__dataclass_fields__) == own_fields


def test_cli_parser_offers_trl_and_bitune_flags():
    help_text = make_parser().format_help()
    for flag in ("--model_name_or_path", "--dataset_name", "--lora_r", "--assistant_only_loss", "--mix_init",
                 "--shared_weights", "--mixing_logging_steps"):
        assert flag in help_text
    assert "use_peft" not in help_text  # always on
    # The LoRA defaults are Bitune's, and the help says how they differ from `trl sft`'s.
    assert " ".join(help_text.split()).count("`trl sft` uses") == 4


def test_trl_model_card_names_the_model_and_base_and_its_loading_code_runs(trained, model_dir):
    trainer = trained[0]
    trainer.save_model()
    trainer.create_model_card()
    output_dir = Path(trainer.args.output_dir)
    card = (output_dir / "README.md").read_text()
    assert f"# Model Card for {output_dir.name}" in card
    assert f"fine-tuned version of `{model_dir}`" in card and "None" not in card
    assert "pipeline(" not in card and card.count("<!-- bitune:start -->") == 1
    assert "huggingface.co/papers/2405.14862" in card  # the method's paper, from `_paper`
    code = card.split("```python\n", 1)[1].split("```", 1)[0]
    assert "AutoPeftModelForCausalLM.from_pretrained" in code
    namespace = {}
    exec(code, namespace)  # the card's own loading lines, as a reader would run them
    loaded = namespace["model"]
    assert isinstance(loaded.base_model, BituneModel)
    torch.testing.assert_close(mixer_state(loaded), mixer_state(trainer.model))
