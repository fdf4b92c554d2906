"""The recipe options beyond the paper: mixing only some layers (`BituneConfig.mixed_layers`), a learning rate per part
of the adapter (`peft_bitune.training.optimizers`, `BituneSFTConfig.*_lr_ratio`) and a mixing warm-up
(`BituneSFTConfig.mixing_warmup_steps`). Each is checked against the per-row reference, and each default keeps the
paper's behaviour."""

from __future__ import annotations

import json
import math

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import TrainerCallback

import trl_helpers as helpers
from peft_bitune import BituneConfig, bitune_parameter_groups, create_bitune_optimizer
from reference import alphas, make_bitune
from test_forward import (
    PROMPT_LENGTHS,
    answer_logits,
    assert_matches_reference,
    make_batch,
    reference_batch,
    trainable_grads,
)
from trl_integration import BituneSFTConfig

NOT_POSITIVE_OR_FINITE = [0.0, -1.0, math.nan, math.inf, True, "2"]


# ---------------------------------------------------------------------- mixed_layers
@pytest.mark.parametrize(("arch", "padding_side"), [("llama", "left"), ("gemma3", "right"), ("qwen2", "left")])
@pytest.mark.parametrize("mixed_layers", [[0], [1]])
def test_mixing_some_layers_matches_the_reference(load_base, arch, padding_side, mixed_layers):
    """Loss, logits and gradients as the reference (alpha 0 outside `mixed_layers`). The library does not even build
    the paths the reference multiplies by 0, so a parameter only they reach has no gradient there: compared as 0."""
    model = make_bitune(load_base(arch), mixed_layers=mixed_layers)
    model.train()
    rows, batch, _ = make_batch(padding_side)
    out = model(**batch)
    out.loss.backward()
    grads = trainable_grads(model)
    model.zero_grad()
    ref_logits, ref_loss = reference_batch(model, rows, PROMPT_LENGTHS)
    ref_loss.backward()
    ref_grads = trainable_grads(model)
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-5, rtol=0)
    for got, want in zip(answer_logits(out.logits, batch, rows, PROMPT_LENGTHS), ref_logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert set(grads) <= set(ref_grads)
    for name, want in ref_grads.items():
        torch.testing.assert_close(grads.get(name, torch.zeros_like(want)), want, atol=1e-5, rtol=0, msg=name)


def test_layers_left_out_keep_the_causal_cache_and_train_nothing_through_it(load_base):
    """With the lower layer mixed only, the upper layer's cache is the causal pass's: its mixing scalars and the
    bidirectional weights above the mixed layer get no gradient, and its alpha reads 0."""
    model = make_bitune(load_base("llama"), mixed_layers=[0])
    model.train()
    _, batch, _ = make_batch("left")
    model(**batch).loss.backward()
    mixer = model.base_model.mixer
    assert mixer.key_weights.grad[1] == 0 and mixer.value_weights.grad[1] == 0
    assert mixer.key_weights.grad[0] != 0 and mixer.value_weights.grad[0] != 0
    grads = trainable_grads(model)
    bidirectional = [n for n, p in model.named_parameters() if p.requires_grad and "default__bidirectional" in n]
    upper = [n for n in bidirectional if ".layers.1." in n]
    lower_cache = [n for n in bidirectional if ".layers.0." in n and ("k_proj" in n or "v_proj" in n)]
    assert upper and all(n not in grads or grads[n].abs().max() == 0 for n in upper)
    assert lower_cache and all(grads[n].abs().max() > 0 for n in lower_cache if "lora_B" in n)
    coefficients = model.base_model.get_mixing_coefficients()
    assert coefficients["keys"][1] == 0 and coefficients["keys"][0] > 0


def test_mixing_some_layers_changes_the_output(load_base):
    """The option is not a no-op: the same weights give another loss when only one layer is mixed."""
    _, batch, _ = make_batch("left")
    every_layer = make_bitune(load_base("llama"), seed=3)
    lower_only = make_bitune(load_base("llama"), seed=3, mixed_layers=[0])
    assert not torch.allclose(every_layer(**batch).loss, lower_only(**batch).loss)


@pytest.mark.parametrize(
    ("mixed_layers", "message"),
    [([], "is empty"), ([-1], "from 0 up"), ([0, 0], "more than once"), (["0"], "mixed_layers"),
     ([0.5], "mixed_layers"), (3, "mixed_layers")],
)
def test_nonsense_layer_sets_are_refused_when_the_config_is_made(mixed_layers, message):
    with pytest.raises(ValueError, match=message):
        BituneConfig(mixed_layers=mixed_layers)


def test_a_layer_the_model_does_not_have_is_refused_before_any_adapter_layer_is_made(load_base):
    base = load_base("llama")
    with pytest.raises(ValueError, match=r"names layers \[2\], but the model has 2 decoder layers"):
        get_peft_model(base, BituneConfig(mixed_layers=[0, 2]))
    assert not any("lora_" in name for name, _ in base.named_parameters())


def test_mixed_layers_are_saved_and_loaded_with_the_adapter(load_base, tmp_path):
    model = make_bitune(load_base("qwen3"), mixed_layers=[1])
    model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["mixed_layers"] == [1]
    assert "layers [1] only are mixed" in (tmp_path / "adapter" / "README.md").read_text()
    loaded = PeftModel.from_pretrained(load_base("qwen3"), tmp_path / "adapter")
    _, batch, _ = make_batch("right")
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model.eval()(**batch).logits, atol=1e-6, rtol=0)
    assert loaded.base_model.get_mixing_coefficients()["keys"][0] == 0


