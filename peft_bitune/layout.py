"""Where each row's instruction and answer are, and how to gather them into the batches of the three passes.

A training row is `padding? | instruction x_1..x_P | answer | padding?`. Bitune prefills x_1..x_{P-1} twice and runs
x_P plus the answer causally over the mixed cache. Rows have different P, so the rows are re-laid out, all at once:

- the prefill batch holds x_1..x_{P-1} left-padded, so every row's instruction ends at the same column;
- the answer batch holds x_P, answer right-padded, so every row continues right where its prefix ends.

Concatenating the two masks gives each row one contiguous run of real tokens, which is all that transformers' mask
machinery (padding, sliding windows) needs. Positions are the ordinary 0..n-1 of each row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class PromptAnswerLayout:
    """
    Gather indices and masks for the prefill and answer batches of one training batch.

    All tensors have batch size B. `prefill_*` are of shape (B, Lp) with Lp the longest x_1..x_{P-1}; `answer_*` are of
    shape (B, La) with La the longest x_P..end. `*_index` point into the input's sequence dimension; `*_mask` is 1 on
    real tokens; `answer_labels` holds, at each answer position, the token it must predict (or -100).
    """

    prefill_index: torch.Tensor
    prefill_mask: torch.Tensor
    prefill_positions: torch.Tensor
    answer_index: torch.Tensor
    answer_mask: torch.Tensor
    answer_positions: torch.Tensor
    answer_labels: torch.Tensor | None

    @property
    def prefill_length(self) -> int:
        return self.prefill_index.shape[1]

    @classmethod
    def from_inputs(
        cls,
        sequence_shape: torch.Size,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor | None,
        prompt_mask: torch.Tensor | None,
        device: torch.device,
    ) -> PromptAnswerLayout:
        """Validate the inputs and derive the layout; raises `ValueError` on input Bitune cannot train on."""
        batch_size, seq_len = sequence_shape[0], sequence_shape[1]
        for name, tensor in (("attention_mask", attention_mask), ("labels", labels), ("prompt_mask", prompt_mask)):
            if tensor is not None and tuple(tensor.shape) != (batch_size, seq_len):
                raise ValueError(
                    f"`{name}` has shape {tuple(tensor.shape)} but the input has shape {(batch_size, seq_len)}; "
                    "they must match."
                )
        if labels is None and prompt_mask is None:
            raise ValueError(
                "Bitune needs the instruction/answer boundary of every row: pass `labels` (the instruction is the "
                "unsupervised tokens, labels == -100, before the first supervised one) or a `prompt_mask` "
                "(1 on instruction tokens)."
            )
        if attention_mask is None:
            valid = torch.ones(batch_size, seq_len, dtype=torch.bool, device=device)
        else:
            valid = attention_mask.to(device).bool()
        starts, lengths = _contiguous_runs(valid)

        if prompt_mask is not None:
            prompt = prompt_mask.to(device).bool() & valid
            prompt_lengths = prompt.sum(dim=1)
            _check_rows(prompt != _run_mask(starts, prompt_lengths, seq_len), "`prompt_mask` must mark one run of "
                        "instruction tokens at the start of each row, followed by its answer; rows {rows} mark "
                        "something else (several instruction segments are multi-turn data, not supported yet)")
            effective_labels = None
            if labels is not None:
                effective_labels = labels.to(device).masked_fill(prompt | ~valid, IGNORE_INDEX)
        else:
            supervised = (labels.to(device) != IGNORE_INDEX) & valid
            _check_rows(~supervised.any(dim=1), "rows {rows} have no supervised token (all labels are -100): "
                        "there is no answer to train on")
            positions = torch.arange(seq_len, device=device)
            first_supervised = torch.where(supervised, positions, seq_len).amin(dim=1)
            last_supervised = torch.where(supervised, positions, -1).amax(dim=1)
            prompt_lengths = first_supervised - starts
            inside = (positions >= first_supervised[:, None]) & (positions <= last_supervised[:, None])
            _check_rows((inside & ~supervised).any(dim=1), "rows {rows} have unsupervised tokens between supervised "
                        "ones, i.e. several instruction/answer segments (multi-turn data), which is not supported "
                        "yet; pass a `prompt_mask` to choose one boundary")
            effective_labels = labels.to(device).masked_fill(~valid, IGNORE_INDEX)

        _check_rows(prompt_lengths == 0, "rows {rows} have no instruction: their first token is already part of the "
                    "answer. Bitune reads an instruction before the answer; add one (e.g. a BOS token or a template)")
        _check_rows(prompt_lengths >= lengths, "rows {rows} have no answer token after the instruction")
        return cls._build(starts, lengths, prompt_lengths, effective_labels, seq_len)

    @classmethod
    def _build(
        cls,
        starts: torch.Tensor,
        lengths: torch.Tensor,
        prompt_lengths: torch.Tensor,
        labels: torch.Tensor | None,
        seq_len: int,
    ) -> PromptAnswerLayout:
        device = starts.device
        prefill_lengths = prompt_lengths - 1  # x_1..x_{P-1}
        answer_lengths = lengths - prefill_lengths  # x_P..end
        prefill_width = int(prefill_lengths.max())
        answer_width = int(answer_lengths.max())

        columns = torch.arange(prefill_width, device=device)
        offsets = columns[None, :] - (prefill_width - prefill_lengths)[:, None]  # [B, Lp], negative on padding
        prefill_mask = offsets >= 0
        prefill_index = (starts[:, None] + offsets).clamp(0, seq_len - 1)
        prefill_positions = offsets.clamp(min=0)

        columns = torch.arange(answer_width, device=device)
        answer_mask = columns[None, :] < answer_lengths[:, None]  # [B, La]
        answer_index = (starts + prefill_lengths)[:, None] + columns[None, :]
        answer_positions = prefill_lengths[:, None] + columns[None, :]

        answer_labels = None
        if labels is not None:
            target_index = (answer_index + 1).clamp(max=seq_len - 1)
            has_target = columns[None, :] + 1 < answer_lengths[:, None]
            answer_labels = labels.gather(1, target_index).masked_fill(~has_target, IGNORE_INDEX)
        return cls(
            prefill_index=prefill_index,
            prefill_mask=prefill_mask.long(),
            prefill_positions=prefill_positions,
            answer_index=answer_index.clamp(max=seq_len - 1),
            answer_mask=answer_mask.long(),
            answer_positions=answer_positions,
            answer_labels=answer_labels,
        )

    def gather_prefill(self, sequence: torch.Tensor) -> torch.Tensor:
        """The prefill batch of `sequence` (input ids (B, T) or embeddings (B, T, H))."""
        return _gather(sequence, self.prefill_index)

    def gather_answer(self, sequence: torch.Tensor) -> torch.Tensor:
        """The answer batch of `sequence` (input ids (B, T) or embeddings (B, T, H))."""
        return _gather(sequence, self.answer_index)

    def scatter_answer(self, answer_values: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Put per-answer-position values (B, La, ...) back at their input positions of a zero (B, T, ...) tensor."""
        batch_size = answer_values.shape[0]
        out = answer_values.new_zeros((batch_size, seq_len, *answer_values.shape[2:]))
        real = self.answer_mask.bool()
        rows = torch.arange(batch_size, device=real.device)[:, None].expand_as(real)
        out[rows[real], self.answer_index[real]] = answer_values[real]
        return out


def _gather(sequence: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if sequence.dim() == 2:
        return sequence.gather(1, index)
    return sequence.gather(1, index[:, :, None].expand(-1, -1, sequence.shape[-1]))


def _run_mask(starts: torch.Tensor, lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    positions = torch.arange(seq_len, device=starts.device)[None, :]
    return (positions >= starts[:, None]) & (positions < (starts + lengths)[:, None])


def _contiguous_runs(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Start and length of each row's real tokens; refuses empty rows and padding in the middle of a row."""
    lengths = valid.sum(dim=1)
    _check_rows(lengths == 0, "rows {rows} are empty (attention_mask is all 0)")
    starts = valid.int().argmax(dim=1)
    _check_rows(valid != _run_mask(starts, lengths, valid.shape[1]), "rows {rows} have padding between real tokens; "
                "pad on the left or on the right only")
    return starts, lengths


def _check_rows(bad: torch.Tensor, message: str) -> None:
    if bad.dim() > 1:
        bad = bad.any(dim=1)
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        shown = ", ".join(map(str, rows[:8])) + (" ..." if len(rows) > 8 else "")
        raise ValueError(message.format(rows=f"[{shown}]") + ".")
