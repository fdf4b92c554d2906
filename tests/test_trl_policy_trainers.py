"""TRL's DPO, KTO, GRPO and RLOO trainers on a Bitune adapter (`trl_integration.policy_trainers`), on the tiny Llama
of the TRL tests: the reference is the policy as training starts, exactly (DPO's step-0 loss is ln 2 and its rewards
0, for a trained and for a fresh adapter; the KL of GRPO and RLOO is 0 at step 0), it stays frozen while the policy
moves, and what a Bitune adapter cannot run is refused before any work."""

from __future__ import annotations

import math
import warnings

import datasets
import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM
from trl import DPOConfig, DPOTrainer, GRPOConfig, KTOConfig, RLOOConfig
from trl.trainer.utils import use_adapter

import trl_helpers as helpers
from peft_bitune import BituneConfig
from reference import OTHER_INNER_METHODS, make_bitune, padded_batch
from tiny_models import VOCAB
from trl_integration import BituneDPOTrainer, BituneGRPOTrainer, BituneKTOTrainer, BituneRLOOTrainer
from trl_integration.policy_trainers import REFERENCE_ADAPTER, copy_policy_to_reference

datasets.disable_progress_bars()

COMMON = dict(
    per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2, report_to=[], logging_steps=1,
    save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False, seed=0, dataloader_num_workers=0,
)


def random_bitune_config() -> BituneConfig:
    """Both weight sets non-zero from the start, so that a reference that is not an exact copy shows."""
    return BituneConfig(adapter_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                  init_lora_weights=False))


def preference_rows(count: int = 16) -> Dataset:
    pairs = helpers.arithmetic_rows(count)
    return Dataset.from_list([
        {"prompt": f"{question} answer :", "chosen": f" {answer}", "rejected": f" {int(answer.split()[0]) + 1}"}
        for question, answer in pairs
    ])


