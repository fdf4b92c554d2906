"""`BituneSFTTrainer` end to end on a tiny Llama with a local word-level tokenizer, offline: training, the mixing
coefficients in the logs (also with a plain transformers `Trainer`), saving and loading back, resumption, gradient
checkpointing, bf16, TRL's model card, and DDP on two processes. FSDP is tested in test_sharding.py (accelerate runs it
only on accelerators)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import datasets
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments
from trl import SFTTrainer

import trl_helpers as helpers
from peft_bitune import BituneMixingCallback, BituneModel
from peft_bitune.constants import IGNORE_INDEX
from peft_bitune.visualize import mixing_history
from trl_helpers import (
    adapter_state,
    first_batch,
    make_trainer,
    mixer_state,
    receives_gradient,
    trainable_state,
    weight_set_state,
)
from trl_integration import BituneSFTTrainer

datasets.disable_progress_bars()


# ---------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def trained(trl_model_dir, tmp_path_factory):
    """Six steps of training, with the state before and after, and the mean loss on the training rows before/after."""
    rows = helpers.prompt_completion_rows(16)
    trainer = BituneSFTTrainer(
        model=trl_model_dir,
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


def test_the_trainer_adds_one_mixing_callback_first(tmp_path, trl_model_dir):
    trainer = make_trainer(trl_model_dir, tmp_path)
    callbacks = trainer.callback_handler.callbacks
    assert isinstance(callbacks[0], BituneMixingCallback)
    assert sum(isinstance(callback, BituneMixingCallback) for callback in callbacks) == 1
    own = BituneMixingCallback(per_layer_steps=None)
    trainer = BituneSFTTrainer(
        model=trl_model_dir, args=helpers.training_args(tmp_path), callbacks=[own],
        train_dataset=datasets.Dataset.from_list(helpers.prompt_completion_rows(4)),
        processing_class=helpers.build_tokenizer(), peft_config=helpers.small_bitune_config(),
    )
    assert [c for c in trainer.callback_handler.callbacks if isinstance(c, BituneMixingCallback)] == [own]


class LaterSFTTrainer(SFTTrainer):
    """`SFTTrainer` as a later TRL may have it: with a parameter this release does not have."""

    def __init__(self, *args, later_option=None, **kwargs):
        self.later_option = later_option
        super().__init__(*args, **kwargs)


_SFT_SIGNATURE = inspect.signature(SFTTrainer.__init__)
_LATER_OPTION = inspect.Parameter("later_option", inspect.Parameter.KEYWORD_ONLY, default=None)
LaterSFTTrainer.__init__.__signature__ = _SFT_SIGNATURE.replace(
    parameters=[*_SFT_SIGNATURE.parameters.values(), _LATER_OPTION]
)


def test_the_trainer_forwards_a_parameter_it_never_names(tmp_path, trl_model_dir):
    """`BituneSFTTrainer` takes `SFTTrainer`'s parameters as they are, so one that TRL adds reaches it."""

    class BituneLaterTrainer(BituneSFTTrainer, LaterSFTTrainer):
        pass

    trainer = BituneLaterTrainer(
        trl_model_dir, helpers.training_args(tmp_path), later_option="reached",
        train_dataset=datasets.Dataset.from_list(helpers.prompt_completion_rows(4)),
        processing_class=helpers.build_tokenizer(), peft_config=helpers.small_bitune_config(),
    )
    assert trainer.later_option == "reached"
    assert isinstance(trainer.model.base_model, BituneModel)  # the checks and the Bitune set-up still ran


def test_a_plain_transformers_trainer_logs_the_mixing_coefficients_with_the_callback(tmp_path, trl_model_dir):
    tokenizer = helpers.build_tokenizer()
    rows = []
    for row in helpers.prompt_completion_rows(8):
        prompt = tokenizer(row["prompt"])["input_ids"]
        completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
        rows.append({"input_ids": prompt + completion, "labels": [IGNORE_INDEX] * len(prompt) + completion})
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(trl_model_dir), helpers.small_bitune_config())
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


def test_the_mixing_callback_refuses_a_model_without_a_bitune_adapter(trl_model_dir):
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(trl_model_dir), LoraConfig(r=2, target_modules="all-linear")
    )
    state = types.SimpleNamespace(global_step=1, log_history=[{"loss": 1.0, "step": 1}])
    with pytest.raises(ValueError, match="holds none"):
        BituneMixingCallback().on_log(None, state, None, logs={"loss": 1.0}, model=model.train())
    with pytest.raises(ValueError, match="per_layer_steps"):
        BituneMixingCallback(per_layer_steps=-1)


def test_save_model_writes_an_adapter_peft_loads_back(trained, trl_model_dir, tmp_path):
    trainer = trained[0]
    trainer.save_model(str(tmp_path))
    saved_config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved_config["peft_type"] == "BITUNE"
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trl_model_dir), str(tmp_path))
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
def plain_run(trl_model_dir, tmp_path_factory):
    """Two fp32 steps without gradient checkpointing, saving a checkpoint after each: the baseline of the
    resumption, checkpointing and bf16 tests."""
    output_dir = tmp_path_factory.mktemp("plain")
    trainer = make_trainer(trl_model_dir, output_dir, max_steps=2, save_strategy="steps", save_steps=1)
    trainer.train()
    return trainer


def test_resume_from_checkpoint_gives_the_weights_of_an_uninterrupted_run(plain_run, tmp_path, trl_model_dir):
    resumed = make_trainer(trl_model_dir, tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    resumed.train(resume_from_checkpoint=str(Path(plain_run.args.output_dir) / "checkpoint-1"))
    assert resumed.state.global_step == 2
    expected, actual = trainable_state(plain_run.model), trainable_state(resumed.model)
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=1e-7, msg=name)


