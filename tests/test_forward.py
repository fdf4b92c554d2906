"""The batched training forward against the per-row reference, on every supported architecture."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

from peft_bitune import compat
from precision import Tolerance, float32_sums, roundings
from reference import (
    OTHER_INNER_METHODS,
    PROMPT_LENGTHS,
    alphas,
    answer_logits,
    make_bitune,
    padded_batch,
    reference_batch,
    reference_row,
    trainable_grads,
)
from tiny_models import ARCHITECTURES, ATTENTION_CASES, VOCAB, model_configs


def make_batch(padding_side: str, **kwargs):
    return padded_batch(padding_side, VOCAB, **kwargs)


def assert_matches_reference(model, padding_side, tolerance: Tolerance = float32_sums(1e-5), reference=None):
    rows, batch, _ = make_batch(padding_side)
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    grads = trainable_grads(model)

    model.zero_grad()
    ref_logits, ref_loss = (reference or reference_batch)(model, rows, PROMPT_LENGTHS)
    ref_loss.backward()
    ref_grads = trainable_grads(model)

    # A token's cross-entropy moves by at most twice the largest change of its logits: the loss is held to the
    # logits' tolerance, doubled, rather than to one of its own size.
    largest_logit = max(float(want.detach().abs().max()) for want in ref_logits)
    tolerance.assert_close(out.loss, ref_loss, scale=2 * largest_logit)
    for got, want in zip(answer_logits(out.logits, batch, rows, PROMPT_LENGTHS), ref_logits):
        tolerance.assert_close(got, want)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        tolerance.assert_close(grads[name], ref_grads[name], msg=name)
    return out


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize(("arch", "attn_implementation"), ATTENTION_CASES)
def test_batched_forward_matches_per_row_reference(load_base, arch, attn_implementation, padding_side):
    model = make_bitune(load_base(arch, attn_implementation))
    model.train()
    assert_matches_reference(model, padding_side)


@pytest.mark.parametrize("adapter_config", OTHER_INNER_METHODS)
def test_other_peft_methods_match_reference(load_base, adapter_config):
    model = make_bitune(load_base("llama"), adapter_config=adapter_config)
    model.train()
    assert_matches_reference(model, "left")


def test_prompt_mask_gives_the_same_result_as_labels(load_base):
    model = make_bitune(load_base("qwen2"))
    rows, batch, prompt_mask = make_batch("right")
    from_labels = model(**batch)
    # With an explicit prompt mask, labels on instruction tokens are not used.
    labels_everywhere = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    from_mask = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                      labels=labels_everywhere, prompt_mask=prompt_mask)
    torch.testing.assert_close(from_mask.loss, from_labels.loss)
    torch.testing.assert_close(from_mask.logits, from_labels.logits)


def test_output_is_aligned_with_input_and_prompt_positions_are_zero(load_base):
    model = make_bitune(load_base("llama"))
    rows, batch, prompt_mask = make_batch("left")
    out = model(**batch)
    assert out.logits.shape == (*batch["input_ids"].shape, VOCAB)
    # Everything before the last instruction token (and padding) holds zeros.
    last_prompt = torch.zeros_like(prompt_mask)
    for i, p in enumerate(PROMPT_LENGTHS):
        start = int(batch["attention_mask"][i].argmax())
        last_prompt[i, start + p - 1] = 1
    unused = (prompt_mask.bool() & ~last_prompt.bool()) | (batch["attention_mask"] == 0)
    assert torch.all(out.logits[unused] == 0)
    assert torch.all(out.logits[~unused].abs().sum(-1) > 0)


def test_logits_are_a_tensor_of_their_own_and_take_an_in_place_op(load_base):
    """Not a view: FSDP2 hooks the backward of the model's outputs, and an in-place op on a returned view drops that
    hook (tests/test_sharding.py trains through one). A loss from the logits after `div_` gives the same gradients."""
    model = make_bitune(load_base("llama"))
    model.train()
    _, batch, _ = make_batch("right")
    out = model(**batch)
    assert out.logits._base is None, "the logits are a view of another tensor"
    out.loss.backward()
    expected = trainable_grads(model)
    model.zero_grad()
    logits = model(**batch).logits
    logits.div_(1.0)
    labels = batch["labels"]
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()).backward()
    got = trainable_grads(model)
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-5, msg=name)


def test_every_parameter_that_can_influence_the_loss_gets_a_gradient(load_base):
    base = load_base("llama")
    frozen_before = {n for n, p in base.named_parameters()}
    model = make_bitune(base)
    model.train()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable, "nothing is trainable"
    assert all(("lora_" in n) or ("bitune_mixers" in n) for n in trainable)
    assert len([n for n in trainable if "bitune_mixers" in n]) == 2
    assert len(frozen_before) == len([n for n, p in model.named_parameters() if not p.requires_grad])

    _, batch, _ = make_batch("right")
    model(**batch).loss.backward()
    last = base.config.num_hidden_layers - 1
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        # The bidirectional weights of the last layer only matter through its keys and values.
        unreachable = f"layers.{last}." in name and "bidirectional" in name and not any(
            proj in name for proj in ("k_proj", "v_proj")
        )
        if unreachable:
            assert param.grad is None, name
        else:
            assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_bidirectional_pass_sees_later_prompt_tokens_and_causal_does_not(load_base):
    model = make_bitune(load_base("llama", "sdpa"))
    bitune = model.base_model
    prompt = torch.randint(3, VOCAB, (1, 6))
    changed = prompt.clone()
    changed[0, 4] = (changed[0, 4] + 1) % VOCAB

    def first_key(ids, weight_set, is_causal):
        from transformers import DynamicCache

        cache = DynamicCache(config=bitune.model.config)
        with bitune.weights(weight_set):
            bitune.model(input_ids=ids, **compat.with_cache(bitune.model, cache), use_cache=True, is_causal=is_causal)
        # Layer 0's keys are projections of the embeddings alone; the last layer's have been through attention.
        return cache.layers[-1].keys[..., 0, :]

    assert not torch.allclose(first_key(prompt, "bidirectional", False), first_key(changed, "bidirectional", False))
    torch.testing.assert_close(first_key(prompt, "causal", True), first_key(changed, "causal", True))


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_is_causal_false_equals_a_hand_built_full_mask(load_base, attn_implementation):
    base = load_base("llama", attn_implementation)
    ids = torch.randint(3, VOCAB, (1, 7))
    bidirectional = base(input_ids=ids, is_causal=False).logits
    full_mask = torch.zeros(1, 1, 7, 7)  # additive: nothing masked
    by_hand = base(input_ids=ids, attention_mask=full_mask).logits
    torch.testing.assert_close(bidirectional, by_hand, atol=1e-5, rtol=0)
    assert not torch.allclose(bidirectional, base(input_ids=ids).logits, atol=1e-3)


def test_one_token_prompts_are_plain_causal_decoding(load_base):
    model = make_bitune(load_base("llama"))
    ids = torch.randint(3, VOCAB, (2, 6))
    labels = ids.clone()
    labels[:, 0] = -100
    out = model(input_ids=ids, labels=labels)
    with model.base_model.weights("causal"):
        plain = model.base_model.model(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.loss, plain.loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.logits, plain.logits, atol=1e-6, rtol=0)


def test_disable_adapter_gives_the_base_model_outputs(load_base):
    base = load_base("gemma2")
    _, batch, _ = make_batch("right")
    expected = base(**batch)
    model = make_bitune(base)
    with model.disable_adapter():
        got = model(**batch)
    torch.testing.assert_close(got.logits, expected.logits)
    torch.testing.assert_close(got.loss, expected.loss)
    assert not torch.allclose(model(**batch).loss, expected.loss)


def test_both_weight_sets_and_the_mixing_train_again_after_disable_adapter(load_base):
    model = make_bitune(load_base("llama"))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any("bidirectional" in name for name in trainable) and any("bitune_mixers" in name for name in trainable)
    with model.disable_adapter():
        assert not any(p.requires_grad for p in model.parameters())
    assert {name for name, p in model.named_parameters() if p.requires_grad} == trainable
    model.train()
    model(**make_batch("right")[1]).loss.backward()
    assert model.base_model.mixer.key_weights.grad is not None
    assert any(p.grad is not None for name, p in model.named_parameters() if "bidirectional" in name)


def test_set_requires_grad_acts_on_both_weight_sets_and_the_mixing(load_base):
    model = make_bitune(load_base("llama"))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    model.set_requires_grad("default", requires_grad=False)
    assert not any(p.requires_grad for p in model.parameters())
    model.set_requires_grad(["default"])
    assert {name for name, p in model.named_parameters() if p.requires_grad} == trainable
    with pytest.raises(ValueError, match=r"\['other'\] not found"):
        model.set_requires_grad("other")


def test_shared_weights_ablation_uses_one_weight_set_for_both_passes(load_base):
    model = make_bitune(load_base("llama"), shared_weights=True)
    model.train()
    names = [n for n, _ in model.named_parameters()]
    assert not any("bidirectional" in n for n in names)
    assert_matches_reference(model, "left")


def test_causal_second_pass_ablation(load_base):
    model = make_bitune(load_base("qwen3"), second_pass_attention="causal")
    model.train()

    def reference(model, rows, prompt_lengths):
        results = [reference_row(model, row, p, second_pass_causal=True) for row, p in zip(rows, prompt_lengths)]
        total = sum(len(row) - p for row, p in zip(rows, prompt_lengths))
        return [r[0] for r in results], sum(r[1] for r in results) / total

    assert_matches_reference(model, "right", reference=reference)


def test_frozen_mixing_ablation_keeps_alpha_fixed(load_base):
    model = make_bitune(load_base("llama"), train_mixing=False, mix_init=0.03)
    mixer = model.base_model.mixer
    assert not mixer.key_weights.requires_grad and not mixer.value_weights.requires_grad
    _, batch, _ = make_batch("left")
    model(**batch).loss.backward()
    assert mixer.key_weights.grad is None
    assert any(p.grad is not None for n, p in model.named_parameters() if "bidirectional" in n)


def test_mixing_coefficients_start_at_one_half():
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from peft_bitune import BituneConfig

    base = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                        num_attention_heads=2))
    model = get_peft_model(base, BituneConfig())
    coefficients = model.base_model.get_mixing_coefficients()
    assert set(coefficients) == {"keys", "values"}
    for alpha in coefficients.values():
        assert alpha.shape == (3,) and alpha.dtype == torch.float32
        torch.testing.assert_close(alpha, torch.full((3,), 0.5))


def test_bfloat16_forward_is_close_to_float32(load_base):
    """A bf16 model against its float32 twin: the logits within 32 bf16 roundings (2^-8 each) of the largest logit,
    the loss within twice that (as in `assert_matches_reference`). Measured: 9.8 roundings, the same under every kernel
    setting of tests/README.md (the difference is bf16's rounding of every activation, not an order of sums)."""
    fp32 = make_bitune(load_base("llama"))
    bf16 = make_bitune(load_base("llama", dtype=torch.bfloat16))
    _, batch, _ = make_batch("left")
    out32 = fp32(**batch)
    out16 = bf16(**batch)
    assert out16.logits.dtype == torch.bfloat16
    assert bf16.base_model.mixer.key_weights.dtype == torch.float32
    tolerance = roundings(torch.bfloat16, 32)
    tolerance.assert_close(out16.logits.float(), out32.logits.detach())
    tolerance.assert_close(out16.loss.float(), out32.loss.detach(), scale=2 * float(out32.logits.detach().abs().max()))
    out16.loss.backward()
    assert bf16.base_model.mixer.key_weights.grad is not None


@pytest.mark.parametrize(
    "cast",
    [lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to("cpu", torch.bfloat16)],
    ids=["to-bfloat16", "half", "to-device-and-dtype"],
)
def test_mixing_scalars_stay_float32_through_model_dtype_casts(load_base, cast):
    model = make_bitune(load_base("llama"))
    mixer = model.base_model.mixer
    before = {name: p.detach().clone() for name, p in mixer.named_parameters()}
    cast(model)
    assert next(model.base_model.model.parameters()).dtype != torch.float32
    for name, parameter in mixer.named_parameters():
        assert parameter.dtype == torch.float32 and parameter.requires_grad
        assert torch.equal(parameter.detach(), before[name])  # moved as float32, not rounded through the cast
    # A small step of a small scalar survives (in bf16, 0.01 + 1e-5 rounds back to 0.01).
    with torch.no_grad():
        mixer.key_weights.fill_(0.01).add_(1e-5)
    assert bool((mixer.key_weights != 0.01).all())
    model.float()
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_gradient_checkpointing_gives_the_same_gradients(load_base, arch):
    plain = make_bitune(load_base(arch))
    plain.train()
    _, batch, _ = make_batch("right")
    loss = plain(**batch).loss
    loss.backward()
    expected = trainable_grads(plain)

    model = make_bitune(load_base(arch))
    compat.enable_checkpointing(model.base_model.model, use_reentrant=False)
    model.train()
    checkpointed_loss = model(**batch).loss
    checkpointed_loss.backward()
    got = trainable_grads(model)
    torch.testing.assert_close(checkpointed_loss, loss)
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=0, msg=name)