def trained_adapter(model_dir: str):
    """A Bitune `PeftModel` as after SFT: random, trainable weights and mixing scalars."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), random_bitune_config())
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model


def logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def adapter_weights(model, adapter_name: str) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in get_peft_model_state_dict(model, adapter_name=adapter_name).items()}


def dpo_args(tmp_path, **overrides) -> DPOConfig:
    return DPOConfig(output_dir=str(tmp_path), **{**COMMON, **overrides})


# ---------------------------------------------------------------------- DPO: the reference is the starting policy
@pytest.mark.parametrize("start", ["trained", "fresh"])
def test_dpo_starts_at_ln2_with_zero_rewards(tmp_path, trl_model_dir, start):
    model = trained_adapter(trl_model_dir) if start == "trained" else trl_model_dir
    peft_config = None if start == "trained" else random_bitune_config()
    trainer = BituneDPOTrainer(model=model, args=dpo_args(tmp_path), train_dataset=preference_rows(),
                               processing_class=helpers.build_tokenizer(), peft_config=peft_config)
    trainer.train()
    assert logged(trainer, "loss")[0] == pytest.approx(math.log(2), abs=1e-5)
    assert logged(trainer, "rewards/chosen")[0] == 0.0 and logged(trainer, "rewards/rejected")[0] == 0.0
    assert all(math.isfinite(loss) for loss in logged(trainer, "loss"))


@pytest.mark.parametrize("start", ["trained", "fresh"])
def test_trl_dpo_trainer_alone_would_use_another_reference(tmp_path, trl_model_dir, start):
    """Why the subclass exists: TRL's own trainer copies only the mixing scalars of a trained adapter, and uses the
    base model (adapters disabled) for a fresh one; either way its step-0 loss is not ln 2."""
    if start == "trained":
        model = trained_adapter(trl_model_dir)
    else:
        model = AutoModelForCausalLM.from_pretrained(trl_model_dir)
    peft_config = None if start == "trained" else random_bitune_config()
    trainer = DPOTrainer(model=model, args=dpo_args(tmp_path, max_steps=1), train_dataset=preference_rows(),
                         processing_class=helpers.build_tokenizer(), peft_config=peft_config)
    trainer.train()
    assert abs(logged(trainer, "loss")[0] - math.log(2)) > 1e-4


def test_dpo_reference_stays_the_starting_adapter(tmp_path, trl_model_dir):
    model = trained_adapter(trl_model_dir)
    start = adapter_weights(model, "default")
    trainer = BituneDPOTrainer(model=model, args=dpo_args(tmp_path), train_dataset=preference_rows(),
                               processing_class=helpers.build_tokenizer())
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    before, _ = trainer.compute_ref_log_probs(trainer.model, batch)
    trainer.train()
    after, _ = trainer.compute_ref_log_probs(trainer.model, batch)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    reference = adapter_weights(model, REFERENCE_ADAPTER)
    assert reference.keys() == start.keys()
    assert all(torch.equal(reference[key], start[key]) for key in start)
    trained = adapter_weights(model, "default")
    assert any(not torch.equal(trained[key], start[key]) for key in start)  # the policy moved
    assert not any(p.requires_grad for n, p in model.named_parameters() if f"{REFERENCE_ADAPTER}__" in n
                   or f"bitune_mixers.{REFERENCE_ADAPTER}." in n)


def test_dpo_precomputed_reference_starts_at_ln2(tmp_path, trl_model_dir):
    trainer = BituneDPOTrainer(model=trained_adapter(trl_model_dir),
                               args=dpo_args(tmp_path, precompute_ref_log_probs=True, max_steps=1),
                               train_dataset=preference_rows(), processing_class=helpers.build_tokenizer())
    trainer.train()
    assert logged(trainer, "loss")[0] == pytest.approx(math.log(2), abs=1e-5)


@pytest.mark.parametrize("adapter_config", OTHER_INNER_METHODS)
def test_the_reference_copy_is_exact_for_every_inner_method(load_base, adapter_config):
    model = make_bitune(load_base("llama"), adapter_config=adapter_config).eval()
    _, batch, _ = padded_batch("left", VOCAB)
    copy_policy_to_reference(model)
    policy = model(**batch, fused_lm_head=True).log_probs
    with use_adapter(model, REFERENCE_ADAPTER):
        reference = model(**batch, fused_lm_head=True).log_probs
    assert torch.equal(policy, reference)
    assert not any(p.requires_grad for n, p in model.named_parameters() if f"{REFERENCE_ADAPTER}__" in n)


def test_the_reference_copy_keeps_each_tensors_dtype_and_replaces_a_reference_of_other_settings(trl_model_dir):
    """TRL casts a quantized model's trainable weights to bf16: the copy keeps them bf16 (a float32 copy of the same
    values would compute other log-probabilities); a "ref" adapter already there with other settings is replaced."""
    model = trained_adapter(trl_model_dir)
    model.add_adapter(REFERENCE_ADAPTER, BituneConfig(adapter_config=LoraConfig(r=2, target_modules=["q_proj"])))
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.to(torch.bfloat16)
    copy_policy_to_reference(model)
    policy, reference = adapter_weights(model, "default"), adapter_weights(model, REFERENCE_ADAPTER)
    assert reference.keys() == policy.keys() and any("mixer" in key for key in policy)
    assert all(reference[key].dtype == torch.bfloat16 and torch.equal(reference[key], policy[key]) for key in policy)
    assert model.peft_config[REFERENCE_ADAPTER].adapter_config.r == model.peft_config["default"].adapter_config.r


def test_dpo_model_card_is_a_bitune_adapters(tmp_path, trl_model_dir):
    trainer = BituneDPOTrainer(model=trained_adapter(trl_model_dir), args=dpo_args(tmp_path / "dpo-run"),
                               train_dataset=preference_rows(), processing_class=helpers.build_tokenizer())
    trainer.create_model_card()
    card = (tmp_path / "dpo-run" / "README.md").read_text()
    assert "# Model Card for dpo-run" in card and f"`{trl_model_dir}`" in card
    assert "pipeline(" not in card and card.count("<!-- bitune:start -->") == 1
    assert "- dpo" in card and "- bitune" in card


# ---------------------------------------------------------------------- KTO, GRPO, RLOO run and keep the reference
def test_kto_trains_against_the_starting_adapter(tmp_path, trl_model_dir):
    pairs = helpers.arithmetic_rows(16)
    rows = Dataset.from_list([{"prompt": f"{q} answer :", "completion": f" {a}", "label": i % 2 == 0}
                              for i, (q, a) in enumerate(pairs)])
    model = trained_adapter(trl_model_dir)
    start = adapter_weights(model, "default")
    trainer = BituneKTOTrainer(model=model, args=KTOConfig(output_dir=str(tmp_path), **COMMON), train_dataset=rows,
                               processing_class=helpers.build_tokenizer())
    trainer.train()
    assert logged(trainer, "rewards/chosen")[0] == 0.0 and logged(trainer, "kl")[0] == 0.0
    assert all(math.isfinite(loss) for loss in logged(trainer, "loss"))
    reference, trained = adapter_weights(model, REFERENCE_ADAPTER), adapter_weights(model, "default")
    assert all(torch.equal(reference[key], start[key]) for key in start)
    assert any(not torch.equal(trained[key], start[key]) for key in start)


def completion_length_reward(completions, **kwargs) -> list[float]:
    return [float(len(completion)) for completion in completions]


@pytest.mark.parametrize(("trainer_class", "config_class"), [(BituneGRPOTrainer, GRPOConfig),
                                                              (BituneRLOOTrainer, RLOOConfig)])
def test_grpo_and_rloo_train_against_the_starting_adapter(tmp_path, trl_model_dir, trainer_class, config_class):
    prompts = Dataset.from_list([{"prompt": f"{q} answer :"} for q, _ in helpers.arithmetic_rows(16)])
    model = trained_adapter(trl_model_dir)
    start = adapter_weights(model, "default")
    args = config_class(output_dir=str(tmp_path), num_generations=2, max_completion_length=6, beta=0.05,
                        mask_truncated_completions=True, **COMMON)
    trainer = trainer_class(model=model, reward_funcs=completion_length_reward, args=args, train_dataset=prompts,
                            processing_class=helpers.build_tokenizer())
    trainer.train()
    assert logged(trainer, "kl")[0] == 0.0  # the policy and the reference agree before the first update
    assert all(math.isfinite(loss) for loss in logged(trainer, "loss"))
    reference, trained = adapter_weights(model, REFERENCE_ADAPTER), adapter_weights(model, "default")
    assert all(torch.equal(reference[key], start[key]) for key in start)
    assert any(not torch.equal(trained[key], start[key]) for key in start)


def test_grpo_without_kl_penalty_adds_no_reference(tmp_path, trl_model_dir):
    prompts = Dataset.from_list([{"prompt": f"{q} answer :"} for q, _ in helpers.arithmetic_rows(8)])
    args = GRPOConfig(output_dir=str(tmp_path), num_generations=2, max_completion_length=4, **{**COMMON,
                                                                                              "max_steps": 1})
    trainer = BituneGRPOTrainer(model=trained_adapter(trl_model_dir), reward_funcs=completion_length_reward,
                                args=args, train_dataset=prompts, processing_class=helpers.build_tokenizer())
    assert trainer.beta == 0.0 and REFERENCE_ADAPTER not in trainer.model.peft_config


# ---------------------------------------------------------------------- refused before any work
@pytest.mark.parametrize(
    ("trainer_class", "args", "message"),
    [
        (BituneGRPOTrainer, dict(config=GRPOConfig, use_vllm=True), r"`use_vllm=True` cannot be used.*vLLM"),
        (BituneRLOOTrainer, dict(config=RLOOConfig, use_vllm=True), r"`use_vllm=True` cannot be used"),
        (BituneGRPOTrainer, dict(config=GRPOConfig, use_transformers_continuous_batching=True),
         r"`use_transformers_continuous_batching=True` cannot be used"),
        (BituneDPOTrainer, dict(config=DPOConfig, padding_free=True), r"`padding_free=True` cannot be used"),
        (BituneDPOTrainer, dict(config=DPOConfig, use_liger_kernel=True), r"`use_liger_kernel=True` cannot be"),
        (BituneKTOTrainer, dict(config=KTOConfig, sync_ref_model=True), r"`sync_ref_model=True` cannot be used"),
    ],
    ids=["grpo_vllm", "rloo_vllm", "grpo_continuous_batching", "dpo_padding_free", "dpo_liger", "kto_sync_ref_model"],
)
def test_refuses_options_bitune_cannot_run_before_loading(tmp_path, trainer_class, args, message):
    config_class = args.pop("config")
    extra = {}
    if trainer_class in (BituneGRPOTrainer, BituneRLOOTrainer):
        args["num_generations"], extra["reward_funcs"] = 2, completion_length_reward
    config = config_class(output_dir=str(tmp_path), **{**COMMON, **args})
    with pytest.raises(ValueError, match=message):
        trainer_class(model=helpers.never_loaded(tmp_path), args=config, train_dataset=preference_rows(), **extra)


def test_refuses_tools_before_loading(tmp_path):
    with pytest.raises(ValueError, match=r"`tools` cannot be used with a Bitune adapter"):
        BituneGRPOTrainer(model=helpers.never_loaded(tmp_path), reward_funcs=completion_length_reward,
                          args=GRPOConfig(output_dir=str(tmp_path), num_generations=2, **COMMON), tools=[len])


def test_refuses_other_peft_methods_before_loading(tmp_path):
    with pytest.raises(ValueError, match=r"`peft_config` must be a `BituneConfig`.*use `trl\.DPOTrainer`"):
        BituneDPOTrainer(model=helpers.never_loaded(tmp_path), args=dpo_args(tmp_path),
                         train_dataset=preference_rows(), peft_config=LoraConfig(r=4))


def test_refuses_an_empty_prompt_naming_the_row(tmp_path, trl_model_dir):
    """The tests' tokenizer adds a BOS token to every text; without one, an empty prompt is no instruction."""
    tokenizer = helpers.build_tokenizer()
    tokenizer._tokenizer.post_processor = None  # no BOS token
    rows = preference_rows(6).to_list()
    rows[4]["prompt"] = ""
    with pytest.raises(ValueError, match=r"Rows \[4\] of train_dataset have an empty prompt once tokenised"):
        BituneDPOTrainer(model=trl_model_dir, args=dpo_args(tmp_path), train_dataset=Dataset.from_list(rows),
                         processing_class=tokenizer, peft_config=random_bitune_config())