def test_a_default_adapter_does_not_write_the_option(load_base, tmp_path):
    """Left out at its default, so that versions before the option load adapters that do not use it; an adapter
    that uses it is refused by such a version, which does not know the field (see `config_files.py`)."""
    make_bitune(load_base("llama")).save_pretrained(tmp_path / "adapter")
    assert "mixed_layers" not in json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())


# ---------------------------------------------------------------------- the release (mixing warm-up)
def test_a_partly_released_mix_matches_the_reference(load_base):
    model = make_bitune(load_base("mistral"))
    model.train()
    model.base_model.mixer.set_release(0.3)
    key_alpha, _ = alphas(model)
    full = model.base_model.mixer.key_weights.abs() / (model.base_model.mixer.key_weights.abs() + 0.01)
    torch.testing.assert_close(key_alpha, 0.3 * full)
    assert_matches_reference(model, "left")


def test_a_mix_held_at_zero_reads_the_causal_cache_exactly(load_base):
    held = make_bitune(load_base("llama"), seed=5)
    held.base_model.mixer.set_release(0.0)
    zero_scalars = make_bitune(load_base("llama"), seed=5)
    with torch.no_grad():
        zero_scalars.base_model.mixer.key_weights.zero_()
        zero_scalars.base_model.mixer.value_weights.zero_()
    _, batch, _ = make_batch("left")
    with torch.no_grad():
        assert torch.equal(held(**batch).logits, zero_scalars(**batch).logits)
    with pytest.raises(ValueError, match="between 0 and 1"):
        held.base_model.mixer.set_release(1.5)


# ---------------------------------------------------------------------- learning rates per part
def test_parameter_groups_hold_every_trainable_parameter_once_at_its_rate(load_base):
    model = make_bitune(load_base("llama"))
    groups = bitune_parameter_groups(model, 1e-3, bidirectional_lr_ratio=4.0, mixing_lr_ratio=0.1, weight_decay=0.1)
    by_name = {group["name"]: group for group in groups}
    assert set(by_name) == {"bitune_causal", "bitune_bidirectional", "bitune_mixing_no_decay"}
    assert by_name["bitune_bidirectional"]["lr"] == pytest.approx(4e-3)
    assert by_name["bitune_mixing_no_decay"]["lr"] == pytest.approx(1e-4)
    assert by_name["bitune_mixing_no_decay"]["weight_decay"] == 0.0  # decay would pull every alpha towards 0
    assert by_name["bitune_causal"]["weight_decay"] == 0.1
    grouped = [id(p) for group in groups for p in group["params"]]
    trainable = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    assert sorted(grouped) == sorted(trainable) and len(grouped) == len(set(grouped))
    assert all("bidirectional" in trainable[id(p)] for p in by_name["bitune_bidirectional"]["params"])
    assert all("bitune_mixers" in trainable[id(p)] for p in by_name["bitune_mixing_no_decay"]["params"])


