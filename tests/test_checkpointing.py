"""A checkpointed Bitune step against the same step without checkpointing: the same random draws, the same autocast
gradients, no gradient where the plain step gives none, and a second backward through the same graph.

The plain step records the prompt passes' keys/values; the checkpointed one runs their layers without autograd and
recomputes them layer by layer (`tuner/layer_inputs.py`). Both must give the same loss and gradients, bit for bit up
to float32 summation order (1e-6 on gradients of order 0.1-1), as torch's own checkpointing of a LoRA step does.
"""

from __future__ import annotations

import functools

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from peft_bitune import compat
from reference import make_bitune, padded_batch
from tiny_models import VOCAB, model_configs


def tiny_llama(layers: int = 2, multi_head: bool = False):
    """The tiny random Llama with `layers` decoder layers; `multi_head`: as many key/value heads as query heads."""
    config = model_configs()["llama"]
    config.num_hidden_layers = layers
    if multi_head:
        config.num_key_value_heads = config.num_attention_heads
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def bitune_step(checkpointing: bool, base, adapter_config=None, seed: int = 1, autocast: bool = False,
                **config_kwargs):
    """One training step from the random seed `seed`: (loss, {name: grad or None} of the trainable parameters, the
    next number the CPU generator draws after the step)."""
    model = make_bitune(base(), adapter_config, **config_kwargs)
    if checkpointing:
        compat.enable_checkpointing(model.base_model.model, use_reentrant=False)
    model.train()
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**padded_batch("right", VOCAB)[1]).loss
    loss.backward()
    grads = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()
             if p.requires_grad}
    return loss.detach(), grads, torch.rand(1)


def assert_same_step(got, expected) -> None:
    (loss, grads, _), (expected_loss, expected_grads, _) = got, expected
    torch.testing.assert_close(loss, expected_loss, atol=1e-6, rtol=0)
    assert grads.keys() == expected_grads.keys()
    assert [name for name, grad in grads.items() if grad is None] == [
        name for name, grad in expected_grads.items() if grad is None
    ]
    for name, grad in grads.items():
        if grad is not None:
            torch.testing.assert_close(grad, expected_grads[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize(("layers", "multi_head"), [(2, False), (2, True), (3, False)])
def test_a_checkpointed_step_draws_the_dropout_masks_of_the_plain_step(layers, multi_head):
    """With dropout in both weight sets, from one seed: the same masks, so the same loss and gradients, and the random
    generator left where the plain step leaves it (the next step draws the same masks too). The plain step ends each
    prompt pass at its last layer's keys/values; the checkpointed step's prompt passes draw exactly what those draw,
    and every recomputation replays the state its layer first drew from."""
    adapter_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                                lora_dropout=0.2)
    base = lambda: tiny_llama(layers, multi_head)  # noqa: E731
    plain = bitune_step(False, base, adapter_config)
    checkpointed = bitune_step(True, base, adapter_config)
    assert_same_step(checkpointed, plain)
    assert torch.equal(checkpointed[2], plain[2])
    # Another seed draws other masks: the dropout is in the step.
    assert not torch.allclose(bitune_step(True, base, adapter_config, seed=2)[0], checkpointed[0])


@pytest.mark.parametrize("mode", ["alternating", "history"])
def test_a_checkpointed_multi_turn_step_draws_the_dropout_masks_of_the_plain_step(mode):
    """Multi-turn rows: the earlier turns' prompt passes record their keys/values (every later pass reads them), and
    under checkpointing too they end at the last layer's keys/values, as without (that layer runs without its
    checkpoint there), so the step draws the plain step's masks."""
    from test_multi_turn import make_conversations

    adapter_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                                lora_dropout=0.2)
    batch = make_conversations("right")[1]
    steps = []
    for checkpointing in (False, True):
        model = make_bitune(tiny_llama(2), adapter_config, multi_turn=mode)
        if checkpointing:
            compat.enable_checkpointing(model.base_model.model, use_reentrant=False)
        model.train()
        torch.manual_seed(1)
        loss = model(**batch).loss
        loss.backward()
        grads = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()
                 if p.requires_grad}
        steps.append((loss.detach(), grads, torch.rand(1)))
    assert_same_step(steps[1], steps[0])
    assert torch.equal(steps[1][2], steps[0][2])


