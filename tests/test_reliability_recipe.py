"""The recipe options where they are used rather than where they are set (issue 49, items 3 to 6): a `BituneConfig`
field assigned after the config is made is checked when an adapter is built from it; a trainer option assigned after
the trainer is made is used (and checked); a resumed run keeps the recipe its checkpoint was trained with; and the
learning rate of each weight set follows the weight set a parameter belongs to, whatever the inner PEFT method."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from peft import IA3Config, LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import SFTConfig

import trl_helpers as helpers
from peft_bitune import BituneConfig, BituneMixingWarmupCallback, create_bitune_optimizer
from reference import make_bitune
from test_forward import make_batch
from trl_integration.checks import RECIPE_DEFAULTS, saved_recipe


def tiny_lora() -> LoraConfig:
    return LoraConfig(r=2, lora_alpha=4, target_modules="all-linear")


# ---------------------------------------------------------------------- item 3: fields assigned after the config
ASSIGNED_LATER = [
    ("mixed_layers", [-1], "from 0 up"),
    ("mixed_layers", [], "is empty"),
    ("mixed_layers", [0, 0], "more than once"),
    ("mixed_layers", ["0"], "`mixed_layers` must be"),
    ("mix_scale", 0.0, "`mix_scale` must be positive"),
    ("mix_init", -1.0, "`mix_init` must be non-negative"),
    ("train_mixing", "no", "`train_mixing` must be true or false"),
    ("shared_weights", 1, "`shared_weights` must be true or false"),
    ("second_pass_attention", "sideways", "`second_pass_attention` must be one of"),
    ("multi_turn", "all", "`multi_turn` must be one of"),
    ("task_type", "SEQ_CLS", "`task_type` must be 'CAUSAL_LM'"),
    ("adapter_config", LoraConfig(modules_to_save=["lm_head"]), "`adapter_config` cannot use `modules_to_save`"),
    # Read by the quantized-base check before anything else: the config is checked first.
    ("adapter_config", "lora", "`adapter_config` must be a PEFT config"),
    ("adapter_config", {"r": 4}, "`adapter_config` must name a known PEFT method"),
]


@pytest.mark.parametrize(("name", "value", "message"), ASSIGNED_LATER, ids=lambda v: str(v)[:24])
def test_a_field_assigned_after_the_config_is_made_is_checked_when_the_adapter_is_built(load_base, name, value,
                                                                                       message):
    config = BituneConfig(adapter_config=tiny_lora(), mixed_layers=[0])
    setattr(config, name, value)
    base = load_base("llama")
    with pytest.raises((TypeError, ValueError), match=message):  # a value of the wrong type is a TypeError
        get_peft_model(base, config)
    assert not any("lora_" in parameter_name for parameter_name, _ in base.named_parameters())


def test_a_layer_set_edited_in_place_is_checked_when_the_adapter_is_built(load_base):
    config = BituneConfig(adapter_config=tiny_lora(), mixed_layers=[0])
    config.mixed_layers.append(0)
    with pytest.raises(ValueError, match="more than once"):
        get_peft_model(load_base("llama"), config)


@pytest.mark.parametrize("name", ["modules_to_save", "trainable_token_indices"])
def test_bitunes_own_auxiliary_module_options_are_refused_with_the_reason_adapter_config_gets(load_base, name):
    """Issue 62 item 16: `BituneConfig(modules_to_save=...)` raised a bare `TypeError` (unexpected keyword)."""
    value = ["lm_head"] if name == "modules_to_save" else [0, 1]
    reason = r"not split into causal and bidirectional weight sets, and PEFT would leave them out of the checkpoint"
    with pytest.raises(ValueError, match=rf"^`BituneConfig` cannot use `{name}`: such modules are {reason}"):
        BituneConfig(adapter_config=tiny_lora(), **{name: value})
    config = BituneConfig(adapter_config=tiny_lora())
    setattr(config, name, value)  # PEFT reads it from the config with `getattr`
    base = load_base("llama")
    with pytest.raises(ValueError, match=rf"^`BituneConfig` cannot use `{name}`: such modules are {reason}"):
        get_peft_model(base, config)
    assert not any("lora_" in parameter_name for parameter_name, _ in base.named_parameters())


def test_a_valid_assignment_is_used_as_assigned(load_base):
    config = BituneConfig(adapter_config=tiny_lora())
    config.mixed_layers = (1,)
    model = get_peft_model(load_base("llama"), config)
    assert config.mixed_layers == [1]  # normalised as in the constructor
    coefficients = model.base_model.get_mixing_coefficients()["keys"]
    assert coefficients[0] == 0 and coefficients[1] > 0


def test_a_loaded_config_edited_before_loading_the_adapter_is_checked(load_base, tmp_path):
    get_peft_model(load_base("llama"), BituneConfig(adapter_config=tiny_lora())).save_pretrained(tmp_path)
    config = BituneConfig.from_pretrained(tmp_path)
    config.mixed_layers = [-1]
    with pytest.raises(ValueError, match="from 0 up"):
        PeftModel.from_pretrained(load_base("llama"), tmp_path, config=config)


# ---------------------------------------------------------------------- item 5: rates by weight set, every method
INNER_METHODS = {
    "lora": lambda: LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", init_lora_weights=False),
    "dora": lambda: LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", use_dora=True,
                               init_lora_weights=False),
    "ia3": lambda: IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
}


def weight_set_in_name(name: str) -> str:
    """The part a parameter belongs to, from its name as PEFT lays it out (the inner adapter name is a path segment,
    the last one for a bare parameter such as an IA3 vector): the test's own reading, independent of the library's."""
    if "bitune_mixers." in name:
        return "mixing"
    found = re.search(r"\.default__(causal|bidirectional)(\.|$)", name)
    assert found, name
    return found.group(1)


@pytest.mark.parametrize("method", sorted(INNER_METHODS))
def test_each_weight_set_trains_at_its_own_rate_with_every_inner_method(load_base, method):
    """Adam's first step moves every parameter with a non-zero gradient by its group's rate (m / sqrt(v) = ±1)."""
    model = make_bitune(load_base("llama"), adapter_config=INNER_METHODS[method]())
    model.train()
    optimizer = create_bitune_optimizer(model, torch.optim.Adam, lr=1e-3, bidirectional_lr_ratio=3.0,
                                        mixing_lr_ratio=0.2, eps=1e-12)
    grouped = {id(p): group["name"] for group in optimizer.param_groups for p in group["params"]}
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert {weight_set_in_name(n) for n in trainable} == {"causal", "bidirectional", "mixing"}
    for name, parameter in trainable.items():
        assert grouped[id(parameter)].startswith(f"bitune_{weight_set_in_name(name)}"), name
    before = {n: p.detach().clone() for n, p in trainable.items()}
    _, batch, _ = make_batch("left")
    model(**batch).loss.backward()
    optimizer.step()
    rates = {"mixing": 2e-4, "bidirectional": 3e-3, "causal": 1e-3}
    for part, rate in rates.items():
        steps = [(p.detach() - before[n]).abs().max().item() for n, p in trainable.items()
                 if weight_set_in_name(n) == part]
        moved = [step for step in steps if step > 0]
        assert moved and all(step == pytest.approx(rate, rel=1e-3) for step in moved), part


# ---------------------------------------------------------------------- item 4: trainer options assigned later
class ReleaseRecorder(TrainerCallback):
    """The release in force at each optimizer step (read after the warm-up callback has set it)."""

    def __init__(self) -> None:
        self.releases: list[float] = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.releases.append(model.base_model.mixer.release)


def test_a_warm_up_set_after_the_trainer_is_made_is_used(trl_model_dir, tmp_path):
    trainer = helpers.make_trainer(trl_model_dir, tmp_path, max_steps=4)
    trainer.args.mixing_warmup_steps = 2
    recorder = ReleaseRecorder()
    trainer.add_callback(recorder)
    trainer.train()
    assert recorder.releases == [0.0, 0.5, 1.0, 1.0]


def test_a_warm_up_turned_off_after_the_trainer_is_made_is_off(trl_model_dir, tmp_path):
    trainer = helpers.make_trainer(trl_model_dir, tmp_path, max_steps=2, mixing_warmup_steps=2)
    trainer.args.mixing_warmup_steps = 0
    recorder = ReleaseRecorder()
    trainer.add_callback(recorder)
    trainer.train()
    assert recorder.releases == [1.0, 1.0]


def test_a_warm_up_callback_of_ones_own_is_the_one_in_force(trl_model_dir, tmp_path):
    from datasets import Dataset

    from trl_integration import BituneSFTTrainer

    recorder = ReleaseRecorder()
    trainer = BituneSFTTrainer(model=trl_model_dir, args=helpers.training_args(tmp_path, max_steps=3),
                               train_dataset=Dataset.from_list(helpers.prompt_completion_rows(16)),
                               processing_class=helpers.build_tokenizer(), peft_config=helpers.small_bitune_config(),
                               callbacks=[BituneMixingWarmupCallback(2), recorder])
    trainer.train()
    assert recorder.releases == [0.0, 0.5, 1.0]


@pytest.mark.parametrize(("steps", "message"), [(10, r"mixing warm-up \(10 steps\) is longer than training \(4 "),
                                                (-1, "non-negative integer"), ("2", "non-negative integer")])
def test_a_warm_up_set_after_the_trainer_is_made_is_checked_before_the_first_step(trl_model_dir, tmp_path, steps,
                                                                                 message):
    trainer = helpers.make_trainer(trl_model_dir, tmp_path, max_steps=4)
    trainer.args.mixing_warmup_steps = steps
    before = helpers.trainable_state(trainer.model)
    with pytest.raises(ValueError, match=f"`mixing_warmup_steps`.*{message}"):
        trainer.train()
    after = helpers.trainable_state(trainer.model)
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_a_warm_up_callback_without_a_length_needs_arguments_that_name_one(load_base, tmp_path):
    from transformers import TrainerState, TrainingArguments

    callback = BituneMixingWarmupCallback()
    model = make_bitune(load_base("llama"))
    with pytest.raises(ValueError, match="pass `warmup_steps`"):
        callback.on_train_begin(TrainingArguments(str(tmp_path), use_cpu=True), TrainerState(max_steps=4), None,
                                model=model)
    BituneMixingWarmupCallback(2).on_train_begin(TrainingArguments(str(tmp_path), use_cpu=True),
                                                 TrainerState(max_steps=4), None, model=model)
    assert model.base_model.mixer.release == 0.0


def test_rates_set_after_the_trainer_is_made_with_an_optimizer_of_ones_own_are_refused(trl_model_dir, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from trl_integration import BituneSFTTrainer

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(trl_model_dir), helpers.small_bitune_config())
    own = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    trainer = BituneSFTTrainer(model=model, args=helpers.training_args(tmp_path, max_steps=1),
                               train_dataset=Dataset.from_list(helpers.prompt_completion_rows(4)),
                               processing_class=helpers.build_tokenizer(), optimizers=(own, None))
    trainer.args.mixing_lr_ratio = 0.1
    with pytest.raises(ValueError, match="create_bitune_optimizer"):
        trainer.train()


# ---------------------------------------------------------------------- items 4 and 6: resuming keeps the recipe
def checkpointed(model_dir, output_dir, **recipe) -> str:
    """Train two steps with `recipe`, saving a checkpoint after the first; return the checkpoint's folder."""
    trainer = helpers.make_trainer(model_dir, output_dir, max_steps=2, save_strategy="steps", save_steps=1, **recipe)
    trainer.train()
    return str(output_dir / "checkpoint-1")