def test_one_optimizer_step_moves_each_part_at_its_own_rate(load_base):
    """Adam's first step moves every parameter with a non-zero gradient by its group's rate (m / sqrt(v) = ±1)."""
    model = make_bitune(load_base("llama"))
    model.train()
    optimizer = create_bitune_optimizer(model, torch.optim.Adam, lr=1e-3, bidirectional_lr_ratio=3.0,
                                        mixing_lr_ratio=0.2, eps=1e-12)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    _, batch, _ = make_batch("left")
    model(**batch).loss.backward()
    optimizer.step()
    moved = {n: (p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters() if p.requires_grad}
    parts = {"bitune_mixers": 2e-4, "default__bidirectional": 3e-3, "default__causal": 1e-3}
    for marker, rate in parts.items():
        steps = [step for name, step in moved.items() if marker in name and step > 0]
        assert steps and all(step == pytest.approx(rate, rel=1e-3) for step in steps), marker


@pytest.mark.parametrize("ratio", NOT_POSITIVE_OR_FINITE)
@pytest.mark.parametrize("name", ["bidirectional_lr_ratio", "mixing_lr_ratio"])
def test_nonsense_rate_multiples_are_refused(load_base, tmp_path, name, ratio):
    with pytest.raises(ValueError, match=f"`{name}` must be a finite positive number"):
        bitune_parameter_groups(make_bitune(load_base("llama")), 1e-3, **{name: ratio})
    with pytest.raises(ValueError, match=f"`{name}` must be a finite positive number"):
        BituneSFTConfig(output_dir=str(tmp_path), use_cpu=True, **{name: ratio})


def test_a_rate_for_a_part_the_model_does_not_train_is_refused(load_base):
    with pytest.raises(ValueError, match="trains none"):
        bitune_parameter_groups(make_bitune(load_base("llama"), shared_weights=True), 1e-3, bidirectional_lr_ratio=2.0)
    with pytest.raises(ValueError, match="does not train them"):
        bitune_parameter_groups(make_bitune(load_base("llama"), train_mixing=False), 1e-3, mixing_lr_ratio=0.5)
    lora = get_peft_model(load_base("llama"), LoraConfig(r=2, target_modules="all-linear"))
    with pytest.raises(ValueError, match="has none"):
        bitune_parameter_groups(lora, 1e-3)


def test_the_trainer_builds_its_optimizer_with_the_rates_and_the_schedule_keeps_them(trl_model_dir, tmp_path):
    trainer = helpers.make_trainer(trl_model_dir, tmp_path, learning_rate=1e-2, bidirectional_lr_ratio=2.0,
                                   mixing_lr_ratio=0.5, max_steps=3, lr_scheduler_type="linear")
    trainer.train()
    rates = {group["name"]: group["initial_lr"] for group in trainer.optimizer.param_groups}
    assert rates["bitune_bidirectional"] == pytest.approx(2e-2) and rates["bitune_causal"] == pytest.approx(1e-2)
    assert any(name.startswith("bitune_mixing") and rate == pytest.approx(5e-3) for name, rate in rates.items())
    current = {group["name"]: group["lr"] for group in trainer.optimizer.param_groups}
    assert current["bitune_bidirectional"] == pytest.approx(2 * current["bitune_causal"])


def test_ratios_changed_after_the_optimizer_was_made_are_refused_not_ignored(trl_model_dir, tmp_path):
    """A trainer makes its optimizer once; a ratio changed before a second `train()` would be ignored, so it is
    refused, and takes effect once the optimizer is dropped."""
    trainer = helpers.make_trainer(trl_model_dir, tmp_path, learning_rate=1e-2, mixing_lr_ratio=0.5, max_steps=1)
    trainer.train()
    trainer.args.mixing_lr_ratio = 0.25
    with pytest.raises(ValueError, match=r"now \(1.0, 0.25\), but this trainer's optimizer was made with \(1.0, 0.5"):
        trainer.train()
    trainer.optimizer = None
    trainer.train()
    rates = {group["name"]: group["initial_lr"] for group in trainer.optimizer.param_groups}
    assert any(name.startswith("bitune_mixing") and rate == pytest.approx(2.5e-3) for name, rate in rates.items())

    default = helpers.make_trainer(trl_model_dir, tmp_path / "default", max_steps=1)
    default.train()
    default.args.bidirectional_lr_ratio = 2.0
    with pytest.raises(ValueError, match=r"made with \(1.0, 1.0\)"):
        default.train()


def test_default_rates_keep_the_trainers_own_optimizer(trl_model_dir, tmp_path):
    trainer = helpers.make_trainer(trl_model_dir, tmp_path, max_steps=1)
    trainer.create_optimizer()
    assert all("name" not in group for group in trainer.optimizer.param_groups)


def test_rates_with_an_optimizer_class_of_ones_own_are_refused_not_ignored(trl_model_dir, tmp_path):
    """`optimizer_cls_and_kwargs` bypasses the hook that gives the Trainer Bitune's parameter groups."""
    from datasets import Dataset

    from trl_integration import BituneSFTTrainer

    trainer = BituneSFTTrainer(model=trl_model_dir, args=helpers.training_args(tmp_path, mixing_lr_ratio=0.5),
                               train_dataset=Dataset.from_list(helpers.prompt_completion_rows(4)),
                               processing_class=helpers.build_tokenizer(), peft_config=helpers.small_bitune_config(),
                               optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1}))
    with pytest.raises(ValueError, match="`optimizer_cls_and_kwargs` makes the Trainer build"):
        trainer.create_optimizer()
    trainer.args.mixing_lr_ratio = 1.0
    assert isinstance(trainer.create_optimizer(), torch.optim.SGD)


