"""
Bitune over a base quantized with bitsandbytes (QLoRA), on CPU.

- The training forward, the gradients of both weight sets and of the mixing scalars, and `generate` against the
  per-row reference (tests/reference.py) run on the same quantized base: 4-bit NF4 computing in float32 and in bf16
  (with double quantization, as QLoRA does), and 8-bit; on Llama, Gemma and Qwen2.
- The quantized layers against float layers holding the de-quantized weights (`model.dequantize()`), so that a fault
  shared by the Bitune forward and the reference (both run PEFT's quantized layers) cannot go unseen.
- The mixing scalars stay float32 through `prepare_model_for_kbit_training` and TRL's cast of trainable parameters.
- The three usual recipes on the embedded model (examples/miniature/base): `prepare_model_for_kbit_training`,
  `get_peft_model` and `BituneSFTTrainer` with gradient checkpointing; `bitune-sft --load_in_4bit true` (in process;
  docs/training.md runs the command itself); `PeftModel.from_pretrained` onto a 4-bit base and onto the float base.
- The refusal of inner PEFT methods whose quantized layers are not checked.

Tolerances (tests/precision.py). With float32 compute (NF4 in float32, and 8-bit: bitsandbytes quantizes each token's
activations on its own, so batching changes nothing there), both sides de-quantize the same stored weights the same way
and differ only in the order of float32 sums, as on a float base: the float tests' 1e-5 (measured: at most 7e-7 over 4
seeds, both paddings, three architectures). With bf16 compute, each base matmul rounds its input and output to bf16;
where the float32 inputs of the two sides differ in the last bits (another order of summation: batching, padding,
another CPU's kernels), a rounding lands on the neighbouring bf16 value, a relative change of 2^-8 in one element, and
what reaches a logit or a gradient scales with the largest values of that tensor. Measured on Qwen2, the worst of the
three: 0.19 of one rounding (2^-8) of the largest logit and 0.15 of the largest gradient of a tensor, under every
kernel setting of tests/README.md; the tolerance is two roundings of the largest value. A mixing fault is 60 to 2,900
roundings away (coefficients 10% off, swapped between keys and values, or shifted by one layer); 1% off fails too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import datasets
import pytest
import torch
from peft import (
    HRAConfig,
    IA3Config,
    LoHaConfig,
    LoraConfig,
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    prepare_model_for_kbit_training,
)
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from bitsandbytes_support import why_bitsandbytes_cannot_run
from peft_bitune import BituneConfig, compat
from precision import assert_same_greedy_tokens_up_to_a_tie, float32_sums, roundings
from reference import OTHER_INNER_METHODS, left_padded, make_bitune, reference_greedy_steps
from test_forward import assert_matches_reference, make_batch, trainable_grads
from test_generate import GREEDY, generated, prompts
from tiny_models import VOCAB

_PROBLEM = why_bitsandbytes_cannot_run()
if _PROBLEM is not None:
    pytest.skip(_PROBLEM, allow_module_level=True)

import bitsandbytes  # noqa: E402  (after the check above, which says why it could not be used)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MINIATURE_BASE = str(EXAMPLES / "miniature" / "base")
MINIATURE_DATA = str(EXAMPLES / "miniature" / "data")

QUANTIZATIONS = {
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
    "nf4-bf16": dict(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True,
    ),
    "int8": dict(load_in_8bit=True),
}
TOLERANCE = {"nf4": float32_sums(1e-5), "nf4-bf16": roundings(torch.bfloat16, 2), "int8": float32_sums(1e-5)}
FLOAT = float32_sums(1e-4)  # generation on a float base, as in test_generate.py
ARCHITECTURES = ["llama", "gemma", "qwen2"]


def quantized_layer_class(quantization: str) -> type:
    eight_bit = QUANTIZATIONS[quantization].get("load_in_8bit", False)
    return bitsandbytes.nn.Linear8bitLt if eight_bit else bitsandbytes.nn.Linear4bit


def load_quantized(path: str, quantization: str, **kwargs):
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=BitsAndBytesConfig(**QUANTIZATIONS[quantization]), device_map="cpu", **kwargs
    )
    return model.eval()


def quantized_bitune(saved_models, arch: str, quantization: str, adapter_config=None):
    """A Bitune model with random adapters and mixing scalars over a quantized tiny base; checks that PEFT wrapped
    quantized layers (so that nothing below runs on float weights by mistake)."""
    model = make_bitune(load_quantized(saved_models[arch], quantization), adapter_config=adapter_config)
    tuner_layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    assert tuner_layers and all(
        isinstance(layer.get_base_layer(), quantized_layer_class(quantization)) for layer in tuner_layers
    )
    return model


# ---------------------------------------------------------------------- exactness against the per-row reference
@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("quantization", list(QUANTIZATIONS))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_training_forward_and_gradients_match_the_reference_on_the_quantized_base(
    saved_models, arch, quantization, padding_side
):
    model = quantized_bitune(saved_models, arch, quantization)
    model.train()
    assert_matches_reference(model, padding_side, TOLERANCE[quantization])
    grads = trainable_grads(model)
    mixer_grads = [grads[name] for name in grads if "bitune_mixers" in name]
    assert len(mixer_grads) == 2 and all(bool((grad != 0).any()) for grad in mixer_grads)
    assert any("default__bidirectional" in name for name in grads) and any("default__causal" in name for name in grads)


@pytest.mark.parametrize("adapter_config", OTHER_INNER_METHODS)
def test_dora_and_ia3_match_the_reference_on_a_4bit_base(saved_models, adapter_config):
    model = quantized_bitune(saved_models, "llama", "nf4", adapter_config=adapter_config)
    model.train()
    assert_matches_reference(model, "left", TOLERANCE["nf4"])


@pytest.mark.parametrize("quantization", list(QUANTIZATIONS))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_generate_matches_the_reference_on_the_quantized_base(saved_models, arch, quantization):
    """Batched greedy decoding against each prompt alone and against the per-row reference, scores within the
    training test's tolerance; in bf16 compute, the tokens may part only at a tie within that tolerance (the best two
    scores of a tiny random model are as little as 0.3 bf16 roundings of the largest apart)."""
    model = quantized_bitune(saved_models, arch, quantization).eval()
    rows = prompts()
    batch = left_padded(rows)
    out = model.generate(**batch, **GREEDY, output_scores=True, return_dict_in_generate=True)
    tokens = generated(out, batch)
    for i, row in enumerate(rows):
        alone_batch = left_padded([row])
        alone = model.generate(**alone_batch, **GREEDY, output_scores=True, return_dict_in_generate=True)
        assert_same_greedy_tokens_up_to_a_tie(
            tokens[i].tolist(), [step[i] for step in out.scores],
            generated(alone, alone_batch)[0].tolist(), [step[0] for step in alone.scores], TOLERANCE[quantization],
        )
    longest = max(range(len(rows)), key=lambda i: len(rows[i]))
    expected_tokens, expected_scores = reference_greedy_steps(model, rows[longest], GREEDY["max_new_tokens"])
    assert_same_greedy_tokens_up_to_a_tie(tokens[longest].tolist(), [step[longest] for step in out.scores],
                                          expected_tokens, expected_scores, TOLERANCE[quantization])


# ---------------------------------------------------------------------- quantized layers against float layers
def adapter_parameters(model) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "adapter_config",
    [
        None,
        LoraConfig(r=4, target_modules="all-linear", use_dora=True, init_lora_weights=False),
        IA3Config(target_modules=["q_proj", "k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"],
                  init_ia3_weights=False),
    ],
    ids=["lora", "dora", "ia3"],
)
@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_a_4bit_base_trains_like_a_float_base_holding_its_dequantized_weights(saved_models, arch, adapter_config):
    quantized = quantized_bitune(saved_models, arch, "nf4", adapter_config=adapter_config)
    twin = make_bitune(load_quantized(saved_models[arch], "nf4").dequantize(), adapter_config=adapter_config)
    assert not any(isinstance(m, bitsandbytes.nn.Linear4bit) for m in twin.modules())
    with torch.no_grad():
        twin_parameters = adapter_parameters(twin)
        for name, parameter in adapter_parameters(quantized).items():
            twin_parameters[name].copy_(parameter)
    _, batch, _ = make_batch("left")
    results = []
    for model in (quantized, twin):
        model.train()
        output = model(**batch)
        output.loss.backward()
        results.append((output, trainable_grads(model)))
    (output, grads), (twin_output, twin_grads) = results
    torch.testing.assert_close(output.loss, twin_output.loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(output.logits, twin_output.logits, atol=1e-5, rtol=0)
    assert grads.keys() == twin_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], twin_grads[name], atol=1e-5, rtol=0, msg=name)
    quantized.eval()
    twin.eval()
    batch = left_padded(prompts(seed=6))
    assert torch.equal(quantized.generate(**batch, **GREEDY), twin.generate(**batch, **GREEDY))


def test_training_after_generation_gets_the_gradients_of_a_fresh_model(saved_models):
    """bitsandbytes repacks a 4-bit layer for its CPU inference kernel the first time it runs without gradients, after
    which it passes no gradient to its input; Bitune keeps the layers out of that layout (see
    `peft_bitune.tuner.quantization.prepare_quantized_layers`)."""
    _, batch, _ = make_batch("right")
    fresh = quantized_bitune(saved_models, "llama", "nf4")
    fresh.train()
    fresh(**batch).loss.backward()
    used = quantized_bitune(saved_models, "llama", "nf4").eval()
    with torch.no_grad():
        used.generate(**left_padded(prompts()), **GREEDY)
        used(**batch)
    used.train()
    used(**batch).loss.backward()
    expected, got = trainable_grads(fresh), trainable_grads(used)
    assert got.keys() == expected.keys()
    for name in got:
        assert torch.equal(got[name], expected[name]), name


def test_a_base_that_bitsandbytes_repacked_for_cpu_inference_is_refused():
    base = load_quantized(MINIATURE_BASE, "nf4")  # repacking needs layer widths the tiny test models do not have
    with torch.no_grad():
        base(input_ids=torch.randint(3, VOCAB, (1, 5)))  # e.g. `generate` on the base model before wrapping it
    if not any(compat.is_repacked_for_cpu_inference(m) for m in compat.bitsandbytes_4bit_layers(base.modules())):
        pytest.skip(
            f"bitsandbytes {bitsandbytes.__version__} does not repack 4-bit layers for inference here (this CPU has "
            "no AVX512-BF16, or the release predates the repacking): there is nothing to refuse"
        )
    with pytest.raises(ValueError, match="repacked by bitsandbytes.*Load the base model again"):
        get_peft_model(base, BituneConfig())
    assert not any(isinstance(module, BaseTunerLayer) for module in base.modules())


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_gradient_checkpointing_on_a_quantized_base_gives_the_same_gradients(saved_models, quantization):
    _, batch, _ = make_batch("right")
    results = []
    for checkpointing in (False, True):
        model = quantized_bitune(saved_models, "llama", quantization)
        if checkpointing:
            compat.enable_checkpointing(model.base_model.model, use_reentrant=False)
        model.train()
        loss = model(**batch).loss
        loss.backward()
        results.append((loss, trainable_grads(model)))
    (loss, expected), (checkpointed_loss, got) = results
    torch.testing.assert_close(checkpointed_loss, loss, atol=1e-6, rtol=0)
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=0, msg=name)


# ---------------------------------------------------------------------- the mixing scalars' dtype
def test_mixing_scalars_stay_float32_through_kbit_preparation(saved_models):
    base = load_quantized(saved_models["llama"], "nf4-bf16", dtype=torch.bfloat16)
    assert base.model.norm.weight.dtype == torch.bfloat16
    base = prepare_model_for_kbit_training(base, gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(base, BituneConfig(adapter_config=LoraConfig(r=4, target_modules="all-linear")))
    mixer = model.base_model.mixer
    assert mixer.key_weights.dtype == mixer.value_weights.dtype == torch.float32
    assert mixer.key_weights.requires_grad and mixer.value_weights.requires_grad


# ---------------------------------------------------------------------- the usual recipes, on the embedded model
def miniature_rows(count: int):
    return datasets.load_dataset(MINIATURE_DATA, split=f"train[:{count}]")


def stored_4bit_weights(model) -> list[torch.Tensor]:
    """The packed 4-bit weights of the model's quantized layers, in module order."""
    return [module.weight for module in model.modules() if isinstance(module, bitsandbytes.nn.Linear4bit)]


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
    """BitsAndBytesConfig -> prepare_model_for_kbit_training -> get_peft_model -> BituneSFTTrainer, with gradient
    checkpointing (TRL's default), as a QLoRA user writes it; three steps, saved."""
    from trl_integration import BituneSFTConfig, BituneSFTTrainer

    output_dir = tmp_path_factory.mktemp("qlora")
    base = load_quantized(MINIATURE_BASE, "nf4-bf16")
    base = prepare_model_for_kbit_training(base)  # PEFT's default: reentrant checkpointing, which the trainer resets
    before = [weight.data.clone() for weight in stored_4bit_weights(base)]
    model = get_peft_model(base, BituneConfig())
    initial = {name: p.detach().clone() for name, p in adapter_parameters(model).items()}
    trainer = BituneSFTTrainer(
        model=model,
        args=BituneSFTConfig(
            output_dir=str(output_dir), max_steps=3, per_device_train_batch_size=4, learning_rate=3e-3,
            **{compat.CHECKPOINTING_ARGUMENT: True}, report_to=[], save_strategy="no", logging_steps=1,
            use_cpu=True, bf16=False, disable_tqdm=True, seed=0,
        ),
        train_dataset=miniature_rows(24),
    )
    dtypes = {name: p.dtype for name, p in adapter_parameters(trainer.model).items()}
    trainer.train()
    trainer.save_model(str(output_dir / "adapter"))
    return dict(trainer=trainer, before=before, initial=initial, dtypes_after_setup=dtypes,
                adapter=str(output_dir / "adapter"))