# ---------------------------------------------------------------------- the reference of an adapter not "default"
def other_config(setting: str) -> BituneConfig:
    """A config that differs from `random_bitune_config()` in one setting that changes the log-probabilities."""
    lora = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    if setting == "mix_scale":
        return BituneConfig(adapter_config=LoraConfig(**lora), mix_scale=0.5)
    lora[setting] = {"lora_alpha": 64, "r": 8}[setting]
    return BituneConfig(adapter_config=LoraConfig(**lora))


def adapter_other_than_default(model_dir: str, setting: str):
    """The SFT adapter `default` and an active adapter `other` whose config differs in `setting`, both trained."""
    model = trained_adapter(model_dir)
    model.add_adapter("other", other_config(setting))
    model.set_adapter("other")
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "other" in name:
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model


@pytest.mark.parametrize("setting", ["lora_alpha", "r", "mix_scale"])
def test_dpo_reference_takes_the_config_of_the_trained_adapter(tmp_path, trl_model_dir, setting):
    """TRL adds "ref" from `peft_config["default"]`: the reference must be built from the active adapter's config."""
    model = adapter_other_than_default(trl_model_dir, setting)
    trainer = BituneDPOTrainer(model=model, args=dpo_args(tmp_path, max_steps=1), train_dataset=preference_rows(),
                               processing_class=helpers.build_tokenizer())
    reference, policy = model.peft_config[REFERENCE_ADAPTER], model.peft_config["other"]
    assert reference.mix_scale == policy.mix_scale
    assert reference.adapter_config.r == policy.adapter_config.r
    assert reference.adapter_config.lora_alpha == policy.adapter_config.lora_alpha
    trainer.train()
    assert logged(trainer, "loss")[0] == pytest.approx(math.log(2), abs=1e-5)


