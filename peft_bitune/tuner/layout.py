"""Where each row's instructions and answers are, and how to gather them into the batches of the passes.

A training row is `padding? | instruction | answer | (instruction | answer)* | padding?`. For each instruction segment
x_1..x_m, Bitune prefills x_1..x_{m-1} twice and runs x_m plus the following answer causally over the cache so far.
Rows have different segment lengths, so each pass gets its own batch ("chunk"), gathered from the input for all rows
at once:

- the first prefill chunk is left-padded, so every row's instruction ends at the same column;
- later chunks are right-padded, so each row continues right where its cache ends.

The passes keep their cache left-padded (real tokens at the right end, see `caches.TrainingCache`), so cache plus chunk
always gives each row one contiguous run of real tokens: all that transformers' mask machinery (padding, sliding
windows) needs. Positions are the ordinary 0..n-1 of each row.

A packed batch (several examples per row, `packing.py`) is laid out as if each example were a row of its own; each
chunk then keeps only its real tokens, as one row over the flattened batch, with each token's example and position
(`packing.Places`) for the pass's mask. Its cache has no padding, so it is never re-padded.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from ..constants import IGNORE_INDEX, MultiTurnMode
from .checks import TrainingInputs, check_rows
from .packing import PackedExamples, PackedMask, Places

Alignment = Literal["left", "right"]


@dataclass(frozen=True)
class Chunk:
    """
    One pass's batch, as gather indices into the input.

    All tensors are of shape (rows, width). `index` points into the input's sequence dimension (clamped on padding),
    `mask` is 1 on real tokens, `positions` are the tokens' ordinary position ids, and `labels` (answer chunks only)
    holds at each position the token it must predict, or -100.
    """

    index: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor | None = None
    places: Places | None = None  # a packed batch's chunk: one row of real tokens, each with its example

    @property
    def as_past(self) -> torch.Tensor | Places:
        """What a later pass over this chunk's keys/values needs to mask them: the mask, or a packed chunk's places."""
        return self.mask if self.places is None else self.places

    @property
    def width(self) -> int:
        return self.index.shape[1]

    @classmethod
    def take(
        cls,
        row_starts: torch.Tensor,
        starts: torch.Tensor,
        lengths: torch.Tensor,
        align: Alignment,
        seq_len: int,
        labels: torch.Tensor | None = None,
    ) -> Chunk:
        """Tokens `starts[i] .. starts[i] + lengths[i] - 1` of each row i, padded on the `align` side."""
        width = int(lengths.max()) if lengths.numel() else 0
        columns = torch.arange(width, device=starts.device)[None, :]
        if align == "left":
            offsets = columns - (width - lengths)[:, None]  # negative on padding
        else:
            offsets = columns.expand(len(starts), -1)
        mask = (offsets >= 0) & (offsets < lengths[:, None])
        raw_index = starts[:, None] + offsets
        index = raw_index.clamp(0, seq_len - 1)
        positions = (raw_index - row_starts[:, None]).clamp(min=0)
        chunk_labels = None
        if labels is not None:
            has_target = mask & (offsets + 1 < lengths[:, None])
            targets = labels.gather(1, (raw_index + 1).clamp(0, seq_len - 1))
            chunk_labels = targets.masked_fill(~has_target, IGNORE_INDEX)
        return cls(index=index, mask=mask.long(), positions=positions, labels=chunk_labels)

    def gather(self, sequence: torch.Tensor) -> torch.Tensor:
        """This chunk of `sequence` (input ids (rows, T) or embeddings (rows, T, H))."""
        if sequence.dim() == 2:
            return sequence.gather(1, self.index)
        return sequence.gather(1, self.index[:, :, None].expand(-1, -1, sequence.shape[-1]))

    def pass_inputs(self, sequence: torch.Tensor, past: torch.Tensor | Places | None) -> dict[str, Any]:
        """The model inputs of the pass that runs this chunk of `sequence` after a cache that `past` describes (its
        mask, or a packed cache's places; `None` for no cache): `input_ids` or `inputs_embeds` (as `sequence` is),
        `attention_mask` (a packed chunk's is a `PackedMask`, made concrete by the pass), `position_ids`."""
        tokens = "input_ids" if sequence.dim() == 2 else "inputs_embeds"
        if self.places is not None:
            attention_mask = PackedMask(self.places, self.places if past is None else past.then(self.places))
        else:
            attention_mask = self.mask if past is None else torch.cat([past, self.mask], dim=1)
        return {tokens: self.gather(sequence), "attention_mask": attention_mask, "position_ids": self.positions}

    def packed(self, rows: torch.Tensor, token_index: torch.Tensor) -> Chunk:
        """This chunk of virtual rows (one per packed example, `rows` of them) as one row of its real tokens:
        `token_index` maps each virtual row's columns to the batch's flattened tokens."""
        real = self.mask.bool()
        examples = rows[:, None].expand_as(real)[real][None]
        positions = self.positions[real][None]
        return Chunk(
            index=token_index[rows[:, None], self.index][real][None],
            mask=torch.ones_like(positions),
            positions=positions,
            labels=None if self.labels is None else self.labels[real][None],
            places=Places(examples, positions),
        )


@dataclass(frozen=True)
class Turn:
    """One instruction/answer pair of a batch: its prefill chunk (x_1..x_{m-1}) and its answer chunk (x_m, answer).

    `rows` selects the batch rows this turn runs on (`None`: all rows; rows without this turn are all padding).
    """

    prefill: Chunk
    answer: Chunk
    rows: torch.Tensor | None = None


@dataclass(frozen=True)
class ConversationLayout:
    """The turns of a training batch, in the order Bitune runs them."""

    turns: list[Turn]
    mode: MultiTurnMode
    packed: bool = False  # the turns' chunks are packed: one row of real tokens over the flattened batch

    @classmethod
    def from_inputs(
        cls, inputs: TrainingInputs, mode: MultiTurnMode, read_rows_without_answer: bool = False
    ) -> ConversationLayout:
        """
        Derive the turns of checked inputs (`checks.check_training_inputs`); raises `ValueError` on rows whose
        instruction/answer boundary Bitune cannot train on.

        A row without an answer token is refused, unless `read_rows_without_answer`: then it is read as an instruction
        whose last token is an answer with nothing to predict (it runs through every pass and scores nothing). TRL's
        fused-head call needs that: GRPO and RLOO mask out truncated completions, and a batch must still run.
        """
        valid, is_answer, boundary = inputs.valid, inputs.is_answer, inputs.boundary
        seq_len = valid.shape[1]
        without_answer = ~is_answer.any(dim=1)
        if read_rows_without_answer:
            last = inputs.row_starts + inputs.row_lengths - 1
            last_token = torch.arange(seq_len, device=valid.device)[None, :] == last[:, None]
            is_answer = is_answer | (last_token & without_answer[:, None])
        else:
            check_rows(without_answer, "Rows {rows} have no answer token (by " + boundary + "): there is nothing to "
                       "train on.")
        check_rows(is_answer.gather(1, inputs.row_starts[:, None])[:, 0], "Rows {rows} start with an answer token "
                   "(by " + boundary + "): Bitune reads an instruction before each answer; add one (e.g. a BOS token "
                   "or a prompt template).")
        segments = _Segments(inputs.row_starts, *_segments(valid, is_answer), seq_len, inputs.labels)
        turns = segments.history_turns() if mode == "history" else segments.alternating_turns()
        return cls(turns=turns, mode=mode)

    @classmethod
    def from_packed(
        cls, inputs: TrainingInputs, mode: MultiTurnMode, read_rows_without_answer: bool = False
    ) -> ConversationLayout:
        """
        The turns of a packed batch (`inputs.packed`): each example is laid out as a row of its own would be (its
        segments, its positions from 0), then every chunk keeps only its real tokens, as one row over the flattened
        batch, each token with its example (`Chunk.packed`). So no pass computes padding, and the passes' masks keep
        every example to itself (`packing.PackedMask`).
        """
        packed = inputs.packed
        count, longest = len(packed.starts), int(packed.lengths.max())
        columns = torch.arange(longest, device=packed.starts.device)
        valid = columns[None, :] < packed.lengths[:, None]
        token_index = (packed.starts[:, None] + columns[None, :]).clamp(max=inputs.valid.numel() - 1)
        is_answer = inputs.is_answer.flatten()[token_index] & valid
        without_answer = ~is_answer.any(dim=1)
        if not read_rows_without_answer:
            _check_examples(packed, without_answer, "has no answer token (by " + inputs.boundary + "): there is "
                            "nothing to train on. A padding-free batch padded to a multiple (`pad_to_multiple_of`) "
                            "makes each padding token an example of its own: leave that option out.")
        _check_examples(packed, is_answer[:, 0], "starts with an answer token (by " + inputs.boundary + "): Bitune "
                        "reads an instruction before each answer. TRL's `packing_strategy=\"bfd_split\"` cuts an "
                        "example that does not fit `max_length` into pieces, and a piece that begins inside the "
                        "answer has no instruction: raise `max_length`, or use `\"bfd\"`, which truncates instead.")
        labels = None
        if inputs.labels is not None:
            labels = inputs.labels.flatten()[token_index].masked_fill(~valid, IGNORE_INDEX)
        virtual = replace(inputs, valid=valid, is_answer=is_answer, labels=labels,
                          row_starts=torch.zeros_like(packed.lengths), row_lengths=packed.lengths, packed=None)
        rows = cls.from_inputs(virtual, mode, read_rows_without_answer)
        all_rows = torch.arange(count, device=valid.device)
        turns = [
            Turn(prefill=turn.prefill.packed(rows_of_turn, token_index),
                 answer=turn.answer.packed(rows_of_turn, token_index))
            for turn in rows.turns
            for rows_of_turn in [all_rows if turn.rows is None else turn.rows]
        ]
        return cls(turns=turns, mode=mode, packed=True)

    def runs(self, sequence: torch.Tensor) -> Iterator[tuple[list[Turn], torch.Tensor]]:
        """
        The runs of turns over one growing cache each, with the rows of `sequence` they read, in the order of
        `turns`: in alternating mode one run of all turns over all rows; in history mode one run per turn, over the
        rows that have it (each answer reads everything before it as one instruction).
        """
        if self.packed:
            sequence = sequence.reshape(1, -1, *sequence.shape[2:])  # the chunks index the flattened batch
        if self.mode == "history":
            for turn in self.turns:
                yield [turn], sequence if turn.rows is None else sequence[turn.rows]
        else:
            yield self.turns, sequence

    def scatter_answers(self, answer_values: list[torch.Tensor], batch_size: int, seq_len: int) -> torch.Tensor:
        """Put each turn's per-answer-position values (rows, width, ...) back at their input positions of a zero
        (batch_size, seq_len, ...) tensor.

        The result is a tensor of its own, not a view: FSDP2 hooks the backward of a model's outputs, and an in-place
        op on a returned view (`logits /= t`) would drop that hook, so that backward could run on freed parameters.
        Each turn's real answer positions are gathered (a transient copy, freed once written; chunk padding is left
        out).
        """
        first = answer_values[0]
        trailing = first.shape[2:]
        out = first.new_zeros((batch_size, seq_len, *trailing))
        flat = out.view(batch_size * seq_len, *trailing)  # writes through to `out`
        for turn, values in zip(self.turns, answer_values):
            real = turn.answer.mask.bool()
            rows = turn.rows if turn.rows is not None else torch.arange(real.shape[0], device=real.device)
            target = rows[:, None] * seq_len + turn.answer.index
            flat.index_copy_(0, target[real], values[real])
        return out


def _check_examples(packed: PackedExamples, bad: torch.Tensor, problem: str) -> None:
    """Refuse packed examples where `bad` (examples,) holds, naming the first."""
    if bool(bad.any()):
        first = int(bad.nonzero()[0])
        more = int(bad.sum()) - 1
        raise ValueError(f"The packed {packed.describe(first)}{f' (and {more} more)' if more else ''} {problem}")


def _segments(valid: torch.Tensor, is_answer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Start and length of every segment of every row, as (batch, 2 * turns) tensors: even columns are instructions,
    odd columns answers. Unsupervised tokens after the last answer change nothing (no answer follows them), so they
    are run with that answer rather than as an instruction of their own.
    """
    batch_size, seq_len = valid.shape
    changes = torch.zeros_like(valid)
    changes[:, 1:] = (is_answer[:, 1:] != is_answer[:, :-1]) & valid[:, 1:] & valid[:, :-1]
    segment = changes.long().cumsum(dim=1)
    last = torch.where(valid, segment, -1).amax(dim=1)
    trailing_instruction = (last % 2 == 0)[:, None] & (segment == last[:, None])
    segment = torch.where(trailing_instruction, segment - 1, segment)
    num_segments = int(torch.where(valid, segment, -1).max()) + 1
    segment = torch.where(valid, segment, num_segments)  # padding goes to a column that is dropped below
    positions = torch.arange(seq_len, device=valid.device).expand(batch_size, -1)
    starts = torch.full((batch_size, num_segments + 1), seq_len, device=valid.device, dtype=torch.long)
    starts = starts.scatter_reduce(1, segment, positions, reduce="amin")
    lengths = torch.zeros(batch_size, num_segments + 1, device=valid.device, dtype=torch.long)
    lengths = lengths.scatter_add(1, segment, torch.ones_like(positions))
    return starts[:, :num_segments], lengths[:, :num_segments]


@dataclass(frozen=True)
class _TurnBounds:
    """Per row, for one turn: whether the row has it, its instruction's start and length, the position of its last
    instruction token, and its answer's length."""

    has_turn: torch.Tensor
    instruction_start: torch.Tensor
    instruction_length: torch.Tensor
    last_instruction: torch.Tensor
    answer_length: torch.Tensor


@dataclass(frozen=True)
class _Segments:
    """Every row's instruction and answer segments, turned into the chunks of each multi-turn mode."""

    row_starts: torch.Tensor  # (batch,): each row's first real position
    starts: torch.Tensor  # (batch, 2 * turns): even columns instructions, odd columns answers
    lengths: torch.Tensor  # (batch, 2 * turns), 0 where a row has fewer turns
    seq_len: int
    labels: torch.Tensor | None

    def turn_bounds(self, turn: int) -> _TurnBounds:
        instruction_start = self.starts[:, 2 * turn]
        instruction_length = self.lengths[:, 2 * turn]
        answer_length = self.lengths[:, 2 * turn + 1]
        return _TurnBounds(
            has_turn=answer_length > 0,
            instruction_start=instruction_start,
            instruction_length=instruction_length,
            last_instruction=instruction_start + instruction_length - 1,
            answer_length=answer_length,
        )

    def alternating_turns(self) -> list[Turn]:
        """One turn per instruction/answer pair; each prefill chunk continues the cache of the turns before it."""
        turns = []
        for turn in range(self.starts.shape[1] // 2):
            bounds = self.turn_bounds(turn)
            prefill_lengths = torch.where(bounds.has_turn, bounds.instruction_length - 1, 0)
            answer_lengths = torch.where(bounds.has_turn, bounds.answer_length + 1, 0)
            last_column = self.seq_len - 1
            turns.append(Turn(
                prefill=Chunk.take(self.row_starts, bounds.instruction_start.clamp(max=last_column), prefill_lengths,
                                   "left" if turn == 0 else "right", self.seq_len),
                answer=Chunk.take(self.row_starts, bounds.last_instruction.clamp(max=last_column), answer_lengths,
                                  "right", self.seq_len, self.labels),
            ))
        return turns

    def history_turns(self) -> list[Turn]:
        """One turn per answer, on the rows that have it; its prefill chunk is everything before the answer's last
        instruction token."""
        turns = []
        for turn in range(self.starts.shape[1] // 2):
            bounds = self.turn_bounds(turn)
            rows = bounds.has_turn.nonzero().flatten()
            starts, last = self.row_starts[rows], bounds.last_instruction[rows]
            labels = self.labels[rows] if self.labels is not None else None
            turns.append(Turn(
                prefill=Chunk.take(starts, starts, last - starts, "left", self.seq_len),
                answer=Chunk.take(starts, last, bounds.answer_length[rows] + 1, "right", self.seq_len, labels),
                rows=rows,
            ))
        return turns
