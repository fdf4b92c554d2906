"""Packed rows (TRL's `packing=True`/`padding_free=True`): the same examples packed into one row and padded into a
batch give the same loss, logits and gradients, on the architecture matrix; the boundaries are seen; the refusals."""

from __future__ import annotations

import pytest
import torch

from peft_bitune import compat
from peft_bitune.tuner import packing
from precision import float32_sums
from reference import make_bitune, trainable_grads
from test_forward import multi_head_base
from tiny_models import ATTENTION_CASES, VOCAB

# Each example: (instruction length, answer length) per turn. Single- and multi-turn examples, one-token
# instructions, and examples longer than the tiny models' sliding window (6).
EXAMPLES = [[(3, 2)], [(5, 4), (2, 3)], [(7, 3)], [(1, 2), (4, 2)], [(9, 5)]]
TOLERANCE = float32_sums(1e-5)


def make_examples(turns_of_examples=EXAMPLES, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each example's token ids and labels (-100 on instructions)."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for turns in turns_of_examples:
        ids, supervised = [], []
        for instruction, answer in turns:
            ids += torch.randint(3, VOCAB, (instruction + answer,), generator=generator).tolist()
            supervised += [False] * instruction + [True] * answer
        ids = torch.tensor(ids)
        examples.append((ids, torch.where(torch.tensor(supervised), ids, -100)))
    return examples


def padded(examples) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    batch = dict(input_ids=torch.zeros(len(examples), width, dtype=torch.long))
    batch["attention_mask"] = torch.zeros_like(batch["input_ids"])
    batch["labels"] = torch.full_like(batch["input_ids"], -100)
    for row, (ids, labels) in enumerate(examples):
        batch["input_ids"][row, : len(ids)] = ids
        batch["attention_mask"][row, : len(ids)] = 1
        batch["labels"][row, : len(ids)] = labels
    return batch


def packed(examples) -> dict[str, torch.Tensor]:
    """One row, positions restarting at 0 for each example: what TRL's padding-free collator gives (less its
    boundary arguments, tested on their own below)."""
    return dict(
        input_ids=torch.cat([ids for ids, _ in examples])[None],
        labels=torch.cat([labels for _, labels in examples])[None],
        position_ids=torch.cat([torch.arange(len(ids)) for ids, _ in examples])[None],
    )


def step(model, batch):
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    return out, trainable_grads(model)


def assert_packed_equals_padded(model, examples=None, packed_batch=None):
    examples = examples or make_examples()
    want, want_grads = step(model, padded(examples))
    got, got_grads = step(model, packed_batch or packed(examples))
    TOLERANCE.assert_close(got.loss, want.loss)
    real = padded(examples)["attention_mask"].bool()
    TOLERANCE.assert_close(got.logits[0], want.logits[real])  # each example's logits at its packed positions
    assert got_grads.keys() == want_grads.keys() and got_grads
    for name in want_grads:
        TOLERANCE.assert_close(got_grads[name], want_grads[name], msg=name)
    return got


@pytest.mark.parametrize(("arch", "attn_implementation"), ATTENTION_CASES)
def test_packed_batch_equals_the_padded_batch_on_every_architecture(load_base, arch, attn_implementation):
    model = make_bitune(load_base(arch, attn_implementation))
    model.train()
    assert_packed_equals_padded(model)


@pytest.mark.parametrize("mode", ["alternating", "history"])
@pytest.mark.parametrize(
    ("arch", "attn_implementation"), [("llama", "sdpa"), ("gemma3", "eager"), ("mistral", "sdpa")]
)
def test_packed_multi_turn_examples_keep_their_segments_to_themselves(load_base, arch, attn_implementation, mode):
    model = make_bitune(load_base(arch, attn_implementation), multi_turn=mode)
    model.train()
    assert_packed_equals_padded(model)


@pytest.mark.parametrize("mode", ["alternating", "history"])
@pytest.mark.parametrize(
    ("arch", "attn_implementation"), [("llama", "sdpa"), ("gemma3", "eager"), ("multi-head llama", "eager")]
)
def test_packed_batch_under_checkpointing_equals_the_plain_padded_batch(load_base, arch, attn_implementation, mode):
    """The checkpointed step recomputes the prompt passes layer by layer in the answer pass, with the packed masks."""
    examples = make_examples()
    base = (lambda: multi_head_base("llama")) if arch == "multi-head llama" else (
        lambda: load_base(arch, attn_implementation))
    plain = make_bitune(base(), multi_turn=mode)
    plain.train()
    want, want_grads = step(plain, padded(examples))
    model = make_bitune(base(), multi_turn=mode)
    compat.enable_checkpointing(model.base_model.model, use_reentrant=False)
    model.train()
    got, got_grads = step(model, packed(examples))
    TOLERANCE.assert_close(got.loss, want.loss)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        TOLERANCE.assert_close(got_grads[name], want_grads[name], msg=name)


def test_an_example_that_sees_its_neighbour_changes_the_loss(load_base, monkeypatch):
    """The negative control: the comparison above sees a leak across one boundary."""
    model = make_bitune(load_base("llama", "sdpa"))
    model.train()
    examples = make_examples()
    want = model(**padded(examples))
    for_pass = packing.PackedMask.for_pass

    def merged_first_two(self, *args, **kwargs):
        merge = lambda places: packing.Places(places.examples.clamp(min=1), places.positions)  # noqa: E731
        return for_pass(packing.PackedMask(merge(self.queries), merge(self.keys)), *args, **kwargs)

    monkeypatch.setattr(packing.PackedMask, "for_pass", merged_first_two)
    leaked = model(**packed(examples))
    real = padded(examples)["attention_mask"].bool()
    # Far outside the tolerance the comparisons hold packed batches to.
    assert float((leaked.loss - want.loss).abs()) > 10 * TOLERANCE.atol
    assert float((leaked.logits[0] - want.logits[real]).abs().max()) > 100 * TOLERANCE.atol


def test_trl_padding_free_collator_batches_and_their_boundary_arguments(load_base):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    model = make_bitune(load_base("qwen2", "sdpa"))
    model.train()
    examples = make_examples()
    # Two rows as TRL's "bfd" packing leaves them (`seq_lengths`), flattened by the padding-free collator.
    rows = [
        {"input_ids": torch.cat([ids for ids, _ in part]).tolist(),
         "labels": torch.cat([labels for _, labels in part]).tolist(),
         "seq_lengths": [len(ids) for ids, _ in part]}
        for part in (examples[:3], examples[3:])
    ]
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(rows)
    assert {"cu_seq_lens_q", "max_length_k", "seq_idx", "position_ids"} <= batch.keys()
    assert_packed_equals_padded(model, examples, batch)
    # The boundaries alone (flash attention's arguments, no `position_ids`) say the same.
    without_positions = {name: value for name, value in batch.items() if name != "position_ids"}
    assert_packed_equals_padded(model, examples, without_positions)


def test_packed_rows_of_several_rows_with_padding_and_embeddings(load_base):
    """Packed rows need not be one: two right-padded rows of packed examples, given as embeddings."""
    model = make_bitune(load_base("llama", "eager"))
    model.train()
    examples = make_examples()
    first, second = packed(examples[:2]), packed(examples[2:])
    width = second["input_ids"].shape[1]
    batch = {name: torch.zeros(2, width, dtype=torch.long) for name in ("input_ids", "labels", "position_ids")}
    batch["attention_mask"] = torch.zeros(2, width, dtype=torch.long)
    batch["labels"].fill_(-100)
    for row, part in enumerate((first, second)):
        length = part["input_ids"].shape[1]
        for name in part:
            batch[name][row, :length] = part[name][0]
        batch["attention_mask"][row, :length] = 1
    want, want_grads = step(model, padded(examples))
    batch["inputs_embeds"] = model.get_input_embeddings()(batch.pop("input_ids")).detach()
    got, got_grads = step(model, batch)
    TOLERANCE.assert_close(got.loss, want.loss)
    real = padded(examples)["attention_mask"].bool()
    TOLERANCE.assert_close(got.logits[batch["attention_mask"].bool()], want.logits[real])
    for name in want_grads:
        TOLERANCE.assert_close(got_grads[name], want_grads[name], msg=name)


def test_fused_head_scores_packed_examples_at_their_positions(load_base):
    model = make_bitune(load_base("llama", "sdpa"))
    model.train()
    examples = make_examples()
    want = model(**padded(examples), fused_lm_head=True)
    got = model(**packed(examples), fused_lm_head=True)
    TOLERANCE.assert_close(got.loss, want.loss)
    # TRL's (batch, seq - 1) layout: position t scores token t + 1; the last token of each example scores nothing.
    real = padded(examples)["attention_mask"].bool()
    want_per_token = torch.cat([want.log_probs, torch.zeros(len(examples), 1)], dim=1)[real]
    got_per_token = torch.cat([got.log_probs[0], torch.zeros(1)])
    TOLERANCE.assert_close(got_per_token, want_per_token)


def test_packed_examples_may_fill_a_row_longer_than_the_models_positions(load_base):
    base = load_base("llama", "sdpa")
    model = make_bitune(base)
    limit = base.config.max_position_embeddings
    examples = make_examples([[(40, 30)]] * (limit // 70 + 1))
    assert sum(len(ids) for ids, _ in examples) > limit
    assert_packed_equals_padded(model, examples)
    with pytest.raises(ValueError, match="A packed example has 260 tokens, more than the model's 256 positions"):
        model(**packed(make_examples([[(3, 2)], [(200, 60)]])))


def refused(model, batch, match):
    calls = []
    handle = model.get_input_embeddings().register_forward_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            model(**batch)
    finally:
        handle.remove()
    assert not calls  # refused before any compute


def test_packed_inputs_bitune_cannot_read_are_refused_by_example_before_any_compute(load_base):
    model = make_bitune(load_base("llama", "sdpa"))
    examples = make_examples()
    # A piece of a split example (TRL's "bfd_split") that begins inside the answer.
    piece = dict(packed(examples))
    piece["labels"] = piece["labels"].clone()
    start = len(examples[0][0])
    piece["labels"][0, start : start + 5] = piece["input_ids"][0, start : start + 5]
    refused(model, piece, r"packed example 1 \(row 0, columns 5..18\) starts with an answer token .*bfd_split")
    # An example without an answer (e.g. padding to a multiple, which TRL gives position 0).
    unsupervised = dict(packed(examples))
    unsupervised["labels"] = unsupervised["labels"].clone()
    unsupervised["labels"][0, :start] = -100
    refused(model, unsupervised, r"packed example 0 .* has no answer token .*pad_to_multiple_of")
    # Positions that do not start an example at 0.
    shifted = dict(packed(examples), position_ids=packed(examples)["position_ids"] + 1)
    refused(model, shifted, r"`position_ids` start example 0 .* at 1")
    # Boundary arguments that disagree with the positions.
    wrong = dict(packed(examples), cu_seq_lens_q=torch.tensor([0, 4, 19], dtype=torch.int32))
    refused(model, wrong, r"`cu_seq_lens_q` \(\[0, 4, 19\]\) does not describe the packed examples")
    # One adapter per row: a packed row holds many examples.
    model.eval()
    refused(model, dict(packed(examples), adapter_names=["default"]), r"`adapter_names` names an adapter per row")


def test_packed_rows_are_refused_outside_sdpa_and_eager_attention(load_base):
    model = make_bitune(load_base("llama", "sdpa"))
    model.config._attn_implementation = "flex_attention"  # what `from_pretrained(attn_implementation=...)` records
    refused(model, packed(make_examples()), r"under sdpa or eager attention, and this model runs `flex_attention`")
