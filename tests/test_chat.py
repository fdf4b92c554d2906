"""Chat generation: continuing a conversation from the alternating cache agrees with multi-turn training."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from peft_bitune import compat
from reference import left_padded, make_bitune, reference_prefill
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


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3"])
def test_chat_turns_on_sliding_window_models_equal_the_training_forward_logit_for_logit(load_base, arch):
    """The bidirectional pass of a continued turn reaches `sliding_window` positions back over the generation cache,
    one more than a transformers sliding-window layer keeps (the first turn crosses the window of 6)."""
    model = make_bitune(load_base(arch)).eval()
    first, second = random_rows([5, 4], seed=21)
    settings = dict(SETTINGS, output_logits=True)
    out = model.generate(input_ids=first[None], **settings)
    conversation = torch.cat([out.sequences, second[None]], dim=1)
    out = model.generate(input_ids=conversation, attention_mask=torch.ones_like(conversation),
                         cache=compat.output_cache(out), **settings)
    new = SETTINGS["max_new_tokens"]
    tokens, labels = conversation_row(out.sequences[0], torch.ones_like(out.sequences[0]),
                                      [(5, 5 + new), (conversation.shape[1], conversation.shape[1] + new)])
    logits = model(input_ids=tokens[None], labels=labels[None]).logits[0]
    for step in range(new):
        position = conversation.shape[1] - 1 + step
        torch.testing.assert_close(out.logits[step][0], logits[position], atol=1e-4, rtol=0)


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


# ---------------------------------------------------------------------------------------------------- beams, then on
BEAMS = dict(SETTINGS, num_beams=3, num_return_sequences=3)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_after_beam_search_the_cache_holds_exactly_the_returned_sequences(load_base, arch):
    """Beam search ends with the cache rows of its last running beams; the returned cache must hold each returned
    sequence's own keys and values, as a fresh read of it (the reference: prefill, then the answer causally)."""
    model = make_bitune(load_base(arch)).eval()
    prompts = random_rows([5, 9], seed=6)
    ids, mask = left_pad(prompts)
    out = model.generate(input_ids=ids, attention_mask=mask, **BEAMS)
    cache = compat.output_cache(out)
    assert out.sequences.shape[0] == 6 and cache.layers[0].keys.shape[0] == 6
    assert len({tuple(row) for row in out.sequences[:3].tolist()}) == 3  # three different sequences per prompt
    for row, sequence in enumerate(out.sequences):
        prompt = prompts[row // 3]
        tokens = torch.cat([prompt, sequence[ids.shape[1] :]])[None]
        expected = reference_prefill(model, prompt[None])
        with model.base_model.weights("causal"):
            model.base_model.model(input_ids=tokens[:, len(prompt) - 1 : -1],
                                   **compat.with_cache(model.base_model.model, expected), use_cache=True)
        for layer, expected_layer in zip(cache.layers, expected.layers):
            kept = expected_layer.keys.shape[-2]  # the whole row, or a sliding layer's window
            torch.testing.assert_close(layer.keys[row, :, -kept:], expected_layer.keys[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(layer.values[row, :, -kept:], expected_layer.values[0], atol=1e-5, rtol=0)


def conversation_row(sequence, attention_mask, answer_columns):
    """One row of a chat's final output, padding removed: its tokens and labels (the answers supervised)."""
    labels = torch.full_like(sequence, -100)
    for start, end in answer_columns:
        labels[start:end] = sequence[start:end]
    real = attention_mask.bool()
    return sequence[real], labels[real]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_chat_goes_on_after_beam_search_turns_as_a_fresh_read_of_the_returned_sequences(load_base, arch):
    """Turn 1: beams, three sequences per prompt; turn 2, continued: beams, two sequences per row; turn 3, continued:
    greedy. Every step of turn 3 equals the training forward over each whole conversation (the fresh read)."""
    model = make_bitune(load_base(arch)).eval()
    lengths = [[5, 9], [4, 4], [3, 3]] if arch == "gemma3" else [[5, 9], [2, 7], [6, 3]]
    turns = [random_rows(turn_lengths, seed=10 + turn) for turn, turn_lengths in enumerate(lengths)]
    new = SETTINGS["max_new_tokens"]
    ids, mask = left_pad(turns[0])
    out = model.generate(input_ids=ids, attention_mask=mask, **BEAMS)
    answers = [(ids.shape[1], ids.shape[1] + new)]
    mask = torch.cat([mask.repeat_interleave(3, dim=0), torch.ones(6, new, dtype=torch.long)], dim=1)
    for turn, settings in ((1, dict(BEAMS, num_return_sequences=2)), (2, dict(SETTINGS, output_logits=True))):
        instructions = [turns[turn][row // 3 if turn == 1 else row // 6] for row in range(out.sequences.shape[0])]
        new_ids, new_mask = left_pad(instructions)
        ids, mask = torch.cat([out.sequences, new_ids], dim=1), torch.cat([mask, new_mask], dim=1)
        out = model.generate(input_ids=ids, attention_mask=mask, cache=compat.output_cache(out), **settings)
        answers.append((ids.shape[1], ids.shape[1] + new))
        rows = out.sequences.shape[0]
        mask = torch.cat([mask.repeat_interleave(rows // mask.shape[0], dim=0),
                          torch.ones(rows, new, dtype=torch.long)], dim=1)
    assert out.sequences.shape[0] == 12
    start = answers[-1][0]
    for row in range(12):
        tokens, labels = conversation_row(out.sequences[row], mask[row], answers)
        logits = model(input_ids=tokens[None], labels=labels[None]).logits[0]
        last_turn = (labels != -100).nonzero().flatten()[-new:] - 1  # the positions predicting turn 3's answer
        for step, position in enumerate(last_turn):
            torch.testing.assert_close(out.logits[step][row], logits[position], atol=1e-4, rtol=0)
        assert out.sequences[row, start:].tolist() == logits[last_turn].argmax(-1).tolist()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_conversation_laid_out_turn_by_turn_with_prefill_continues_like_the_chat(load_base, arch):
    """A chat history re-read without decoding (`prefill` with `cache`, each answer named with `record_conversation`)
    leaves the cache the chat itself built: the next answer is the same."""
    model = make_bitune(load_base(arch)).eval()
    history = chat(model, [random_rows([n], seed=turn) for turn, n in enumerate([4, 1, 6, 3])])[0]
    conversation = history[0][0][None]
    cache = model.base_model.prefill(conversation)
    assert cache.conversation_length == cache.get_seq_length() == conversation.shape[1] - 1
    for (_, answer), (instruction, _) in zip(history[:-1], history[1:]):
        conversation = torch.cat([conversation, answer[None]], dim=1)
        cache.record_conversation(conversation, torch.ones_like(conversation))
        conversation = torch.cat([conversation, instruction[None]], dim=1)
        assert model.base_model.prefill(conversation, cache=cache) is cache
        assert cache.get_seq_length() == cache.conversation_length == conversation.shape[1] - 1
    output = model.generate(input_ids=conversation, cache=cache, **SETTINGS)
    assert torch.equal(output.sequences[0, conversation.shape[1] :], history[-1][1])
    with pytest.raises(ValueError, match="does not continue the conversation"):
        model.base_model.prefill(torch.cat([conversation + 1, conversation], dim=1), cache=cache)


def test_a_history_adapter_refuses_a_cache_that_would_read_a_new_turn(load_base):
    """A `multi_turn="history"` adapter reads the whole conversation before each answer as one instruction; a cache
    would read the new turn the alternating way. A cache that holds all of the input but its last token (a fresh
    `prefill`, a retry of the same prompt, as the server passes) reads nothing new and is kept."""
    model = make_bitune(load_base("llama"), multi_turn="history").eval()
    first = random_rows([4], seed=1)[0][None]
    out = model.generate(input_ids=first, **SETTINGS)
    conversation = torch.cat([out.sequences, random_rows([3], seed=2)[0][None]], dim=1)
    message = r"`multi_turn='history'`.*without `cache`, on the whole conversation so far"
    with pytest.raises(ValueError, match=message):
        model.generate(input_ids=conversation, cache=copy.deepcopy(compat.output_cache(out)), **SETTINGS)
    with pytest.raises(ValueError, match=message):
        model.base_model.prefill(conversation, cache=copy.deepcopy(compat.output_cache(out)))
    # Without a cache it reads the whole conversation; with the cache of its own prefill, the same answer.
    fresh = model.generate(input_ids=conversation, **SETTINGS)
    again = model.generate(input_ids=conversation, cache=model.base_model.prefill(conversation), **SETTINGS)
    assert torch.equal(again.sequences, fresh.sequences)


def test_a_bitune_cache_is_refused_with_the_adapters_disabled(load_base):
    """The base model would decode over the mixed cache, and grow it past the conversation it records."""
    model = make_bitune(load_base("llama")).eval()
    ids, mask, out = first_turn(model)
    new_ids, new_mask = left_pad(random_rows([2, 6], seed=2))
    conversation = torch.cat([out.sequences, new_ids], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(out.sequences[:, ids.shape[1]:]), new_mask], dim=1)
    cache = compat.output_cache(out)
    length = cache.get_seq_length()
    with model.disable_adapter():
        with pytest.raises(ValueError, match=r"Bitune cache .* cannot be used with the adapters disabled"):
            model.generate(input_ids=conversation, attention_mask=full_mask, cache=cache, **SETTINGS)
        with pytest.raises(ValueError, match=r"Bitune cache .* cannot be used with the adapters disabled"):
            model(input_ids=new_ids, cache=cache)
    assert cache.get_seq_length() == length  # untouched: the conversation goes on outside `disable_adapter()`
    model.generate(input_ids=conversation, attention_mask=full_mask, cache=cache, **SETTINGS)