@pytest.fixture(scope="module")
def lr_ratio_checkpoint(trl_model_dir, tmp_path_factory) -> str:
    return checkpointed(trl_model_dir, tmp_path_factory.mktemp("ratio"), mixing_lr_ratio=0.1, mixing_warmup_steps=2)


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        ({"mixing_lr_ratio": 0.5, "mixing_warmup_steps": 2},
         r"`mixing_lr_ratio=0.5`.*trained with `mixing_lr_ratio=0.1`"),
        ({"mixing_warmup_steps": 2}, r"`mixing_lr_ratio=1.0`.*trained with `mixing_lr_ratio=0.1`"),
        ({"mixing_lr_ratio": 0.1, "bidirectional_lr_ratio": 2.0, "mixing_warmup_steps": 2},
         r"`bidirectional_lr_ratio=2.0`.*trained with `bidirectional_lr_ratio=1.0`"),
        ({"mixing_lr_ratio": 0.1, "mixing_warmup_steps": 1},
         r"`mixing_warmup_steps=1`.*trained with `mixing_warmup_steps=2`"),
    ],
    ids=["other-ratio", "ratios-off", "ratio-on", "other-warm-up"],
)
def test_resuming_with_another_recipe_is_refused_naming_what_the_checkpoint_was_trained_with(
    lr_ratio_checkpoint, trl_model_dir, tmp_path, recipe, message
):
    trainer = helpers.make_trainer(trl_model_dir, tmp_path, max_steps=2, **recipe)
    before = helpers.trainable_state(trainer.model)
    with pytest.raises(ValueError, match=message):
        trainer.train(resume_from_checkpoint=lr_ratio_checkpoint)
    assert trainer.state.global_step == 0
    after = helpers.trainable_state(trainer.model)
    assert all(torch.equal(before[name], after[name]) for name in before)