@pytest.mark.parametrize("multi_head", [False, True])
def test_a_checkpointed_step_under_cpu_autocast_gives_the_plain_steps_gradients(multi_head):
    """Under `torch.autocast("cpu", dtype=torch.bfloat16)` (what the trainer's `bf16=True` runs the forward under):
    the gradients of the causal weights, which both the causal prompt pass and the answer pass use, reach the float32
    weights pass by pass in both steps (they differed by 2.4e-4 when the plain step summed them in bf16)."""
    base = lambda: tiny_llama(2, multi_head)  # noqa: E731
    assert_same_step(bitune_step(True, base, autocast=True), bitune_step(False, base, autocast=True))


def test_parameters_outside_the_graph_get_no_gradient_under_checkpointing():
    """Mixing only layer 1 of 3, with a causal second pass and fixed mixing: layer 1's bidirectional query, output and
    MLP weights feed only layer 2's bidirectional keys/values, which nothing reads. The plain step gives them no
    gradient, and so must the checkpointed one (zeros would let weight decay move them in one run only)."""
    base = lambda: tiny_llama(3)  # noqa: E731
    settings = dict(mixed_layers=[1], second_pass_attention="causal", train_mixing=False)
    plain = bitune_step(False, base, **settings)
    untouched = {name for name, grad in plain[1].items() if grad is None}
    # Layer 1's bidirectional weights but its key/value projections, and all of layer 2's.
    expected = {name for name in plain[1] if "__bidirectional" in name and (
        "layers.2." in name or ("layers.1." in name and not any(kv in name for kv in (".k_proj.", ".v_proj."))))}
    assert untouched == expected and len(expected) == 2 * (5 + 7)
    assert_same_step(bitune_step(True, base, **settings), plain)


@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
def test_a_second_backward_under_checkpointing_equals_the_plain_steps(how):
    """`loss.backward(retain_graph=True)` twice (or `torch.autograd.grad` with `retain_graph=True`, then again):
    every checkpointed layer is recomputed a second time, routed to its pass's weights again."""
    results = []
    for checkpointing in (False, True):
        model = make_bitune(tiny_llama(2))
        if checkpointing:
            compat.enable_checkpointing(model.base_model.model, use_reentrant=False)
        model.train()
        loss = model(**padded_batch("right", VOCAB)[1]).loss
        params = [p for p in model.parameters() if p.requires_grad]
        if how == "backward":
            loss.backward(retain_graph=True)
            first = [None if p.grad is None else p.grad.clone() for p in params]
            loss.backward()
            second = [None if g is None else p.grad - g for p, g in zip(params, first)]
        else:
            first = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            second = torch.autograd.grad(loss, params, allow_unused=True)
        results.append((first, second))
    (plain_first, plain_second), (first, second) = results
    for got, want in zip([*first, *second], [*plain_first, *plain_second]):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def count_calls(function_owner, name: str) -> list[int]:
    """Count the calls of `function_owner.<name>` (replaced on the instance, a `functools.partial` by a partial with
    the same keywords; no hook, which would keep the prompt passes from ending early)."""
    calls = [0]
    function = getattr(function_owner, name)
    keywords = getattr(function, "keywords", None)

    def counted(*args, **kwargs):
        calls[0] += 1
        return function(*args, **kwargs)

    setattr(function_owner, name, counted if keywords is None else functools.partial(counted, **keywords))
    return calls


def test_a_checkpointed_steps_prompt_passes_end_where_the_plain_steps_do():
    """Each prompt pass ends at its last layer's keys/values, as without checkpointing: the last layer's MLP runs in
    the answer pass alone. No prompt-pass layer runs inside torch's checkpoint (only the answer pass's layers do):
    leaving a checkpointed layer by an exception would leave its recomputation state to the garbage collector."""
    model = make_bitune(tiny_llama(2))
    compat.enable_checkpointing(model.base_model.model, use_reentrant=False)
    layers = model.base_model.model.model.layers
    mlp_calls = count_calls(layers[-1].mlp, "forward")
    checkpoints = [count_calls(layer, "_gradient_checkpointing_func") for layer in layers]
    model.train()
    loss = model(**padded_batch("right", VOCAB)[1]).loss
    assert mlp_calls[0] == 1
    assert [calls[0] for calls in checkpoints] == [1] * len(layers)
    loss.backward()
