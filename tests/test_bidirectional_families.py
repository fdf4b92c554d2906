"""Every family Bitune accepts runs its bidirectional prompt pass bidirectionally (an earlier position's keys change
when a later prompt token does), and the families on which it would run causally, or would fail at the first
forward, are refused at `get_peft_model`, before any weights are created."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, DynamicCache

from peft_bitune import BituneConfig, compat
from reference import make_bitune
from tiny_models import ATTENTION_CASES, VOCAB, causal_only_configs, eager_only_configs, unsupported_configs

PROMPT = 7  # the prefill caches the first 6 positions; the last of them is the one changed


def prompts(padded: bool) -> tuple[dict, dict]:
    """Two batches of two prompts that differ only in the last token the prefill caches (column PROMPT - 2), with
    no padding (where transformers may skip the mask altogether) or with the first row left-padded by 2."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, VOCAB, (2, PROMPT), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    if padded:
        input_ids[0, :2], attention_mask[0, :2] = 0, 0
    changed = input_ids.clone()
    changed[:, PROMPT - 2] = (changed[:, PROMPT - 2] - 3 + 1) % (VOCAB - 3) + 3
    return dict(input_ids=input_ids, attention_mask=attention_mask), dict(input_ids=changed,
                                                                          attention_mask=attention_mask)


def earlier_keys(cache) -> torch.Tensor:
    """The last layer's keys at the position before the changed one (a real token of every row): the cache's
    last-but-one column, also where a sliding or chunked layer keeps only its last few positions. Under layer 0
    every key depends on its own token only."""
    return cache.layers[-1].keys[..., -2, :]


def first_keys(model, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return earlier_keys(model.prefill(**batch))


def differ(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Changed beyond float32 rounding: a mixture of experts batches its tokens by expert, so a changed token can move
    the others' products by a rounding error (~1e-7) without any attention to it."""
    return float((first - second).abs().max()) > 1e-4


def sees_later_tokens(model, padded: bool) -> bool:
    """Whether the mixed keys of an earlier position change when a later prompt token does: through the
    bidirectional pass only (the causal pass cannot see it), as the mixing scalars are non-zero on every layer."""
    batch, changed = prompts(padded)
    return differ(first_keys(model, batch), first_keys(model, changed))


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize(("arch", "attn_implementation"), ATTENTION_CASES)
def test_the_bidirectional_pass_sees_later_tokens_on_every_family(load_base, arch, attn_implementation, padded):
    model = make_bitune(load_base(arch, attn_implementation)).eval()
    assert sees_later_tokens(model, padded), f"{arch} ({attn_implementation}): the bidirectional pass runs causally"
    # The check can fail: with both passes causal, the earlier keys stay as they were.
    causal = make_bitune(load_base(arch, attn_implementation), second_pass_attention="causal").eval()
    assert not sees_later_tokens(causal, padded)


@pytest.mark.parametrize("name", sorted(eager_only_configs()))
def test_families_whose_eager_attention_reads_is_causal_are_accepted_with_it(name):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(eager_only_configs()[name], attn_implementation="eager").eval()
    model = make_bitune(base).eval()
    for padded in (False, True):
        assert sees_later_tokens(model, padded), name


@pytest.mark.parametrize("name", sorted(eager_only_configs()))
def test_switching_such_a_family_to_sdpa_after_the_adapter_is_made_is_refused_at_the_next_prompt_pass(name):
    """Accepted with eager attention, then `set_attn_implementation("sdpa")`: its bidirectional pass would run causally
    (silently, before), so the next forward, prefill or generate refuses it before any compute; eager again runs."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(eager_only_configs()[name], attn_implementation="eager").eval()
    model = make_bitune(base).eval()
    batch, _ = prompts(padded=False)
    labels = batch["input_ids"].masked_fill(torch.arange(PROMPT) < PROMPT - 2, -100)
    base.set_attn_implementation("sdpa")
    refused = r"cannot run .* with `attn_implementation='sdpa'`.*bidirectional prompt pass causally"
    calls = {"forward": lambda: model(**batch, labels=labels), "prefill": lambda: model.prefill(**batch),
             "generate": lambda: model.generate(**batch, max_new_tokens=2)}
    for call in calls.values():
        with pytest.raises(ValueError, match=refused):
            call()
    base.set_attn_implementation("eager")
    assert sees_later_tokens(model, padded=False), name
    # A causal second pass asks nothing of the attention: it runs with sdpa.
    causal = make_bitune(AutoModelForCausalLM.from_config(eager_only_configs()[name]), second_pass_attention="causal")
    causal.get_base_model().set_attn_implementation("sdpa")
    causal.eval().prefill(**batch)


def runs_causally_whatever_is_asked(base) -> bool:
    """transformers' own decoder, asked for `is_causal=False`: an earlier position's keys (last layer) do not change
    when a later token does. What the refusal rests on: once a release fixes a family, this fails for it."""
    batch, changed = prompts(padded=False)
    keys = []
    for inputs in (batch, changed):
        inputs = {name: tensor[:, :-1] for name, tensor in inputs.items()}  # what the prefill reads
        cache = DynamicCache(config=base.config)
        with torch.no_grad():
            decoder = base.get_decoder()
            decoder(**inputs, **compat.with_cache(decoder, cache), use_cache=True, is_causal=False)
        keys.append(earlier_keys(cache))
    return not differ(*keys)


@pytest.mark.parametrize("name", sorted(causal_only_configs()))
def test_families_whose_bidirectional_pass_would_run_causally_are_refused(name):
    config, attn_implementation = causal_only_configs()[name]
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()
    assert runs_causally_whatever_is_asked(base), f"{name} now reads is_causal=False: lift its refusal"
    adapter = LoraConfig(r=4, target_modules="all-linear")
    with pytest.raises(ValueError, match=r"run its bidirectional prompt pass causally\. .*second_pass_attention="):
        get_peft_model(base, BituneConfig(adapter_config=adapter))
    assert not any("lora_" in n for n, _ in base.named_parameters()), "weights were created before the refusal"
    # With a causal second pass nothing is asked of the attention: accepted.
    get_peft_model(base, BituneConfig(adapter_config=adapter, second_pass_attention="causal"))


REFUSALS = {
    "xlstm": "recurrent model whose cache is its own recurrent state",
    "rwkv": "recurrent model whose cache is its own recurrent state",
    "modernbert_decoder": r"`get_decoder\(\)` returns a Linear, not the decoder stack",
    # Before: accepted with a causal second pass, then `IndexError` at the first prefill.
    "gpt_neox_japanese": "decoder layers are not transformers' `GradientCheckpointingLayer`s",
}


@pytest.mark.parametrize("name", sorted(unsupported_configs()))
def test_families_that_fail_at_the_first_forward_are_refused_at_get_peft_model(name):
    """Before, xLSTM failed at the first forward with `AttributeError ... 'rnn_state'`, RWKV with a `RuntimeError`,
    ModernBERT-decoder with `Linear.forward() got an unexpected keyword argument 'cache'`."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(unsupported_configs()[name])
    for second_pass_attention in ("bidirectional", "causal"):
        with pytest.raises(ValueError, match=f"Bitune cannot tune {type(base).__name__}: .*{REFUSALS[name]}"):
            get_peft_model(base, BituneConfig(adapter_config=LoraConfig(r=4, target_modules="all-linear"),
                                              second_pass_attention=second_pass_attention))
    assert not any("lora_" in n for n, _ in base.named_parameters()), "weights were created before the refusal"