@pytest.fixture(scope="module")
def plain_checkpoint(trl_model_dir, tmp_path_factory) -> str:
    return checkpointed(trl_model_dir, tmp_path_factory.mktemp("plain"))


def test_resuming_a_run_without_the_ratios_with_them_switched_on_is_refused(plain_checkpoint, trl_model_dir, tmp_path):
    trainer = helpers.make_trainer(trl_model_dir, tmp_path, max_steps=2, bidirectional_lr_ratio=2.0)
    with pytest.raises(ValueError, match=r"`bidirectional_lr_ratio=2.0`.*trained with `bidirectional_lr_ratio=1.0`"):
        trainer.train(resume_from_checkpoint=plain_checkpoint)


def without_recorded_recipe(checkpoint: str, tmp_path) -> str:
    """A copy of `checkpoint` as a trainer without the recipe options wrote it: its saved arguments an `SFTConfig`."""
    copy = tmp_path / "checkpoint-1"
    shutil.copytree(checkpoint, copy)
    torch.save(SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[]),
               copy / "training_args.bin")
    return str(copy)


@pytest.mark.parametrize(
    ("checkpoint", "recipe", "message"),
    [("lr_ratio_checkpoint", {}, r"`mixing_lr_ratio=1.0`.*trained with `mixing_lr_ratio=0.1`"),
     ("plain_checkpoint", {"mixing_lr_ratio": 0.5}, r"`mixing_lr_ratio=0.5`.*trained with `mixing_lr_ratio=1.0`")],
)
def test_a_checkpoint_that_records_no_recipe_is_checked_by_its_optimizer_groups(request, trl_model_dir, tmp_path,
                                                                                checkpoint, recipe, message):
    old = without_recorded_recipe(request.getfixturevalue(checkpoint), tmp_path)
    trainer = helpers.make_trainer(trl_model_dir, tmp_path / "resumed", max_steps=2, **recipe)
    with pytest.raises(ValueError, match=message):
        trainer.train(resume_from_checkpoint=old)


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "from-the-optimizer"])
def test_resuming_with_the_same_recipe_continues_the_run(lr_ratio_checkpoint, trl_model_dir, tmp_path, recorded):
    checkpoint = lr_ratio_checkpoint if recorded else without_recorded_recipe(lr_ratio_checkpoint, tmp_path)
    trainer = helpers.make_trainer(trl_model_dir, tmp_path / "resumed", max_steps=2, mixing_lr_ratio=0.1,
                                   mixing_warmup_steps=2)
    trainer.train(resume_from_checkpoint=checkpoint)
    assert trainer.state.global_step == 2
    rates = {group["name"]: group["initial_lr"] for group in trainer.optimizer.param_groups}
    assert any(name.startswith("bitune_mixing") and rate == pytest.approx(1e-3) for name, rate in rates.items())