def test_the_qlora_recipe_trains_both_weight_sets_and_the_mixing_over_a_frozen_4bit_base(qlora_run):
    trainer = qlora_run["trainer"]
    model = trainer.model
    # TRL casts the adapters of a quantized model to bf16 (the QLoRA paper's choice); the mixing scalars stay float32.
    dtypes = qlora_run["dtypes_after_setup"]
    assert {dtype for name, dtype in dtypes.items() if "lora_" in name} == {torch.bfloat16}
    assert {dtype for name, dtype in dtypes.items() if "bitune_mixers" in name} == {torch.float32}
    assert all(p.dtype == torch.float32 for p in model.base_model.bitune_mixers.parameters())
    decoder_layers = model.base_model.model.model.layers
    assert all(layer.gradient_checkpointing for layer in decoder_layers)
    assert not compat.uses_reentrant_checkpointing(decoder_layers[0])
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    after = stored_4bit_weights(model)  # the base stayed 4-bit and frozen
    assert len(after) == len(qlora_run["before"]) == 7 * len(decoder_layers)
    assert all(isinstance(weight, bitsandbytes.nn.Params4bit) and not weight.requires_grad for weight in after)
    assert all(torch.equal(weight.data, stored) for weight, stored in zip(after, qlora_run["before"]))
    trained = adapter_parameters(model)
    for part in ("default__causal", "default__bidirectional", "bitune_mixers"):
        changed = [name for name in trained if part in name and not torch.equal(
            trained[name].detach().to(qlora_run["initial"][name].dtype), qlora_run["initial"][name])]
        assert changed, f"nothing of {part} was trained"