def test_gradient_checkpointing_trains_like_plain_training(plain_run, tmp_path, trl_model_dir):
    checkpointed = make_trainer(trl_model_dir, tmp_path, max_steps=2, checkpointing=True)
    checkpointed.train()
    layers = [m for m in checkpointed.model.modules() if hasattr(m, "gradient_checkpointing")]
    assert layers and all(layer.gradient_checkpointing for layer in layers)
    expected, actual = trainable_state(plain_run.model), trainable_state(checkpointed.model)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_checkpointing_with_dropout_and_gradient_accumulation_trains_like_plain_training(tmp_path, trl_model_dir):
    """LoRA dropout in both weight sets, two micro-batches a step: the checkpointed run draws the plain run's dropout
    masks, so it logs the same losses and ends with the same weights (it logged 3.068 against 3.026 before)."""
    from peft_bitune import BituneConfig

    runs = []
    for checkpointing in (False, True):
        config = BituneConfig(adapter_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                        lora_dropout=0.2))
        trainer = make_trainer(trl_model_dir, tmp_path / f"checkpointing_{checkpointing}", peft_config=config,
                               max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                               checkpointing=checkpointing)
        trainer.train()
        runs.append(([log["loss"] for log in trainer.state.log_history if "loss" in log],
                     trainable_state(trainer.model)))
    (plain_losses, expected), (losses, actual) = runs
    assert losses == pytest.approx(plain_losses, rel=1e-6)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_training_with_checkpointing(plain_run, tmp_path, trl_model_dir):
    trainer = make_trainer(trl_model_dir, tmp_path, max_steps=2, bf16=True, checkpointing=True)
    before = trainable_state(trainer.model)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    fp32_losses = [log["loss"] for log in plain_run.state.log_history if "loss" in log]
    # The first loss is computed before any update: bf16 autocast must give nearly the fp32 value. 2e-2 is about five
    # bf16 roundings (2^-8) of the loss; measured 0.9e-5 to 1.6e-5 under every kernel setting of tests/README.md.
    assert losses[0] == pytest.approx(fp32_losses[0], rel=2e-2)
    after = trainable_state(trainer.model)
    assert all(torch.equal(before[name], after[name]) != receives_gradient(name) for name in before)
    assert trainer.model.base_model.mixer.key_weights.dtype == torch.float32


def test_trl_model_card_names_the_model_and_base_and_its_loading_code_runs(trained, trl_model_dir):
    trainer = trained[0]
    trainer.save_model()
    trainer.create_model_card()
    output_dir = Path(trainer.args.output_dir)
    card = (output_dir / "README.md").read_text()
    assert f"# Model Card for {output_dir.name}" in card
    assert f"fine-tuned version of `{trl_model_dir}`" in card and "None" not in card
    assert "pipeline(" not in card and card.count("<!-- bitune:start -->") == 1
    assert "huggingface.co/papers/2405.14862" in card  # the method's paper, from `_paper`
    code = card.split("```python\n", 1)[1].split("```", 1)[0]
    assert "AutoPeftModelForCausalLM.from_pretrained" in code
    namespace = {}
    exec(code, namespace)  # the card's own loading lines, as a reader would run them
    loaded = namespace["model"]
    assert isinstance(loaded.base_model, BituneModel)
    torch.testing.assert_close(mixer_state(loaded), mixer_state(trainer.model))


def test_trl_model_card_does_not_depend_on_the_wording_of_trls_card(tmp_path, trl_model_dir, monkeypatch):
    """The card is the project's own template filled with TRL's card data: TRL's reward-model card, whose wording
    differs, gives the same card. The run's logs are linked as in TRL's card."""
    trainer = make_trainer(trl_model_dir, tmp_path)
    trainer.create_model_card()
    ours = (tmp_path / "README.md").read_text()
    trainer._template_file = "rm_model_card.md"
    trainer.create_model_card()
    assert (tmp_path / "README.md").read_text() == ours

    import trl.trainer.utils

    monkeypatch.setattr(trl.trainer.utils, "get_comet_experiment_url", lambda: "https://www.comet.com/run/1")
    trainer.create_model_card()
    assert "- Logs: [Comet](https://www.comet.com/run/1)" in (tmp_path / "README.md").read_text()


# ---------------------------------------------------------------------- distributed
@pytest.mark.slow
def test_ddp_on_two_processes_matches_one_process(tmp_path, trl_model_dir):
    """`accelerate launch` with 2 CPU processes (gloo), 2 rows each, against one process with 4 rows per step.

    On CPU, accelerate starts several processes only through its torchrun launcher (`--multi_gpu`); with
    `use_cpu=True` the processes then train with DistributedType.MULTI_CPU over gloo.
    """
    steps = 3
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
        str(Path(helpers.__file__)), trl_model_dir, str(tmp_path / "ddp"), "2", str(steps),
        json.dumps({"checkpointing": True}),  # TRL's default, with DDP's search for unused parameters
    ]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    distributed = json.loads((tmp_path / "ddp" / "log_history.json").read_text())
    single = helpers.run_training(
        trl_model_dir, str(tmp_path / "single"), per_device_train_batch_size=4, max_steps=steps, checkpointing=True
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
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trl_model_dir), str(directory / "adapter"))
        for directory in (tmp_path / "ddp", tmp_path / "single")
    ]
    expected = adapter_state(adapters[1])
    assert expected
    for name, value in adapter_state(adapters[0]).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-6, msg=name)
