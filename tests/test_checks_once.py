"""Each rule about what a Bitune model is given is checked once, where the input enters, with one message wherever
it applies (issue 48): a training forward, a fresh `prefill`/`generate`, a continued chat and the attention maps
refuse the same fault in the same words, and no check runs twice on one input."""

from __future__ import annotations

import sys

import pytest
import torch

from peft_bitune.tuner import checks
from peft_bitune.visualize import attention_maps
from reference import make_bitune
from tiny_models import VOCAB

EMPTY_ROW = r"Rows \[1\] are empty \(`attention_mask` all 0\): every row needs at least one token\."
HOLED_ROW = r"Rows \[1\] have padding between real tokens: Bitune reads each row's real tokens as one run"


@pytest.fixture
def model(load_base):
    return make_bitune(load_base("llama")).eval()


def ids(rows: int = 2, width: int = 6) -> torch.Tensor:
    return torch.randint(3, VOCAB, (rows, width), generator=torch.Generator().manual_seed(0))


def training_call(model, mask):
    input_ids = ids()
    labels = input_ids.masked_fill(torch.arange(6) < 3, -100)
    return lambda: model(input_ids=input_ids, attention_mask=mask, labels=labels)


def prefill_call(model, mask):
    return lambda: model.prefill(ids(), attention_mask=mask)


def generate_call(model, mask):
    return lambda: model.generate(input_ids=ids(), attention_mask=mask, max_new_tokens=2, do_sample=False)


def attention_maps_call(model, mask):
    return lambda: attention_maps(model, ids(), attention_mask=mask)


ENTRIES = [training_call, prefill_call, generate_call, attention_maps_call]


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda entry: entry.__name__)
def test_an_empty_row_is_refused_in_one_wording_everywhere(model, entry):
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1] = 0
    with pytest.raises(ValueError, match=EMPTY_ROW):
        entry(model, mask)()


@pytest.mark.parametrize("entry", [training_call, attention_maps_call], ids=lambda entry: entry.__name__)
def test_padding_between_real_tokens_is_refused_in_one_wording_where_a_row_is_one_run(model, entry):
    """A training row and the attention maps lay out each row's real tokens as one run; `prefill` and `generate` read
    a hole as transformers does (`tests/test_generate.py`)."""
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 2] = 0
    with pytest.raises(ValueError, match=HOLED_ROW):
        entry(model, mask)()


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda entry: entry.__name__)
def test_a_mask_of_another_shape_is_refused_in_one_wording_everywhere(model, entry):
    with pytest.raises(ValueError, match=r"`attention_mask` has shape \(2, 5\) but the input has shape \(2, 6\)"):
        entry(model, torch.ones(2, 5, dtype=torch.long))()


def test_a_mask_of_another_shape_is_named_before_position_ids_are_read(model):
    """The shape of every per-token tensor is checked before any of them is used: a mis-shaped mask given with
    `position_ids` used to be reported as a `position_ids` error."""
    input_ids = ids()
    with pytest.raises(ValueError, match="`attention_mask` has shape"):
        model(input_ids=input_ids, attention_mask=torch.ones(2, 5, dtype=torch.long), labels=input_ids,
              position_ids=torch.arange(6)[None].expand(2, -1))


COUNTED = ("check_token_ids", "attention_mask_for", "check_same_shape", "check_contiguous_rows",
           "check_ends_with_real_tokens", "check_fits_positions")


@pytest.fixture
def counted_checks(monkeypatch):
    """How often each rule of `checks.py` runs, wherever the method calls it from (every module of the method that
    holds the function is patched)."""
    counts = {}
    for name in COUNTED:
        original = getattr(checks, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)

        for module_name, module in list(sys.modules.items()):
            if module_name.startswith("peft_bitune.tuner") and getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, counted)
    return counts


def test_a_fresh_generate_checks_each_rule_once(model, counted_checks):
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    model.generate(input_ids=ids(), attention_mask=mask, max_new_tokens=2, do_sample=False)
    # `attention_mask_for` is the mask's one shape check: `check_same_shape` runs inside it. A prompt need not be one
    # run of real tokens (a hole is read as transformers reads it), so `check_contiguous_rows` does not run.
    assert counted_checks == {name: 1 for name in COUNTED if name != "check_contiguous_rows"}


def test_a_continued_chat_checks_each_rule_once(model, counted_checks):
    first = model.generate(input_ids=ids(), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    counted_checks.clear()
    conversation = torch.cat([first.sequences, ids(2, 3)], dim=1)
    model.generate(input_ids=conversation, cache=first.cache, max_new_tokens=2, do_sample=False)
    # No rows to check for emptiness or holes: the conversation's rows are the cache's (`check_continuation`).
    assert counted_checks == {name: 1 for name in COUNTED if name != "check_contiguous_rows"}


def test_a_training_forward_checks_each_rule_once(model, counted_checks):
    input_ids = ids()
    labels = input_ids.masked_fill(torch.arange(6) < 3, -100)
    model.train()(input_ids=input_ids, attention_mask=torch.ones(2, 6, dtype=torch.long), labels=labels,
                  position_ids=torch.arange(6)[None].expand(2, -1))
    # Each of `attention_mask` and `labels` gets its shape check; a row's length is checked against the positions only
    # when the batch is wider than the model's positions.
    assert counted_checks == {"check_same_shape": 2, "check_contiguous_rows": 1}


def test_the_position_limit_and_the_sliding_windows_are_read_once_per_model(model, monkeypatch):
    """Reading either builds a transformers cache from the config (to see which layers slide): once per model, not on
    every forward and `generate`."""
    from peft_bitune.tuner import model as tuner_module

    calls = []
    for name in ("max_positions", "has_sliding_window_layers"):
        original = getattr(tuner_module, name)
        monkeypatch.setattr(tuner_module, name, lambda base, _original=original: calls.append(base) or _original(base))
    bitune = model.base_model
    bitune.__dict__.pop("_position_limit_of", None)
    bitune.__dict__.pop("_sliding_window_of", None)
    input_ids = ids()
    labels = input_ids.masked_fill(torch.arange(6) < 3, -100)
    for _ in range(2):
        model.train()(input_ids=input_ids, labels=labels)
        model.eval().generate(input_ids=input_ids, max_new_tokens=2, do_sample=False)
    assert calls == [bitune.model, bitune.model.config]
