"""The measurements: training step, generation (prefill and per-token decoding) and batching, Bitune against LoRA."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from measure import Clock, Ratio, RoundPolicy, interleaved_rounds, linear_flops, peak_bytes_during
from models import ModelPair, collate_right_padded, prompt_batch, ragged_rows, training_batch


# ---------------------------------------------------------------------------------------------------- training
def compute_bound(prompt_length: int, answer_length: int) -> float:
    """Bitune's compute over LoRA's for one row: the prompt is read twice, the answer once: (2P + A) / (P + A)."""
    return (2 * prompt_length + answer_length) / (prompt_length + answer_length)


def train_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
    """Forward and backward of one batch; gradients are dropped first so every step allocates them afresh."""
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()


@dataclass(frozen=True)
class TrainCell:
    batch_size: int
    prompt_length: int
    answer_length: int


def measure_training(pair: ModelPair, cell: TrainCell, policy: RoundPolicy, clock: Clock) -> dict:
    """Step-time and peak-memory ratios of Bitune over LoRA for one (batch, P, A)."""
    batch = training_batch(cell.batch_size, cell.prompt_length, cell.answer_length, pair.size.vocab_size, pair.device)
    for model in pair.both().values():
        model.train()
    workloads = {
        name: (lambda model=model: {"step": clock.timed(lambda: train_step(model, batch))})
        for name, model in pair.both().items()
    }
    rounds = interleaved_rounds(workloads, policy)
    time_ratio = Ratio.from_rounds(rounds, "bitune/step", "lora/step")
    peaks = {name: peak_bytes_during(lambda model=model: train_step(model, batch), pair.device)
             for name, model in pair.both().items()}
    flops = {name: linear_flops(lambda model=model: train_step(model, batch)) for name, model in pair.both().items()}
    for model in pair.both().values():
        model.zero_grad(set_to_none=True)
    bound = compute_bound(cell.prompt_length, cell.answer_length)
    return dict(
        batch_size=cell.batch_size,
        prompt_length=cell.prompt_length,
        answer_length=cell.answer_length,
        time=time_ratio.as_dict(),
        compute_bound=bound,
        ratio_to_bound=time_ratio.value / bound,
        lora_peak_bytes=peaks["lora"],
        bitune_peak_bytes=peaks["bitune"],
        memory_ratio=peaks["bitune"] / peaks["lora"],
        lora_linear_flops=flops["lora"],
        bitune_linear_flops=flops["bitune"],
        linear_flop_ratio=flops["bitune"] / flops["lora"],
        ratio_to_linear_flops=time_ratio.value / (flops["bitune"] / flops["lora"]),
    )


# ---------------------------------------------------------------------------------------------------- generation
class StepClock(LogitsProcessor):
    """
    Records when each new token's logits are ready: `generate` calls its logits processors once per new token, right
    after the forward that produced them. The first stamp ends the prefill; the following ones are decoding steps.
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.stamps.append(self.clock.now())  # a CUDA event is recorded in the stream: no wait here
        return scores


def timed_generation(model: torch.nn.Module, prompts: dict[str, torch.Tensor], new_tokens: int,
                     clock: Clock) -> dict[str, float]:
    """Prefill seconds (call to first logits) and decoding seconds per token (median spacing of later logits)."""
    step_clock = StepClock(clock)
    start = clock.now()
    with torch.no_grad():
        model.generate(
            **prompts,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([step_clock]),
        )
    stamps = step_clock.stamps
    if len(stamps) != new_tokens:
        raise RuntimeError(f"generate made {len(stamps)} tokens instead of {new_tokens}.")
    # The median step, not the mean: one step slowed down by another job would otherwise weigh on the whole run.
    return {"prefill": clock.elapsed(start, stamps[0]),
            "decode": statistics.median(clock.elapsed(a, b) for a, b in zip(stamps, stamps[1:]))}


@dataclass(frozen=True)
class GenerationCell:
    batch_size: int
    prompt_length: int
    new_tokens: int


def measure_generation(pair: ModelPair, cell: GenerationCell, policy: RoundPolicy, clock: Clock) -> dict:
    """Prefill and per-token decoding time ratios of Bitune over LoRA for one (batch, prompt length)."""
    if cell.new_tokens < 2:
        raise ValueError(f"Decoding is timed between new tokens, so `new_tokens` must be at least 2, got "
                         f"{cell.new_tokens}.")
    prompts = prompt_batch(cell.batch_size, cell.prompt_length, pair.size.vocab_size, pair.device)
    for model in pair.both().values():
        model.eval()
    workloads = {
        name: (lambda model=model: timed_generation(model, prompts, cell.new_tokens, clock))
        for name, model in pair.both().items()
    }
    rounds = interleaved_rounds(workloads, policy)
    return dict(
        batch_size=cell.batch_size,
        prompt_length=cell.prompt_length,
        new_tokens=cell.new_tokens,
        prefill=Ratio.from_rounds(rounds, "bitune/prefill", "lora/prefill").as_dict(),
        decode=Ratio.from_rounds(rounds, "bitune/decode", "lora/decode").as_dict(),
    )


# ---------------------------------------------------------------------------------------------------- batching
@dataclass(frozen=True)
class BatchingCell:
    batch_size: int
    prompt_range: tuple[int, int]
    answer_range: tuple[int, int]


def measure_batching(pair: ModelPair, cell: BatchingCell, policy: RoundPolicy, clock: Clock,
                     with_lora: bool) -> dict:
    """
    Training throughput of one right-padded batch against the same rows one at a time (how the authors' code ran).

    Rows have random prompt and answer lengths, so the batch pays for its padding and the single rows do not.
    """
    rows = ragged_rows(cell.batch_size, cell.prompt_range, cell.answer_range, pair.size.vocab_size)
    batch = collate_right_padded(rows, pair.device)
    singles = [collate_right_padded([row], pair.device) for row in rows]
    models = pair.both() if with_lora else {"bitune": pair.bitune}
    for model in models.values():
        model.train()

    def one_at_a_time(model: torch.nn.Module) -> None:
        for single in singles:
            train_step(model, single)

    workloads = {}
    for name, model in models.items():
        workloads[f"{name}_batched"] = lambda model=model: {"step": clock.timed(lambda: train_step(model, batch))}
        workloads[f"{name}_single"] = lambda model=model: {"step": clock.timed(lambda: one_at_a_time(model))}
    rounds = interleaved_rounds(workloads, policy)
    result = dict(batch_size=cell.batch_size, prompt_range=list(cell.prompt_range),
                  answer_range=list(cell.answer_range), padded_length=int(batch["input_ids"].shape[1]))
    for name in models:
        speedup = Ratio.from_rounds(rounds, f"{name}_single/step", f"{name}_batched/step")
        result[f"{name}_speedup"] = speedup.as_dict()
        result[f"{name}_examples_per_s"] = cell.batch_size / speedup.denominator_s
    return result
