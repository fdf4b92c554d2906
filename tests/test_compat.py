"""The transformers renames (`past_key_values` -> `cache`, gradient -> activation checkpointing): the project uses the
installed release's names (peft_bitune/compat.py), keeps working once `past_key_values` is gone, and causes no
deprecation warnings of its own."""

from __future__ import annotations

import dataclasses
import inspect

import datasets
import pytest
import torch
from torch import nn
from transformers import DynamicCache, TrainingArguments

import trl_helpers as helpers
from compat_helpers import from_project, needs_cache_name, only_cache_argument, renamed_name_warnings
from peft_bitune import compat
from reference import left_padded, make_bitune
from tiny_models import VOCAB
from trl_integration import BituneSFTConfig, BituneSFTTrainer

GREEDY = dict(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)


def training_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded rows of random tokens: prompts of 1, 4 and 6 tokens, then answers of 3, 2 and 4."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [(1, 3), (4, 2), (6, 4)]
    width = max(p + a for p, a in lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask, labels = torch.zeros_like(input_ids), torch.full_like(input_ids, -100)
    for i, (p, a) in enumerate(lengths):
        input_ids[i, : p + a] = torch.randint(3, VOCAB, (p + a,), generator=generator)
        attention_mask[i, : p + a] = 1
        labels[i, p : p + a] = input_ids[i, p : p + a]
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def run_everything(model) -> dict[str, object]:
    """A training step (with and without activation checkpointing), `generate`, a chat continuation, `prefill` and a
    forward over the prefilled cache; returns what each produced."""
    results = {}
    batch = training_batch()
    model.train()
    for checkpointing in (False, True):
        if checkpointing:
            compat.enable_checkpointing(model.base_model.model, use_reentrant=False)
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        results[f"loss, checkpointing={checkpointing}"] = loss.detach()
        results[f"gradients, checkpointing={checkpointing}"] = [
            p.grad.clone() for p in model.parameters() if p.grad is not None
        ]
    model.eval()
    generator = torch.Generator().manual_seed(1)
    prompts = left_padded([torch.randint(3, VOCAB, (n,), generator=generator) for n in (5, 2)])
    first = model.generate(**prompts, **GREEDY)
    results["generate"] = first.sequences
    new = torch.randint(3, VOCAB, (2, 3), generator=generator)
    conversation = torch.cat([first.sequences, new], dim=1)
    answered = torch.ones(2, conversation.shape[1] - prompts["input_ids"].shape[1], dtype=torch.long)
    attention_mask = torch.cat([prompts["attention_mask"], answered], dim=1)
    second = model.generate(
        input_ids=conversation, attention_mask=attention_mask, cache=compat.output_cache(first), **GREEDY
    )
    results["chat continuation"] = second.sequences
    cache = model.base_model.prefill(**prompts)
    results["prefill"] = [layer.keys.clone() for layer in cache.layers]
    with torch.no_grad():
        results["forward over the prefill"] = model(
            input_ids=prompts["input_ids"][:, -1:], attention_mask=prompts["attention_mask"], cache=cache
        ).logits
    return results


# ---------------------------------------------------------------------- the names
def test_names_are_those_of_the_installed_release(load_base):
    model = load_base("llama")
    for module in (model, model.get_decoder()):
        assert compat.cache_argument(module) in inspect.signature(type(module).forward).parameters
    assert compat.cache_argument(model) == compat.CACHE_NAME
    output = model(input_ids=torch.tensor([[3, 4, 5]]), use_cache=True)
    assert compat.CACHE_NAME in output.keys() and isinstance(compat.output_cache(output), DynamicCache)
    assert compat.CHECKPOINTING_ARGUMENT in {field.name for field in dataclasses.fields(TrainingArguments)}
    assert callable(getattr(model, compat.CHECKPOINTING_ENABLE))
    compat.enable_checkpointing(model, use_reentrant=False)
    assert model.model.layers[0].gradient_checkpointing


def test_a_model_gets_the_cache_name_its_forward_takes():
    """A model written for another release (remote code) keeps its own name; one taking `**kwargs`, the release's."""

    class Old(nn.Module):
        def forward(self, input_ids, past_key_values=None): ...

    class New(nn.Module):
        def forward(self, input_ids, cache=None): ...

    class Open(nn.Module):
        def forward(self, input_ids, **kwargs): ...

    assert compat.cache_argument(Old()) == "past_key_values"
    assert compat.cache_argument(New()) == "cache"
    assert compat.cache_argument(Open()) == compat.CACHE_NAME
    assert compat.with_cache(Old(), "c") == {"past_key_values": "c"}


def test_bitune_calls_take_the_cache_under_either_name_but_once(load_base):
    model = make_bitune(load_base("llama")).eval()
    prompts = left_padded([torch.tensor([5, 6, 7, 8])])
    first = model.generate(**prompts, **GREEDY)
    conversation = torch.cat([first.sequences, torch.tensor([[9, 10]])], dim=1)
    by_name = {
        name: model.generate(
            input_ids=conversation,
            **{name: compat.output_cache(model.generate(**prompts, **GREEDY))},
            **GREEDY,
        ).sequences
        for name in ("cache", "past_key_values")
    }
    assert torch.equal(by_name["cache"], by_name["past_key_values"])
    for name in ("cache", "past_key_values"):
        kwargs = {name: "the cache", "max_new_tokens": 1}
        assert compat.pop_cache(kwargs) == "the cache" and kwargs == {"max_new_tokens": 1}
    with pytest.raises(ValueError, match="once"):
        model.generate(input_ids=conversation, cache=DynamicCache(), past_key_values=DynamicCache(), **GREEDY)
    with pytest.raises(ValueError, match="once"):
        model(input_ids=conversation, cache=DynamicCache(), past_key_values=DynamicCache())


# ---------------------------------------------------------------------- `past_key_values` removed (transformers 5.40)
@needs_cache_name
@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: sliding-window layers in the generation cache
def test_everything_works_once_past_key_values_is_removed(arch, load_base):
    model = make_bitune(load_base(arch))
    expected = run_everything(model)
    model = make_bitune(load_base(arch))  # the same weights (seeded), checkpointing off again
    with only_cache_argument(model) as replaced:
        assert replaced >= 3  # the language model's and its decoder's forward, and `generate`
        with pytest.raises(TypeError, match="past_key_values"):  # the simulation refuses the old name
            model.base_model.model(input_ids=torch.tensor([[3, 4]]), past_key_values=DynamicCache())
        actual = run_everything(model)
    assert actual.keys() == expected.keys()
    for what in expected:
        torch.testing.assert_close(actual[what], expected[what], rtol=0, atol=0, msg=what)


# ---------------------------------------------------------------------- no deprecation warnings of the project's own
def test_training_generation_chat_and_prefill_cause_no_deprecation_warnings(load_base):
    model = make_bitune(load_base("llama"))
    with renamed_name_warnings() as recorded:
        run_everything(model)
    assert from_project(recorded) == []


def test_bitune_sft_trainer_causes_no_deprecation_warnings(tmp_path):
    model_dir = helpers.save_model_and_tokenizer(tmp_path / "model")
    with renamed_name_warnings() as recorded:
        args = BituneSFTConfig(  # TRL's default, activation checkpointing on, under its current name
            output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, bf16=False, use_cpu=True,
            report_to=[], save_strategy="no", disable_tqdm=True,
        )
        from_config = list(recorded)
        trainer = BituneSFTTrainer(
            model=model_dir, args=args, train_dataset=datasets.Dataset.from_list(helpers.prompt_completion_rows(8)),
            processing_class=helpers.build_tokenizer(), peft_config=helpers.small_bitune_config(),
        )
        trainer.train()
    assert getattr(args, compat.CHECKPOINTING_ARGUMENT) is True
    assert from_config == []
    assert from_project(recorded) == []
