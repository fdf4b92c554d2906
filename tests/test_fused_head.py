"""TRL's fused-head call on a Bitune model (`model(..., labels=labels, fused_lm_head=True)`), against the project's
full-logits forward (itself checked against the per-row reference in test_forward.py): per-token log-probabilities,
entropy, top-1 hits and the loss, on every architecture, both paddings, multi-turn rows and activation checkpointing;
no (batch, length, vocabulary) logits; and what it refuses. Under FSDP2 it is checked in test_sharding.py, under DDP
through `BituneSFTTrainer` in test_trl_training.py."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from trl.trainer.utils import FusedCausalLMOutput, add_fused_lm_head

from peft_bitune import compat
from reference import make_bitune, padded_batch
from test_multi_turn import make_conversations
from tiny_models import ATTENTION_CASES, VOCAB

ATOL = 1e-5  # float32, as the issue asks: log-probabilities of a 96-token vocabulary, sums of a few terms


def expected_fields(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """Per-token fields of TRL's contract from full logits aligned with the input: (batch, seq - 1), zero where the
    next label is -100."""
    log_probs = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    targets = labels[:, 1:]
    mask = targets != -100
    target_log_probs = log_probs.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return {
        "log_probs": target_log_probs.masked_fill(~mask, 0.0),
        "entropy": (-(log_probs.exp() * log_probs).sum(-1)).masked_fill(~mask, 0.0),
        "is_top1": (log_probs.argmax(-1) == targets) & mask,
        "label_mask": mask,
    }


def assert_fused_matches_full(model, batch: dict[str, torch.Tensor]) -> FusedCausalLMOutput:
    full = model(**batch)
    fused = model(**batch, fused_lm_head=True)
    assert isinstance(fused, FusedCausalLMOutput)
    want = expected_fields(full.logits, batch["labels"])
    assert fused.log_probs.shape == (batch["input_ids"].shape[0], batch["input_ids"].shape[1] - 1)
    torch.testing.assert_close(fused.log_probs, want["log_probs"], rtol=0, atol=ATOL)
    torch.testing.assert_close(fused.entropy, want["entropy"], rtol=0, atol=ATOL)
    assert torch.equal(fused.label_mask, want["label_mask"])
    # A top-1 hit can flip only on a near tie of the two largest logits.
    assert int((fused.is_top1 != want["is_top1"]).sum()) <= 1
    torch.testing.assert_close(fused.loss, full.loss, rtol=0, atol=ATOL)
    return fused


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize(("arch", "attn_implementation"), ATTENTION_CASES)
def test_fused_head_matches_full_logits(load_base, arch, attn_implementation, padding_side):
    model = make_bitune(load_base(arch, attn_implementation)).train()
    _, batch, _ = padded_batch(padding_side, VOCAB)
    assert_fused_matches_full(model, batch)


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("mode", ["alternating", "history"])
def test_fused_head_matches_full_logits_on_multi_turn_rows(load_base, mode, padding_side):
    model = make_bitune(load_base("gemma2"), multi_turn=mode).train()
    _, batch = make_conversations(padding_side)
    assert_fused_matches_full(model, batch)


def test_fused_head_gradients_match_full_logits_with_checkpointing(load_base):
    model = make_bitune(load_base("llama")).train()
    compat.enable_checkpointing(model, use_reentrant=False)
    _, batch, _ = padded_batch("right", VOCAB)
    gradients = {}
    for fused in (False, True):
        model.zero_grad()
        model(**batch, fused_lm_head=fused).loss.backward()
        gradients[fused] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert gradients[True].keys() == gradients[False].keys() and gradients[True]
    for name, gradient in gradients[True].items():
        torch.testing.assert_close(gradient, gradients[False][name], rtol=1e-4, atol=1e-6, msg=name)


def test_fused_head_builds_no_logits(load_base):
    """The LM head module never runs: TRL's kernel reads its weight in tiles, over the answer passes' positions."""
    model = make_bitune(load_base("qwen2")).train()
    _, batch, _ = padded_batch("left", VOCAB)
    calls = []
    model.get_output_embeddings().register_forward_hook(lambda module, args, output: calls.append(output.shape))
    model(**batch, fused_lm_head=True).loss.backward()
    assert calls == []
    model(**batch)
    assert len(calls) > 0  # the hook sees the full-logits forward's head


def test_fused_head_uses_the_temperature_a_trainer_set(load_base):
    """GRPO and RLOO give the base model TRL's head with their sampling temperature; the Bitune forward uses it."""
    model = make_bitune(load_base("llama")).eval()
    _, batch, _ = padded_batch("left", VOCAB)
    full = model(**batch)
    add_fused_lm_head(model.get_base_model(), temperature=0.7, outputs=("log_probs",))
    fused = model(**batch, fused_lm_head=True)
    want = expected_fields(full.logits, batch["labels"], temperature=0.7)
    torch.testing.assert_close(fused.log_probs, want["log_probs"], rtol=0, atol=ATOL)
    assert fused.entropy is None  # the fields the trainer asked for, and only those