def test_an_optim_that_groups_parameters_itself_is_refused_with_ratios(trl_model_dir, tmp_path, monkeypatch):
    """An optimizer factory (transformers' protocol for Muon or Dion) groups the model's parameters itself."""
    from transformers.trainer_optimizer import _OPTIMIZER_HANDLERS

    class SGDFactory:
        def __call__(self, model, **kwargs):
            return torch.optim.SGD(model.parameters(), **kwargs)

    monkeypatch.setitem(_OPTIMIZER_HANDLERS, "sgd", lambda context: (SGDFactory, context.optimizer_kwargs))
    trainer = helpers.make_trainer(trl_model_dir, tmp_path, mixing_lr_ratio=0.5, optim="sgd")
    with pytest.raises(ValueError, match="`optim=sgd` builds its own parameter groups"):
        trainer.create_optimizer()


def test_rates_with_an_optimizer_of_ones_own_are_refused(trl_model_dir, tmp_path):
    from datasets import Dataset

    from trl_integration import BituneSFTTrainer

    model = get_peft_model(
        __import__("transformers").AutoModelForCausalLM.from_pretrained(trl_model_dir), helpers.small_bitune_config())
    own = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="create_bitune_optimizer"):
        BituneSFTTrainer(model=model, args=helpers.training_args(tmp_path, mixing_lr_ratio=0.1),
                         train_dataset=Dataset.from_list(helpers.prompt_completion_rows(4)),
                         processing_class=helpers.build_tokenizer(), optimizers=(own, None))


# ---------------------------------------------------------------------- mixing warm-up
class ReleaseRecorder(TrainerCallback):
    """The release in force at each optimizer step (read after the warm-up callback has set it)."""

    def __init__(self) -> None:
        self.releases: list[float] = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.releases.append(model.base_model.mixer.release)


def test_the_warm_up_releases_the_mix_linearly_and_ends_released(trl_model_dir, tmp_path):
    trainer = helpers.make_trainer(trl_model_dir, tmp_path, max_steps=5, mixing_warmup_steps=4)
    recorder = ReleaseRecorder()
    trainer.add_callback(recorder)
    trainer.train()
    assert recorder.releases == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert trainer.model.base_model.mixer.release == 1.0
    trainer.create_model_card()  # the card says how the adapter was trained
    assert "`mixing_warmup_steps=4`" in (tmp_path / "README.md").read_text()
    logged = [entry["bitune/alpha_keys_mean"] for entry in trainer.state.log_history if "loss" in entry]
    assert logged[0] == 0.0 and logged[-1] > 0  # the logs show the alphas in force


def test_no_warm_up_by_default(trl_model_dir, tmp_path):
    trainer = helpers.make_trainer(trl_model_dir, tmp_path, max_steps=2)
    recorder = ReleaseRecorder()
    trainer.add_callback(recorder)
    trainer.train()
    assert recorder.releases == [1.0, 1.0]


@pytest.mark.parametrize(("steps", "message"), [(-1, "non-negative integer"), (1.5, "non-negative integer"),
                                                (True, "non-negative integer"), (5, "longer than training")])
def test_nonsense_warm_ups_are_refused_when_the_config_is_made(tmp_path, steps, message):
    with pytest.raises(ValueError, match=message):
        BituneSFTConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=4, mixing_warmup_steps=steps)


def test_a_warm_up_longer_than_an_epoch_run_is_refused_before_the_first_step(trl_model_dir, tmp_path):
    trainer = helpers.make_trainer(trl_model_dir, tmp_path, max_steps=-1, num_train_epochs=1,
                                   mixing_warmup_steps=50)  # 16 rows, batch 4: 4 steps
    before = helpers.trainable_state(trainer.model)
    with pytest.raises(ValueError, match=r"mixing warm-up \(50 steps\) is longer than training \(4 steps\)"):
        trainer.train()
    after = helpers.trainable_state(trainer.model)
    assert all(torch.equal(before[name], after[name]) for name in before)


# ---------------------------------------------------------------------- bitune-sft
def test_bitune_sft_takes_every_recipe_option(trl_model_dir, tmp_path):
    from test_trl_cli import CLI_TRAINING_FLAGS, write_jsonl_dataset
    from trl_integration.cli import train as cli_train

    data = write_jsonl_dataset(tmp_path / "data", helpers.prompt_completion_rows(8))
    output = tmp_path / "out"
    cli_train(["--model_name_or_path", trl_model_dir, "--dataset_name", str(data), "--output_dir", str(output),
               *CLI_TRAINING_FLAGS, "--lora_r", "4", "--mixed_layers", "1", "--bidirectional_lr_ratio", "2",
               "--mixing_lr_ratio", "0.1", "--mixing_warmup_steps", "1"])
    saved = json.loads((output / "adapter_config.json").read_text())
    assert saved["mixed_layers"] == [1]
