"""TRL's fused LM head call answered by a Bitune model: `model(..., labels=labels, fused_lm_head=True)`.

Every TRL trainer (SFT, DPO, KTO, GRPO, RLOO) asks its model for per-token log-probabilities this way, and reads a
`trl.trainer.utils.FusedCausalLMOutput` back. TRL gives the base model that call with `add_fused_lm_head`: its
forward then runs the backbone and scores the positions whose label is not -100 through the LM head in tiles,
without ever building (batch, length, vocabulary) logits.

A Bitune forward runs that head on its answer pass only. Each answer chunk (x_m and the answer, over the mixed cache)
calls the base model's fused forward with its own, already shifted, labels (`shift_labels`); the per-token fields it
returns are put back at their input positions. So the kernel, the temperature, the soft-capping and the fields TRL
asked for are TRL's own, set where TRL set them (the trainers call `add_fused_lm_head` on the base model). A base
model that has no fused head yet (a direct call, outside a TRL trainer) is given TRL's, with the fields the trainers
read.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from torch import nn

from .checks import TrainingInputs, check_rows
from .layout import ConversationLayout

# The per-token fields of `FusedCausalLMOutput`, in its order, and those a direct call asks TRL's head for: the ones
# TRL's SFT trainer reads (`log_probs` for the loss, `entropy` and `is_top1` for its metrics).
PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
DEFAULT_FIELDS = ("log_probs", "entropy", "is_top1")


def answers_fused_call(model: nn.Module) -> bool:
    """Whether `model`'s forward takes `fused_lm_head` (TRL's `add_fused_lm_head` gave it one). Read from the
    forward's own signature, not the one it wraps: TRL's keeps the model's signature for `generate`."""
    return "fused_lm_head" in inspect.signature(model.forward, follow_wrapped=False).parameters


def ensure_fused_head(model: nn.Module) -> None:
    """Give the base model TRL's fused LM head unless it has one (a trainer's, with its temperature, comes first)."""
    if not answers_fused_call(model):
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, outputs=DEFAULT_FIELDS)


def check_fused_call(labels: torch.Tensor | None, shift_labels: torch.Tensor | None, cache: Any) -> None:
    """Refuse, before any compute, a fused-head call a Bitune forward cannot answer."""
    if shift_labels is not None:
        raise ValueError(
            "`shift_labels` (labels already shifted, as context parallelism passes them) is not supported by the "
            "Bitune forward: it finds each row's instruction and answer in unshifted `labels` over whole rows. Pass "
            "`labels` (-100 on the instruction) instead, and train with data parallelism."
        )
    if labels is None:
        raise ValueError(
            "`fused_lm_head=True` needs `labels`: the log-probabilities are those of the labelled tokens, and Bitune "
            "reads each row's instruction from them (-100 on the instruction, the tokens to score after it)."
        )
    if cache is not None:
        raise ValueError(
            "`fused_lm_head=True` scores whole rows (instruction and answer), so it cannot continue a `cache`."
        )


def check_rows_to_read(inputs: TrainingInputs) -> None:
    """A fused-head call reads a row without an answer as an instruction whose last token scores nothing; refuse a
    one-token row without an answer, which leaves no instruction before that token (rather than asking for a BOS
    token it already has)."""
    check_rows(
        (inputs.row_lengths == 1) & ~inputs.is_answer.any(dim=1),
        "Rows {rows} hold a single token and no answer token (by " + inputs.boundary + "): a row without an answer "
        "is read as an instruction with nothing to score, and one token leaves no instruction before it. Give each "
        "row an instruction and an answer of at least one token, or leave such rows out of the batch.",
    )


def warn_reference_without_adapter(model: nn.Module) -> None:
    """
    A fused-head call with the adapters disabled is how TRL's own DPO, KTO, GRPO and RLOO trainers score their
    reference for an adapter made from `peft_config`: the base model, which a Bitune adapter is not equal to even as
    it starts (the bidirectional read is mixed in). The trainers of `trl_integration` never call it so: warn once per
    model, at the first such call (the first training step).
    """
    if model.__dict__.get("_warned_reference_without_adapter"):
        return
    model.__dict__["_warned_reference_without_adapter"] = True
    warnings.warn(
        "Scoring with the Bitune adapter disabled (TRL's own DPO/KTO/GRPO/RLOO reference) scores the base model, "
        "which a Bitune adapter is not even at its start: train with `trl_integration.BituneDPOTrainer` (or "
        "BituneKTOTrainer, BituneGRPOTrainer, BituneRLOOTrainer), whose reference is an exact copy of the adapter.",
        stacklevel=3,
    )


def fused_output(
    layout: ConversationLayout,
    answer_outputs: list[Any],
    shape: tuple[int, int],
    num_items_in_batch: int | torch.Tensor | None,
) -> Any:
    """
    One `FusedCausalLMOutput` for the batch from the answer passes' own: each per-token field at its input position,
    (batch, seq_len - 1) and zero where nothing is scored, as TRL's head returns it; the loss is TRL's, the summed
    negative log-probabilities over `num_items_in_batch` (the count of scored tokens when not given).
    """
    from trl.trainer.utils import FusedCausalLMOutput

    batch_size, seq_len = shape
    fields = {}
    for name in (*PER_TOKEN_FIELDS, "label_mask"):
        values = [getattr(output, name) for output in answer_outputs]
        # A chunk's position j is input position `index[j]` and scores the token after it, which is where TRL's
        # (batch, seq_len - 1) layout puts it; the last input position scores nothing. A copy, not a view: FSDP2
        # hooks the backward of a model's outputs, and an in-place op on a returned view would drop that hook.
        if values[0] is not None:
            fields[name] = layout.scatter_answers(values, batch_size, seq_len)[:, :-1].clone()
        else:
            fields[name] = None
    label_mask = fields["label_mask"]
    count = label_mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    if isinstance(count, torch.Tensor):
        count = count.to(fields["log_probs"].device)
    return FusedCausalLMOutput(loss=-fields["log_probs"].sum() / count, **fields)