def multi_head_base(arch: str):
    """The tiny `arch` with as many key/value heads as query heads (the tiny models are grouped-query): a token's keys
    and values outweigh its hidden state, as on Gemma-7B, Llama-2-7B and Phi-2."""
    from transformers import AutoModelForCausalLM

    config = model_configs()[arch]
    config.num_key_value_heads = config.num_attention_heads
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("heads", ["grouped_query", "multi_head"])
def test_checkpointing_recomputes_the_prompt_keys_values_exactly(load_base, arch, heads):
    """Every architecture: a checkpointed step, which runs the prompt passes' layers without autograd and recomputes
    them layer by layer in the answer pass's forward and backward, gives the loss and gradients of the step that
    records the prompt passes' keys/values (not checkpointed), which the per-row reference checks."""
    from peft_bitune.tuner import layer_inputs

    base = (lambda: load_base(arch)) if heads == "grouped_query" else (lambda: multi_head_base(arch))
    plain = make_bitune(base())
    plain.train()
    _, batch, _ = make_batch("right")
    loss = plain(**batch).loss
    loss.backward()
    model = make_bitune(base())
    compat.enable_checkpointing(model.base_model.model, use_reentrant=False)
    model.train()
    runs = []
    run = layer_inputs.LayerCall.run
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layer_inputs.LayerCall, "run", lambda call, *args, **kwargs: runs.append(call.index) or run(
            call, *args, **kwargs))
        checkpointed_loss = model(**batch).loss
        checkpointed_loss.backward()
    # each layer of each pass: its node's forward, again in the answer layer's checkpointed recomputation, backward
    assert sorted(runs) == sorted(3 * 2 * list(range(model.base_model.model.config.num_hidden_layers)))
    torch.testing.assert_close(checkpointed_loss, loss)
    expected, got = trainable_grads(plain), trainable_grads(model)
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=0, msg=name)


