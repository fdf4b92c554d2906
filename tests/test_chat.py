"""Chat generation: continuing a conversation from the alternating cache agrees with multi-turn training."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from peft_bitune import compat
from reference import left_padded, make_bitune
from tiny_models import VOCAB

SETTINGS = dict(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = left_padded(rows)
    return batch["input_ids"], batch["attention_mask"]


def chat(model, instructions_per_turn: list[list[torch.Tensor]]):
    """Generate turn after turn from the cache; returns per row the list of (instruction, answer) token tensors."""
    ids, mask = left_pad(instructions_per_turn[0])
    out = model.generate(input_ids=ids, attention_mask=mask, **SETTINGS)
    history = [
        [(instruction, out.sequences[i, ids.shape[1] :])] for i, instruction in enumerate(instructions_per_turn[0])
    ]
    mask = torch.cat([mask, torch.ones(len(history), SETTINGS["max_new_tokens"], dtype=torch.long)], dim=1)
    for instructions in instructions_per_turn[1:]:
        new_ids, new_mask = left_pad(instructions)
        ids, mask = torch.cat([out.sequences, new_ids], dim=1), torch.cat([mask, new_mask], dim=1)
        out = model.generate(input_ids=ids, attention_mask=mask, cache=compat.output_cache(out), **SETTINGS)
        for i, instruction in enumerate(instructions):
            history[i].append((instruction, out.sequences[i, ids.shape[1] :]))
        mask = torch.cat([mask, torch.ones(len(history), SETTINGS["max_new_tokens"], dtype=torch.long)], dim=1)
    return history


def assert_training_forward_predicts_every_answer(model, history):
    rows, labels = [], []
    for turns in history:
        tokens = torch.cat([torch.cat([instruction, answer]) for instruction, answer in turns])
        supervised = torch.cat(
            [torch.cat([torch.full_like(instruction, -100), answer]) for instruction, answer in turns]
        )
        rows.append(tokens)
        labels.append(supervised)
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    label_batch = torch.full_like(ids, -100)
    for i, (row, label) in enumerate(zip(rows, labels)):  # right padding: a different layout than generation's
        ids[i, : len(row)], mask[i, : len(row)], label_batch[i, : len(row)] = row, 1, label
    logits = model(input_ids=ids, attention_mask=mask, labels=label_batch).logits
    for i, label in enumerate(labels):
        targets = (label != -100).nonzero().flatten()
        assert logits[i, targets - 1].argmax(-1).tolist() == label[targets].tolist()


def random_rows(lengths, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator) for n in lengths]


@pytest.mark.parametrize(
    ("arch", "lengths"),
    [
        # Turns of different lengths per row: padding between turns (fine for full attention).
        ("llama", [[4, 9, 1], [3, 1, 6], [5, 2, 2]]),
        # Sliding windows are counted in cache columns: later turns have equal lengths across rows.
        ("gemma3", [[4, 9, 2], [5, 5, 5], [3, 3, 3]]),
    ],
)
def test_greedy_chat_turns_equal_the_training_forward_on_the_conversation(load_base, arch, lengths):
    model = make_bitune(load_base(arch)).eval()
    turns = [random_rows(turn_lengths, seed=turn) for turn, turn_lengths in enumerate(lengths)]
    history = chat(model, turns)
    for k in range(1, len(turns) + 1):
        assert_training_forward_predicts_every_answer(model, [row[:k] for row in history])


def test_a_cache_that_cannot_continue_the_conversation_is_refused(load_base):
    model = make_bitune(load_base("llama")).eval()
    ids, mask = left_pad(random_rows([4, 6], seed=1))
    out = model.generate(input_ids=ids, attention_mask=mask, **SETTINGS)
    more = torch.randint(3, VOCAB, (2, 3))
    conversation = torch.cat([out.sequences, more], dim=1)
    with pytest.raises(ValueError, match="BituneCache"):
        model.generate(input_ids=conversation, cache=DynamicCache(), **SETTINGS)
    other = make_bitune(load_base("gemma")).eval()
    other_out = other.generate(input_ids=ids, attention_mask=mask, **SETTINGS)
    with pytest.raises(ValueError, match="another model"):
        model.generate(input_ids=conversation, cache=compat.output_cache(other_out), **SETTINGS)
    with pytest.raises(ValueError, match="conversation so far"):
        model.generate(input_ids=out.sequences, cache=compat.output_cache(out), **SETTINGS)
    with pytest.raises(ValueError, match="one row"):
        model.generate(input_ids=conversation[:1], cache=compat.output_cache(out), **SETTINGS)
    with pytest.raises(NotImplementedError, match="num_beams=1"):
        model.generate(input_ids=conversation, cache=compat.output_cache(out), **dict(SETTINGS, num_beams=2))


def first_turn(model, lengths=(8, 3), seed=1):
    ids, mask = left_pad(random_rows(list(lengths), seed=seed))
    return ids, mask, model.generate(input_ids=ids, attention_mask=mask, **SETTINGS)


def test_a_padded_chat_continued_without_attention_mask_infers_it_from_the_pad_token(load_base):
    model = make_bitune(load_base("llama")).eval()
    no_pad = dict(SETTINGS, suppress_tokens=[0])  # answers without the pad token, so that it marks padding only
    ids, mask = left_pad(random_rows([8, 3], seed=1))
    out = model.generate(input_ids=ids, attention_mask=mask, **no_pad)
    new_ids, new_mask = left_pad(random_rows([2, 6], seed=2))
    conversation = torch.cat([out.sequences, new_ids], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(out.sequences[:, ids.shape[1] :]), new_mask], dim=1)
    assert torch.equal(full_mask, (conversation != 0).long())
    with_mask = model.generate(input_ids=conversation, attention_mask=full_mask,
                               cache=copy.deepcopy(compat.output_cache(out)), **no_pad)
    without_mask = model.generate(input_ids=conversation, cache=copy.deepcopy(compat.output_cache(out)),
                                  **no_pad)
    assert torch.equal(without_mask.sequences, with_mask.sequences)


def test_a_history_that_is_not_the_cached_conversation_is_refused(load_base):
    model = make_bitune(load_base("llama")).eval()
    ids, mask, out = first_turn(model)
    new_ids, new_mask = left_pad(random_rows([2, 6], seed=2))
    full_mask = torch.cat([mask, torch.ones_like(out.sequences[:, ids.shape[1] :]), new_mask], dim=1)
    edited = out.sequences.clone()
    edited[0, -2] = (edited[0, -2] + 1) % VOCAB  # same length, one answer token changed
    with pytest.raises(ValueError, match="does not continue the conversation this cache holds: row 0"):
        model.generate(input_ids=torch.cat([edited, new_ids], dim=1), attention_mask=full_mask,
                       cache=compat.output_cache(out), **SETTINGS)
    # Padding of an earlier turn cannot become a real token: the cache holds no keys/values for it.
    unpadded = torch.cat([torch.ones_like(mask), full_mask[:, mask.shape[1] :]], dim=1)
    with pytest.raises(ValueError, match="was padding in the conversation this cache holds"):
        model.generate(input_ids=torch.cat([out.sequences, new_ids], dim=1), attention_mask=unpadded,
                       cache=compat.output_cache(out), **SETTINGS)


def test_a_conversation_is_branched_from_a_copy_of_the_cache(load_base):
    model = make_bitune(load_base("llama")).eval()
    ids, mask, out = first_turn(model, lengths=(5,))
    branch_a, branch_b = random_rows([2], seed=3)[0][None], random_rows([9], seed=4)[0][None]

    def continue_with(cache, instruction):
        conversation = torch.cat([out.sequences, instruction], dim=1)
        return model.generate(input_ids=conversation, attention_mask=torch.ones_like(conversation),
                              cache=cache, **SETTINGS).sequences

    expected_b = continue_with(copy.deepcopy(compat.output_cache(out)), branch_b)
    answer_a = continue_with(copy.deepcopy(compat.output_cache(out)), branch_a)
    assert torch.equal(continue_with(copy.deepcopy(compat.output_cache(out)), branch_b), expected_b)
    # Reusing the turn-1 cache after it was extended by another branch is refused, not answered from the wrong keys.
    continue_with(compat.output_cache(out), branch_a)
    assert compat.output_cache(out).conversation_length == answer_a.shape[1]
    with pytest.raises(ValueError, match=r"copy\.deepcopy\(cache\)"):
        continue_with(compat.output_cache(out), branch_b)