def test_grpo_kl_is_zero_for_an_adapter_not_named_default(tmp_path, trl_model_dir):
    prompts = Dataset.from_list([{"prompt": f"{q} answer :"} for q, _ in helpers.arithmetic_rows(8)])
    args = GRPOConfig(output_dir=str(tmp_path), num_generations=2, max_completion_length=4, beta=0.05,
                      **{**COMMON, "max_steps": 1})
    trainer = BituneGRPOTrainer(model=adapter_other_than_default(trl_model_dir, "lora_alpha"),
                                reward_funcs=completion_length_reward, args=args, train_dataset=prompts,
                                processing_class=helpers.build_tokenizer())
    trainer.train()
    assert logged(trainer, "kl")[0] == 0.0


# ---------------------------------------------------------------------- what TRL would fail on, refused by name
def saved_adapter(tmp_path, model_dir: str) -> str:
    path = str(tmp_path / "adapter")
    trained_adapter(model_dir).save_pretrained(path)
    return path


@pytest.mark.parametrize("trainer_class", [BituneDPOTrainer, BituneGRPOTrainer])
def test_refuses_a_frozen_adapter_naming_is_trainable(tmp_path, trl_model_dir, trainer_class):
    """A loaded adapter is frozen unless `is_trainable=True`: it would train to nothing, without a word."""
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trl_model_dir),
                                      saved_adapter(tmp_path, trl_model_dir))
    extra = {}
    if trainer_class is BituneGRPOTrainer:
        args, extra["reward_funcs"] = GRPOConfig(output_dir=str(tmp_path), num_generations=2, beta=0.05,
                                                 **COMMON), completion_length_reward
    else:
        args = dpo_args(tmp_path)
    with pytest.raises(ValueError, match=r"adapter `default` of `model` has no trainable weights.*is_trainable=True"):
        trainer_class(model=model, args=args, train_dataset=preference_rows(), **extra)