def test_a_checkpointed_step_runs_under_a_module_tracker(load_base):
    """`FlopCounterMode` (and torch's other module trackers) put multi-grad hooks on every module's inputs; the
    prompt passes' layers, differentiated inside the answer pass's backward, run under them with the same gradients."""
    from torch.utils.flop_counter import FlopCounterMode

    _, batch, _ = make_batch("right")
    grads = []
    for tracked in (False, True):
        model = make_bitune(load_base("llama"))
        compat.enable_checkpointing(model.base_model.model, use_reentrant=False)
        model.train()
        with FlopCounterMode(display=False) if tracked else contextlib.nullcontext():
            model(**batch).loss.backward()
        grads.append(trainable_grads(model))
    assert grads[1].keys() == grads[0].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("heads", ["grouped_query", "multi_head"])
def test_checkpointing_holds_no_mix_across_layers(load_base, monkeypatch, heads):
    """Under activation checkpointing, a single-turn training step never holds the mix of the prompt passes: each
    answer-pass layer computes it where it reads it and its backward computes it again. The prompt passes leave
    nothing but their layer inputs, whatever the model's heads: no pass records keys/values, and the ones the answer
    pass recomputes are not held either."""
    from peft_bitune.tuner import caches, layer_inputs

    inputs, mixes, records = [], [], []
    mix = layer_inputs.mix_key_values

    def spied_mix(causal, bidirectional, alpha):
        mixed = mix(causal, bidirectional, alpha)
        inputs.extend((weakref.ref(causal), weakref.ref(bidirectional)))
        mixes.append(weakref.ref(mixed))
        return mixed

    update = caches.PassCacheLayer.update

    def spied_update(self, key_states, value_states, *args, **kwargs):
        records.append(self.record and not self.stop_after_record)  # not the recomputation's own capture
        return update(self, key_states, value_states, *args, **kwargs)

    monkeypatch.setattr(layer_inputs, "mix_key_values", spied_mix)
    monkeypatch.setattr(caches.PassCacheLayer, "update", spied_update)
    base = load_base("llama") if heads == "grouped_query" else multi_head_base("llama")
    model = make_bitune(base)
    compat.enable_checkpointing(model.base_model.model, use_reentrant=False)
    model.train()
    loss = model(**make_batch("right")[1]).loss
    gc.collect()
    layers = base.config.num_hidden_layers
    assert len(mixes) == 2 * layers  # keys and values of every layer, mixed in the answer pass
    assert [ref() is not None for ref in mixes] == [False] * len(mixes)  # none held
    assert [ref() is not None for ref in inputs] == [False] * len(inputs)  # nor the keys/values mixed
    assert not any(records)
    loss.backward()
    assert len(mixes) == 2 * 2 * layers  # computed again in the backward