def test_a_plain_training_loop_after_kbit_preparation_names_the_checkpointing_fix(saved_models):
    base = prepare_model_for_kbit_training(load_quantized(saved_models["llama"], "nf4"))
    model = get_peft_model(base, BituneConfig(adapter_config=LoraConfig(r=4, target_modules="all-linear")))
    model.train()
    with pytest.raises(ValueError, match=r"prepare_model_for_kbit_training.*'use_reentrant': False"):
        model(**make_batch("right")[1])


def test_bitune_sft_load_in_4bit_trains_the_embedded_model_and_saves(tmp_path, monkeypatch):
    from trl_integration import trainer as trainer_module
    from trl_integration.cli import train as cli_train

    seen = {}
    train = trainer_module.BituneSFTTrainer.train

    def recording_train(self, *args, **kwargs):
        seen["quantized_layers"] = sum(isinstance(m, bitsandbytes.nn.Linear4bit) for m in self.model.modules())
        seen["mixer_dtypes"] = {p.dtype for p in self.model.base_model.bitune_mixers.parameters()}
        return train(self, *args, **kwargs)

    monkeypatch.setattr(trainer_module.BituneSFTTrainer, "train", recording_train)
    output = tmp_path / "out"
    cli_train([
        "--model_name_or_path", MINIATURE_BASE, "--dataset_name", MINIATURE_DATA, "--output_dir", str(output),
        "--load_in_4bit", "true", "--max_steps", "2", "--per_device_train_batch_size", "4", "--learning_rate", "3e-3",
        "--bf16", "false", "--use_cpu", "--report_to", "none", "--save_strategy", "no",
    ])
    layers = AutoModelForCausalLM.from_pretrained(MINIATURE_BASE).config.num_hidden_layers
    assert seen["quantized_layers"] == 7 * layers  # q, k, v, o, gate, up, down of every layer
    assert seen["mixer_dtypes"] == {torch.float32}
    saved = json.loads((output / "adapter_config.json").read_text())
    assert saved["peft_type"] == "BITUNE"
    assert (output / "adapter_model.safetensors").exists()


