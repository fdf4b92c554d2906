"""Chat generation: continuing a conversation from the alternating cache agrees with multi-turn training."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import VOCAB
from peft_bitune import compat
from reference import left_padded, make_bitune

SETTINGS = dict(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = left_padded(rows)
    return batch["input_ids"], batch["attention_mask"]


def chat(model, instructions_per_turn: list[list[torch.Tensor]]):
    """Generate turn after turn from the cache; returns per row the list of (instruction, answer) token tensors."""
    ids, mask = left_pad(instructions_per_turn[0])
    out = model.generate(input_ids=ids, attention_mask=mask, **SETTINGS)
    history = [[(instruction, out.sequences[i, ids.shape[1] :])] for i, instruction in enumerate(instructions_per_turn[0])]
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
        supervised = torch.cat([torch.cat([torch.full_like(instruction, -100), answer]) for instruction, answer in turns])
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