def test_reentrant_gradient_checkpointing_is_refused(load_base):
    model = make_bitune(load_base("llama"))
    compat.enable_checkpointing(model.base_model.model, use_reentrant=True)
    model.train()
    _, batch, _ = make_batch("right")
    with pytest.raises(ValueError, match="non-reentrant"):
        model(**batch)


def test_alpha_formula_matches_the_paper(load_base):
    model = make_bitune(load_base("llama"))
    key_alpha, value_alpha = alphas(model)
    coefficients = model.base_model.get_mixing_coefficients()
    torch.testing.assert_close(coefficients["keys"], key_alpha.detach())
    torch.testing.assert_close(coefficients["values"], value_alpha.detach())


def _count_calls(module) -> list[int]:
    """Count `module`'s forward calls without a hook (a forward hook makes the prompt passes run to the end)."""
    calls = [0]
    forward = module.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    module.forward = counted
    return calls


def test_prompt_passes_stop_at_the_last_layers_keys_and_values(load_base):
    # Only the last layer's keys/values of a prompt pass are used: its MLP runs in the answer pass alone, in training
    # and in generation alike.
    model = make_bitune(load_base("llama"))
    last_mlp_calls = _count_calls(model.base_model.model.model.layers[-1].mlp)
    model.train()
    _, batch, _ = make_batch("right")
    model(**batch).loss.backward()
    assert last_mlp_calls[0] == 1

    last_mlp_calls[0] = 0
    prompt = torch.randint(3, VOCAB, (2, 6))
    model.generate(input_ids=prompt, max_new_tokens=1, do_sample=False)
    assert last_mlp_calls[0] == 1  # the last prompt token's step; neither prompt pass reached the MLP