def test_a_checkpoint_records_its_recipe_in_the_arguments_the_trainer_saves(lr_ratio_checkpoint):
    saved = torch.load(Path(lr_ratio_checkpoint) / "training_args.bin", weights_only=False)  # the test's own file
    recorded = {name: getattr(saved, name) for name in RECIPE_DEFAULTS}
    assert recorded == {"bidirectional_lr_ratio": 1.0, "mixing_lr_ratio": 0.1, "mixing_warmup_steps": 2}
    assert saved_recipe(lr_ratio_checkpoint) == recorded  # read without running the file's pickled classes


@pytest.mark.parametrize("content", [b"", b"not a zip", b"PK\x03\x04 broken"], ids=["empty", "not-zip", "broken"])
def test_saved_arguments_that_cannot_be_read_fall_back_to_the_optimizer_groups(lr_ratio_checkpoint, trl_model_dir,
                                                                              tmp_path, content):
    damaged = without_recorded_recipe(lr_ratio_checkpoint, tmp_path)
    (Path(damaged) / "training_args.bin").write_bytes(content)
    trainer = helpers.make_trainer(trl_model_dir, tmp_path / "resumed", max_steps=2, mixing_warmup_steps=2)
    with pytest.raises(ValueError, match=r"`mixing_lr_ratio=1.0`.*trained with `mixing_lr_ratio=0.1`"):
        trainer.train(resume_from_checkpoint=damaged)


