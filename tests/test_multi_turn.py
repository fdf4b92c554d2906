"""Multi-turn rows (paper A.8): alternating segments and whole-history training against per-row references."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from peft_bitune.tuner.passes import BitunePasses
from reference import make_bitune, reference_alternating, reference_row
from tiny_models import VOCAB

# Each row: (instruction length, answer length) per turn, then trailing unsupervised tokens.
ROWS = [
    ([(3, 2), (8, 3), (2, 2)], 0),
    ([(5, 3)], 2),
    ([(1, 2), (3, 1)], 0),
    ([(2, 4), (1, 2)], 1),
]


def make_conversations(padding_side: str, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    rows, supervised = [], []
    for turns, trailing in ROWS:
        tokens, mask = [], []
        for instruction, answer in turns:
            tokens += torch.randint(3, VOCAB, (instruction + answer,), generator=generator).tolist()
            mask += [0] * instruction + [1] * answer
        tokens += torch.randint(3, VOCAB, (trailing,), generator=generator).tolist()
        mask += [0] * trailing
        rows.append(torch.tensor(tokens))
        supervised.append(torch.tensor(mask, dtype=torch.bool))
    width = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for i, (row, sup) in enumerate(zip(rows, supervised)):
        start = width - len(row) if padding_side == "left" else 0
        input_ids[i, start : start + len(row)] = row
        attention_mask[i, start : start + len(row)] = 1
        labels[i, start : start + len(row)] = torch.where(sup, row, -100)
    return rows, dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def reference_history(model, row, turns, trailing):
    """A.8's simple variant: for each answer, everything before it is one instruction."""
    loss, position, all_logits = 0.0, 0, []
    for number, (instruction, answer) in enumerate(turns):
        answer_start = position + instruction
        end = answer_start + answer + (trailing if number == len(turns) - 1 else 0)
        logits, _ = reference_row(model, row[:end], answer_start)
        loss = loss + F.cross_entropy(logits[:answer], row[answer_start : answer_start + answer], reduction="sum")
        all_logits.append(logits)
        position = end
    return loss, all_logits


@pytest.mark.parametrize("mode", ["alternating", "history"])
@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize(("arch", "attn_implementation"), [("llama", "sdpa"), ("gemma3", "eager"), ("qwen2", "eager")])
def test_multi_turn_batch_matches_per_row_reference(load_base, arch, attn_implementation, padding_side, mode):
    model = make_bitune(load_base(arch, attn_implementation), multi_turn=mode)
    model.train()
    rows, batch = make_conversations(padding_side)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    reference = reference_alternating if mode == "alternating" else reference_history
    total = int((batch["labels"] != -100).sum())
    ref_loss, ref_logits = 0.0, []
    for row, (turns, trailing) in zip(rows, ROWS):
        row_loss, row_logits = reference(model, row, turns, trailing)
        ref_loss = ref_loss + row_loss
        ref_logits.append(row_logits)
    ref_loss = ref_loss / total
    ref_loss.backward()
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-5, rtol=0)
    for name, param in model.named_parameters():
        if name in grads:
            torch.testing.assert_close(grads[name], param.grad, atol=1e-5, rtol=0, msg=name)

    # Logits of each turn's last instruction token and answer sit at their input positions.
    for i, (row, (turns, trailing)) in enumerate(zip(rows, ROWS)):
        start = int(batch["attention_mask"][i].argmax())
        position = 0
        for number, ((instruction, answer), logits) in enumerate(zip(turns, ref_logits[i])):
            last = position + instruction - 1
            got = out.logits[i, start + last : start + last + 1 + answer]
            torch.testing.assert_close(got, logits[: answer + 1], atol=1e-5, rtol=0)
            position = last + 1 + answer + (trailing if number == len(turns) - 1 else 0)


def test_alternating_runs_each_segment_once_for_the_whole_batch(load_base, monkeypatch):
    model = make_bitune(load_base("llama"))
    prompt_passes, answer_passes = [], []
    original_prompt, original_answer = BitunePasses.prompt_pass, BitunePasses.answer_pass

    def prompt_pass(self, *args, **kwargs):
        prompt_passes.append(1)
        return original_prompt(self, *args, **kwargs)

    def answer_pass(self, *args, **kwargs):
        answer_passes.append(1)
        return original_answer(self, *args, **kwargs)

    monkeypatch.setattr(BitunePasses, "prompt_pass", prompt_pass)
    monkeypatch.setattr(BitunePasses, "answer_pass", answer_pass)
    _, batch = make_conversations("right")
    model(**batch)
    max_turns = max(len(turns) for turns, _ in ROWS)
    assert len(answer_passes) == max_turns
    assert len(prompt_passes) == 2 * max_turns


def test_prompt_mask_with_several_segments_selects_multi_turn(load_base):
    model = make_bitune(load_base("llama"))
    rows, batch = make_conversations("left")
    prompt_mask = (batch["labels"] == -100) & (batch["attention_mask"] == 1)
    from_labels = model(**batch)
    from_mask = model(**batch, prompt_mask=prompt_mask.long())
    torch.testing.assert_close(from_mask.loss, from_labels.loss)


def test_multi_turn_input_errors_are_clear(load_base):
    model = make_bitune(load_base("llama"))
    ids = torch.randint(3, VOCAB, (2, 8))
    labels = ids.clone()
    labels[1, 3:5] = -100  # row 1: answer first, then an instruction, then an answer
    labels[0, :3] = -100
    with pytest.raises(ValueError, match=r"Rows \[1\] start with an answer token"):
        model(input_ids=ids, labels=labels)
    labels = torch.full_like(ids, -100)
    labels[0, 4:] = ids[0, 4:]
    with pytest.raises(ValueError, match=r"Rows \[1\] have no answer token"):
        model(input_ids=ids, labels=labels)
    with pytest.raises(ValueError, match="`multi_turn` must be one of"):
        make_bitune(load_base("llama"), multi_turn="interleaved")