def test_output_capturing_hooks_do_not_keep_prompt_passes_running(load_base):
    # transformers installs (idle) forward hooks the first time hidden states or attentions are asked for.
    model = make_bitune(load_base("llama"))
    with model.base_model.weights("causal"):
        model.base_model.model(input_ids=torch.randint(3, VOCAB, (1, 4)), output_hidden_states=True)
    assert any(len(m._forward_hooks) for m in model.modules())
    last_mlp_calls = _count_calls(model.base_model.model.model.layers[-1].mlp)
    model(**make_batch("right")[1])
    assert last_mlp_calls[0] == 1


def test_forward_hooks_see_every_pass_run_to_its_end(load_base):
    # FSDP2 and DeepSpeed ZeRO-3 work through forward hooks, and so may the user: none of them is skipped.
    expected = make_bitune(load_base("llama"))(**make_batch("right")[1]).loss
    model = make_bitune(load_base("llama"))
    outputs = []
    model.base_model.model.model.layers[-1].register_forward_hook(lambda module, args, output: outputs.append(output))
    loss = model(**make_batch("right")[1]).loss
    assert len(outputs) == 3
    torch.testing.assert_close(loss, expected)


def test_a_hook_on_the_final_norm_sees_every_pass(load_base):
    # The final norm is never reached by a stopped pass: a hook there keeps the passes running to the end.
    model = make_bitune(load_base("llama"))
    calls = []
    model.base_model.model.model.norm.register_forward_hook(lambda *_: calls.append(1))
    model(**make_batch("right")[1])
    assert len(calls) == 3


def test_hooks_on_earlier_layers_leave_the_prompt_pass_end_on(load_base):
    # Earlier layers finish before a pass stops, so their hooks see all three passes anyway.
    model = make_bitune(load_base("llama"))
    calls = []
    model.base_model.model.model.layers[0].register_forward_hook(lambda *_: calls.append(1))
    last_mlp_calls = _count_calls(model.base_model.model.model.layers[-1].mlp)
    model(**make_batch("right")[1])
    assert len(calls) == 3 and last_mlp_calls[0] == 1


def test_prompt_passes_run_to_the_end_with_accelerate_offloading(load_base):
    # accelerate puts offloaded weights back after a module's forward: a pass stopped inside the layer would skip that.
    from accelerate import cpu_offload

    expected = make_bitune(load_base("llama"))(**make_batch("right")[1]).loss
    model = make_bitune(load_base("llama"))
    cpu_offload(model.base_model.model, execution_device="cpu")
    last_mlp_calls = _count_calls(model.base_model.model.model.layers[-1].mlp)
    loss = model(**make_batch("right")[1]).loss
    assert last_mlp_calls[0] == 3
    torch.testing.assert_close(loss, expected)