def test_refuses_a_bitune_ref_model(tmp_path, trl_model_dir):
    with pytest.raises(ValueError, match=r"`ref_model` cannot be a Bitune adapter.*Leave `ref_model=None`"):
        BituneDPOTrainer(model=trained_adapter(trl_model_dir), ref_model=trained_adapter(trl_model_dir),
                         args=dpo_args(tmp_path), train_dataset=preference_rows(),
                         processing_class=helpers.build_tokenizer())


def test_trls_own_dpo_trainer_with_a_bitune_ref_model_is_refused_naming_bitune_dpo_trainer(tmp_path, trl_model_dir):
    """Issue 62 item 15: TRL's fused LM head calls a `ref_model` without labels, and the refusal said only "pass
    `labels` ... or a `prompt_mask`", which a DPO user cannot do. It names the trainer that works, in one line, at the
    first reference forward, before the policy moves."""
    policy = trained_adapter(trl_model_dir)
    start = adapter_weights(policy, "default")
    trainer = DPOTrainer(model=policy, ref_model=trained_adapter(trl_model_dir), args=dpo_args(tmp_path, max_steps=1),
                         train_dataset=preference_rows(), processing_class=helpers.build_tokenizer())
    message = r"TRL's own DPOTrainer.*`ref_model`.*BituneDPOTrainer.*`ref_model=None`"
    with pytest.raises(ValueError, match=message) as error:
        trainer.train()
    assert "\n" not in str(error.value)
    assert trainer.state.global_step == 0
    assert all(torch.equal(value, start[key]) for key, value in adapter_weights(policy, "default").items())


def test_refuses_an_adapter_not_named_default(tmp_path, trl_model_dir):
    """TRL reads `peft_config["default"]` for its reference and would fail on a raw `KeyError: 'default'`."""
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trl_model_dir),
                                      saved_adapter(tmp_path, trl_model_dir), adapter_name="sft", is_trainable=True)
    with pytest.raises(ValueError, match=r"adapter is named `sft`.*named `default`.*without `adapter_name`"):
        BituneDPOTrainer(model=model, args=dpo_args(tmp_path), train_dataset=preference_rows(),
                         processing_class=helpers.build_tokenizer())


def test_refuses_a_max_length_that_drops_every_row(tmp_path, trl_model_dir):
    """TRL drops rows whose prompt fills `max_length`; with none left, torch would fail on "num_samples=0"."""
    with pytest.raises(ValueError, match=r"Every row of `train_dataset` \(16\) was dropped.*`max_length=3`"):
        BituneDPOTrainer(model=trl_model_dir, args=dpo_args(tmp_path, max_length=3),
                         train_dataset=preference_rows(), processing_class=helpers.build_tokenizer(),
                         peft_config=random_bitune_config())


def test_trls_own_dpo_trainer_warns_once_that_its_reference_is_the_base_model(tmp_path, trl_model_dir):
    """TRL's own trainer scores the reference of an adapter made from `peft_config` with the adapters disabled: the
    base model, which a Bitune adapter is not at its start. The Bitune forward warns at the first step, once."""
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(trl_model_dir),
                         args=dpo_args(tmp_path, max_steps=2), train_dataset=preference_rows(),
                         processing_class=helpers.build_tokenizer(), peft_config=random_bitune_config())
    with pytest.warns(UserWarning) as caught:
        trainer.train()
    named = [str(w.message) for w in caught if "BituneDPOTrainer" in str(w.message)]
    assert len(named) == 1 and "\n" not in named[0] and "base model" in named[0]
    bitune = BituneDPOTrainer(model=trl_model_dir, args=dpo_args(tmp_path / "bitune", max_steps=1),
                              train_dataset=preference_rows(), processing_class=helpers.build_tokenizer(),
                              peft_config=random_bitune_config())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bitune.train()
    assert not [w for w in caught if "BituneDPOTrainer" in str(w.message)]
