"""Ways of going on from a prompt that must either equal `generate` or be refused before any work: a forward over a
`prefill` cache, a conversation whose history loses a token, `prefill` with the adapters disabled, and transformers'
continuous batching, which would run the base model."""

from __future__ import annotations

import pytest
import torch

from peft_bitune import compat
from reference import left_padded, make_bitune
from tiny_models import VOCAB

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_scores=True)


def prompts(lengths=(6, 3, 5)) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    return left_padded([torch.randint(3, VOCAB, (n,), generator=generator) for n in lengths])


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_forward_over_a_left_padded_prefill_is_the_first_decoding_step_of_generate(load_base, arch):
    """Without `position_ids`, the positions come from the attention mask, as `generate` computes them: the padded
    rows' logits equal `generate`'s first scores (before: 5.2 apart on the padded rows)."""
    model = make_bitune(load_base(arch)).eval()
    batch = prompts()
    expected = model.generate(**batch, max_new_tokens=1, **GREEDY).scores[0]
    cache = model.base_model.prefill(**batch)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"][:, -1:], attention_mask=batch["attention_mask"],
                       cache=cache).logits
    torch.testing.assert_close(logits[:, -1], expected, rtol=0, atol=1e-5)


def test_a_forward_over_a_padded_prefill_without_attention_mask_is_refused(load_base):
    model = make_bitune(load_base("llama")).eval()
    batch = prompts()
    cache = model.base_model.prefill(**batch)
    with pytest.raises(ValueError, match="attention_mask"):
        model(input_ids=batch["input_ids"][:, -1:], cache=cache)


def test_a_forward_over_an_unpadded_prefill_needs_no_attention_mask(load_base):
    model = make_bitune(load_base("llama")).eval()
    batch = prompts(lengths=(5, 5))
    expected = model.generate(**batch, max_new_tokens=1, **GREEDY).scores[0]
    cache = model.base_model.prefill(**batch)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"][:, -1:], cache=cache).logits
    torch.testing.assert_close(logits[:, -1], expected, rtol=0, atol=1e-5)


def a_first_turn_and_the_next(load_base):
    """A model, the width of its first prompts, the output of their first turn and the conversation that continues it
    with a new instruction."""
    model = make_bitune(load_base("llama")).eval()
    batch = prompts(lengths=(6, 6))
    first = model.generate(**batch, max_new_tokens=3, **GREEDY)
    new = torch.randint(3, VOCAB, (2, 3), generator=torch.Generator().manual_seed(5))
    return model, batch["input_ids"].shape[1], first, torch.cat([first.sequences, new], dim=1)


@pytest.mark.parametrize("where", ["prompt", "answer"])
def test_a_conversation_that_drops_an_earlier_real_token_is_refused(load_base, where):
    """The cached keys/values after a token were computed with it in view: the history cannot read as if it were
    absent (before: an answer that matched neither the conversation with the token nor without it)."""
    model, prompt_width, first, conversation = a_first_turn_and_the_next(load_base)
    mask = torch.ones_like(conversation)
    mask[1, 2 if where == "prompt" else prompt_width + 1] = 0
    with pytest.raises(ValueError, match="drops column"):
        model.generate(input_ids=conversation, attention_mask=mask, cache=compat.output_cache(first),
                       max_new_tokens=2, **GREEDY)


def test_padding_after_an_answer_that_ended_may_still_be_dropped(load_base):
    """What may be dropped: the end of a row's history (e.g. the padding `generate` feeds a finished row), which no
    later cached token has seen."""
    model, _, first, conversation = a_first_turn_and_the_next(load_base)
    mask = torch.ones_like(conversation)
    mask[1, first.sequences.shape[1] - 2 : first.sequences.shape[1]] = 0
    output = model.generate(input_ids=conversation, attention_mask=mask, cache=compat.output_cache(first),
                            max_new_tokens=2, **GREEDY)
    assert output.sequences.shape == (2, conversation.shape[1] + 2)


def test_prefill_with_the_adapters_disabled_is_refused(load_base):
    """Inside `disable_adapter()` the model is the base model; `prefill` would mix two base-model passes with the
    adapter's coefficients, a cache of neither (before: returned, 2.68 from the base model's keys)."""
    model = make_bitune(load_base("llama")).eval()
    with model.disable_adapter(), pytest.raises(ValueError, match="disable_adapter"):
        model.base_model.prefill(**prompts())


CONTINUOUS_BATCHING = ("generate_batch", "init_continuous_batching", "continuous_batching_context_manager")


def refuse_reaching(*args, **kwargs):
    pytest.fail("the base model's continuous batching ran")


@pytest.mark.parametrize("entry", CONTINUOUS_BATCHING)
def test_transformers_continuous_batching_is_refused(load_base, monkeypatch, entry):
    """PEFT hands attributes it lacks to the inner model, whose continuous batching would run the base model with no
    Bitune prefill, without a word. The inner model's entry points are replaced, so reaching them fails the test
    rather than starting a paged cache."""
    model = make_bitune(load_base("llama")).eval()
    inner = model.base_model.model
    for name in CONTINUOUS_BATCHING:
        monkeypatch.setattr(inner, name, refuse_reaching)
    with pytest.raises(ValueError, match=r"continuous batching.*`generate`"):
        getattr(model, entry)([[5, 6, 7]])


def test_a_paged_cache_in_generate_is_refused(load_base, monkeypatch):
    model = make_bitune(load_base("llama")).eval()
    monkeypatch.setattr(model.base_model.model, "generate_batch", refuse_reaching)
    with pytest.raises(ValueError, match="paged"):
        model.generate(**prompts(), max_new_tokens=2, cache_implementation="paged", **GREEDY)