def test_rows_without_an_answer_run_and_score_nothing(load_base):
    """GRPO and RLOO mask out truncated completions: such rows score zero, and the other rows are as without them."""
    model = make_bitune(load_base("llama")).train()
    _, batch, _ = padded_batch("right", VOCAB)
    masked = {**batch, "labels": batch["labels"].clone()}
    masked["labels"][1:3] = -100
    fused = model(**masked, fused_lm_head=True)
    assert torch.equal(fused.log_probs[1:3], torch.zeros_like(fused.log_probs[1:3]))
    alone = model(**{name: value[[0, 3]] for name, value in batch.items()}, fused_lm_head=True)
    torch.testing.assert_close(fused.log_probs[[0, 3]], alone.log_probs, rtol=0, atol=ATOL)

    nothing = model(**{**batch, "labels": torch.full_like(batch["labels"], -100)}, fused_lm_head=True)
    assert torch.equal(nothing.log_probs, torch.zeros_like(nothing.log_probs)) and nothing.loss.item() == 0.0
    nothing.loss.backward()  # connected to the model, as TRL's own head keeps it


def test_fused_head_with_adapters_disabled_is_the_base_model(load_base):
    model = make_bitune(load_base("llama")).eval()
    _, batch, _ = padded_batch("left", VOCAB)
    with model.disable_adapter():
        fused = model(**batch, fused_lm_head=True)
        base = model.get_base_model()
        base_logits = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    want = expected_fields(base_logits, batch["labels"])
    torch.testing.assert_close(fused.log_probs, want["log_probs"], rtol=0, atol=ATOL)


def one_token_row_without_answer(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Row 2 cut to its first token (a BOS, say), with no answer: a fused-head call reads a row without an answer as
    an instruction whose last token scores nothing, and one token leaves no instruction before it."""
    attention_mask, labels = batch["attention_mask"].clone(), batch["labels"].clone()
    attention_mask[2, 1:] = 0
    labels[2] = -100
    return {**batch, "attention_mask": attention_mask, "labels": labels}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda batch: {**batch, "labels": None}, r"`fused_lm_head=True` needs `labels`"),
        (lambda batch: {**batch, "shift_labels": batch["labels"][:, 1:]}, r"`shift_labels`.*not supported"),
        (lambda batch: {**batch, "labels": batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)},
         r"Rows \[0, 1, 2, 3\] are supervised at every token \(by `labels`\).*`completion_only_loss=False`"),
        (lambda batch: {**batch, "labels": batch["labels"].index_put((torch.tensor([1]), torch.tensor([0])),
                                                                     batch["input_ids"][1, :1])},
         r"Rows \[1\] start with an answer token \(by `labels`\)"),
        (one_token_row_without_answer, r"Rows \[2\] hold a single token and no answer token \(by `labels`\)"),
    ],
    ids=["no_labels", "shift_labels", "whole_row_supervised", "answer_at_position_0", "one_token_without_answer"],
)
def test_fused_head_refusals(load_base, change, message):
    model = make_bitune(load_base("llama")).train()
    _, batch, _ = padded_batch("right", VOCAB)
    with pytest.raises(ValueError, match=message):
        model(**change(batch), fused_lm_head=True)