@pytest.mark.parametrize("hook", ["_load_from_checkpoint", "_load_optimizer_and_scheduler"])
def test_the_trainer_still_has_the_hooks_that_keep_the_recipe(hook):
    from transformers import Trainer

    assert hasattr(Trainer, hook), (
        f"transformers' Trainer no longer has `{hook}`, which BituneSFTTrainer overrides to check a checkpoint's "
        "recipe on resume: find what replaced it and update the override."
    )


class StopAtStep(TrainerCallback):
    """Ends training at a step with an exception, as a failing callback or Ctrl-C (KeyboardInterrupt) would."""

    def __init__(self, step: int, error: BaseException) -> None:
        self.step, self.error = step, error

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise self.error


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("a callback failed")], ids=["ctrl_c", "error"])
def test_training_stopped_during_the_warm_up_leaves_the_model_mixing_as_its_saved_copy(trl_model_dir, tmp_path,
                                                                                       error):
    trainer = helpers.make_trainer(trl_model_dir, tmp_path, mixing_warmup_steps=5, max_steps=6)
    trainer.add_callback(StopAtStep(2, error))
    with pytest.raises(type(error)):
        trainer.train()
    model = trainer.model
    assert model.base_model.mixer.release == 1.0
    model.save_pretrained(tmp_path / "saved")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trl_model_dir), tmp_path / "saved")
    for name, alpha in model.base_model.get_mixing_coefficients().items():
        assert torch.equal(alpha, loaded.base_model.get_mixing_coefficients()[name])