def test_the_adapter_loads_onto_a_4bit_base_and_onto_the_float_base(qlora_run):
    from safetensors.torch import load_file

    saved = load_file(f"{qlora_run['adapter']}/adapter_model.safetensors")
    assert saved and not any("absmax" in key or "quant" in key for key in saved)  # the adapter, not the base
    batch = left_padded(prompts(seed=2, lengths=[7, 12]))
    bases = {"nf4-bf16": load_quantized(MINIATURE_BASE, "nf4-bf16"),
             "float": AutoModelForCausalLM.from_pretrained(MINIATURE_BASE)}
    for kind, base in bases.items():
        model = PeftModel.from_pretrained(base, qlora_run["adapter"]).eval()
        loaded = get_peft_model_state_dict(model)
        assert loaded.keys() == saved.keys()
        for key, value in saved.items():
            assert torch.equal(loaded[key].to(value.dtype), value), key
        mixer = model.base_model.mixer
        assert mixer.key_weights.dtype == torch.float32 and not mixer.key_weights.requires_grad
        settings = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
        out = model.generate(**batch, **settings, output_scores=True, return_dict_in_generate=True)
        tokens = generated(out, batch)
        rows = [row[mask.bool()] for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
        for i, (row, new) in enumerate(zip(rows, tokens)):
            assert_same_greedy_tokens_up_to_a_tie(new.tolist(), [step[i] for step in out.scores],
                                                  *reference_greedy_steps(model, row, 5), TOLERANCE.get(kind, FLOAT))


# ---------------------------------------------------------------------- refusals
def test_an_inner_method_not_checked_over_quantized_layers_is_refused_before_any_weight_is_created(saved_models):
    base = load_quantized(saved_models["llama"], "nf4")
    with pytest.raises(ValueError, match=r"quantized with bitsandbytes 4-bit \(nf4\).*not LOHA"):
        get_peft_model(base, BituneConfig(adapter_config=LoHaConfig(target_modules=["q_proj", "v_proj"])))
    assert not any(isinstance(module, BaseTunerLayer) for module in base.modules())
    base = load_quantized(saved_models["llama"], "int8")
    with pytest.raises(ValueError, match=r"quantized with bitsandbytes 8-bit.*not HRA"):
        get_peft_model(base, BituneConfig(adapter_config=HRAConfig(target_modules=["q_proj", "v_proj"])))


def test_loading_such_an_adapter_onto_a_quantized_base_is_refused_too(load_base, saved_models, tmp_path):
    config = BituneConfig(adapter_config=LoHaConfig(target_modules=["q_proj", "v_proj"]))
    get_peft_model(load_base("llama"), config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not LOHA"):
        PeftModel.from_pretrained(load_quantized(saved_models["llama"], "nf4"), tmp_path)
    # On the float base holding the de-quantized weights, nothing is quantized any more, and nothing is refused.
    PeftModel.from_pretrained(load_quantized(saved_models["llama"], "nf4").dequantize(), tmp_path)


def test_the_refusal_still_has_a_reason_plain_peft_loha_fails_over_a_4bit_layer(saved_models):
    """If PEFT learns to wrap 4-bit layers with LoHa, this fails: then check LoHa against the de-quantized weights, as
    above, and accept it in `peft_bitune.tuner.quantization.QUANTIZED_BASE_METHODS`."""
    model = get_peft_model(load_quantized(saved_models["llama"], "nf4"),
                           LoHaConfig(target_modules=["q_proj", "v_proj"], init_weights=False))
    with pytest.raises(RuntimeError):
        model(input_ids=torch.randint(3, VOCAB, (1, 5)))


def test_dpo_on_a_4bit_base_starts_at_ln2_with_float32_mixing_scalars(tmp_path, trl_model_dir):
    """TRL casts a quantized model's trainable weights to bf16: the reference copy keeps their dtype (so it computes
    what the policy computes), and the mixing scalars stay float32."""
    from datasets import Dataset
    from trl import DPOConfig

    import trl_helpers as helpers
    from trl_integration import BituneDPOTrainer
    from trl_integration.policy_trainers import REFERENCE_ADAPTER

    rows = Dataset.from_list([{"prompt": f"{q} answer :", "chosen": f" {a}", "rejected": " 0"}
                              for q, a in helpers.arithmetic_rows(8)])
    args = DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, learning_rate=1e-3,
                     report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False, logging_steps=1)
    trainer = BituneDPOTrainer(
        model=load_quantized(trl_model_dir, "nf4"), args=args, train_dataset=rows,
        processing_class=helpers.build_tokenizer(),
        peft_config=BituneConfig(adapter_config=LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)),
    )
    bitune = trainer.model.base_model
    assert all(p.dtype == torch.float32 for p in bitune.bitune_mixers.parameters())
    lora_dtypes = {p.dtype for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert lora_dtypes == {torch.bfloat16}  # policy and reference alike
    trainer.train()
    first = next(entry for entry in trainer.state.log_history if "loss" in entry)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert REFERENCE_ADAPTER in trainer.model.peft_config
