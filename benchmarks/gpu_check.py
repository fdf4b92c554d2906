"""
Is Bitune exact, fast and lean on a GPU? One command, no downloads: random-weight models built from the configs of
Gemma-2B (all 18 layers) and Llama-3-8B (4 of its 32 layers, full width), LoRA r=8 on every linear layer for LoRA and
for both of Bitune's weight sets. It writes one JSON file (`--json`) and prints a short table. See docs/gpu.md.

    python benchmarks/gpu_check.py --json out.json               # a GPU: under 8 minutes on one H200
    python benchmarks/gpu_check.py --device cpu --smoke          # every part on tiny shapes, under 2 minutes

Parts, each stopped at its time budget (`BUDGETS_S`; what it did not reach is marked `skipped`):

- exactness: float32, a small left- and right-padded batch: the batched Bitune forward's loss, logits and the
  gradients of its three groups, and greedy `generate`, against the per-row reference of the tests
  (tests/reference.py) with the tests' tolerances (tests/precision.py).
- bf16_gradients: each group's gradient (LoRA's; Bitune's bidirectional, causal and mixing) in bf16 against a float32
  step on the same weights and batch: cosine and norm ratio.
- speed: Bitune over LoRA in the same run, CUDA events, a warm-up then interleaved rounds: a training step at batch
  8, P=512, A=256, without and with activation checkpointing (time ratios of the fastest and of the median steps,
  ratio to the linear FLOPs, model FLOP utilisation of each against the chip's bf16 dense peak); prefill at P=1024
  and per-token decoding, at batch 1 and 16.
- attention_kernels: the SDPA backend of each pass (bidirectional prompt pass with and without padding, causal
  prompt pass, answer pass, decoding), flagging the math fallback; flash-attention-2 too if `flash_attn` imports.
- memory: peak bytes allocated (`torch.cuda.max_memory_allocated`) during a training step at batch 4, P=512, A=256,
  with checkpointing, for each method of benchmarks/training_memory.py (LoRA's loss as TRL's SFTTrainer computes it).

On the lent H200 (torch 2.11, transformers 5.17, no network), everything it imports is there except peft (declared
`peft>=0.21.0,<0.22`) and, for the TRL loss of LoRA and Bitune in the memory part, trl and what `trl.trainer.utils`
imports that the image lacks (datasets, dill, multiprocess). Here, in the repository root:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        -d .whl peft==0.21.2 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19

and there (carry `.whl`), in one command:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; \\
        PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --json $OUT/gpu_check_h200.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the tests' reference and tolerances

import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from peft import LoraConfig  # noqa: E402

import sdpa_backends  # noqa: E402
import training_memory  # noqa: E402
from bf16_autocast import gradient_agreement  # noqa: E402
from measure import Clock, RoundPolicy  # noqa: E402
from models import (  # noqa: E402
    REAL_SHAPES,
    TINY_SHAPES,
    ModelPair,
    build_pair,
    collate_right_padded,
    lora_config,
    random_base,
    training_batch,
)
from peft_bitune import compat  # noqa: E402
from precision import float32_sums  # noqa: E402
from reference import (  # noqa: E402
    PROMPT_LENGTHS,
    answer_logits,
    left_padded,
    make_bitune,
    padded_batch,
    reference_batch,
    reference_greedy_steps,
    trainable_grads,
)
from suites import GenerationCell, TrainCell, measure_generation, measure_training  # noqa: E402

GIB = 2**30
# Dense bf16 matrix throughput from the vendors' data sheets (no sparsity), by a name `get_device_name` contains.
BF16_DENSE_PEAK_TFLOPS = {"H200": 989.5, "H100 SXM": 989.5, "H100 PCIe": 756.0, "H100": 989.5, "A100": 312.0,
                          "L40S": 362.05, "L4": 121.0, "A10G": 70.0, "RTX 4090": 165.2}
BUDGETS_S = {"exactness": 75, "bf16_gradients": 45, "speed": 180, "attention_kernels": 45, "memory": 60}
PARTS = tuple(BUDGETS_S)
GREEDY_PROMPTS = [9, 1, 4, 12]  # tests/test_generate.py's prompt lengths
GREEDY_NEW_TOKENS = 6


class Plan:
    """The shapes and sizes of one run: the real ones, or tiny stand-ins for `--smoke`."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        if smoke:
            self.shapes = [(TINY_SHAPES["tiny-gemma"], None), (TINY_SHAPES["tiny-llama"], None)]
            self.train_cell, self.generation_prompt, self.new_tokens = TrainCell(2, 16, 8), 24, 4
            self.memory_batch, self.gradient_batch = (2, 16, 8), (2, 12, 6)
            self.policy = RoundPolicy(min_rounds=1, max_rounds=1, budget_s=0.0)
        else:
            self.shapes = [(REAL_SHAPES["gemma-2b"], None), (REAL_SHAPES["llama-3-8b"], 4)]
            self.train_cell, self.generation_prompt, self.new_tokens = TrainCell(8, 512, 256), 1024, 32
            self.memory_batch, self.gradient_batch = (4, 512, 256), (4, 128, 64)
            self.policy = RoundPolicy(min_rounds=3, max_rounds=7, budget_s=10.0)
        self.generation_batches = (1, 16)

    def configs(self) -> list[tuple[str, object]]:
        return [(f"{shape.name}" + (f"-{layers}-layers" if layers else ""), shape.config(layers))
                for shape, layers in self.shapes]


class Budget:
    """Seconds spent per part; a part stops before a unit of work once it has used its budget."""

    def __init__(self, budgets: dict[str, float]) -> None:
        self.budgets, self.spent = budgets, dict.fromkeys(budgets, 0.0)

    def remaining(self, part: str) -> float:
        return self.budgets[part] - self.spent[part]

    def run(self, part: str, work: Callable[[], dict], log: Callable[[str], None]) -> dict:
        if self.remaining(part) <= 0:
            return {"skipped": f"the part's time budget ({self.budgets[part]} s) was used up"}
        start = time.perf_counter()
        try:
            result = work()
        finally:
            self.spent[part] += time.perf_counter() - start
            free_memory()
        log(f"  {part}: {time.perf_counter() - start:.1f} s")
        return result


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- what fits
def parameter_count(config) -> int:
    """Parameters of a decoder-only LM, from its config (embeddings, attention, gated MLP, LM head; norms left out)."""
    text = config.get_text_config()
    hidden, heads, kv_heads = text.hidden_size, text.num_attention_heads, text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * text.intermediate_size
    embeddings = text.vocab_size * hidden * (1 if text.tie_word_embeddings else 2)
    return embeddings + text.num_hidden_layers * layer


def bytes_needed(config, plan: Plan) -> int:
    """A rough upper bound of what the run holds at once: the bf16 LoRA/Bitune pair with one of them in float32 (the
    gradient part), and the activations of the speed part's step without checkpointing (every decoder layer's inputs
    to its linear layers, with Bitune's prompt read twice; the logits, their float32 copy and the loss's)."""
    text = config.get_text_config()
    cell = plan.train_cell
    tokens = cell.batch_size * (2 * cell.prompt_length + cell.answer_length)
    per_token_layer = 2 * (6 * text.hidden_size + 5 * text.intermediate_size)
    logits = cell.batch_size * (cell.prompt_length + cell.answer_length) * text.vocab_size * 12
    return 6 * parameter_count(config) + tokens * text.num_hidden_layers * per_token_layer + logits


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def refusal(args: argparse.Namespace, plan: Plan) -> str | None:
    """Why this run cannot go ahead on this device, in one line, or None. Nothing is built before it is asked."""
    if args.device.type == "cuda" and not torch.cuda.is_available():
        return ("gpu_check: --device cuda was asked for, but this torch build sees no CUDA device; run on a GPU "
                "machine, or use --device cpu --smoke.")
    available = args.memory_gib * GIB if args.memory_gib is not None else available_bytes(args.device)
    for name, config in plan.configs():
        needed = bytes_needed(config, plan)
        if needed > available:
            return (f"gpu_check: the {name} shape needs about {needed / GIB:.0f} GiB on {args.device} (models and "
                    f"one training step), but {available / GIB:.1f} GiB is free; use a device with more memory, or "
                    f"--smoke.")
    return None


# ---------------------------------------------------------------------------------------------- parts
def group_of(name: str) -> str:
    if "bitune_mixers" in name:
        return "mixing"
    return "bidirectional" if "__bidirectional" in name else "causal"


def max_abs_by_group(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    result: dict[str, float] = {}
    for name in want:
        group = group_of(name)
        result[group] = max(result.get(group, 0.0), float((got[name] - want[name]).abs().max()))
    return result


def check_exactness(config, device: torch.device) -> dict:
    """The batched Bitune forward and greedy `generate` against the tests' per-row reference, in float32."""
    adapter = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    model = make_bitune(random_base(config, device, torch.float32, "sdpa"), adapter_config=adapter).to(device)
    vocab = config.get_text_config().vocab_size
    tolerance = float32_sums(1e-5)  # tests/test_forward.py's assert_matches_reference
    result = {"tolerance": {"forward_atol": tolerance.atol}}
    for side in ("left", "right"):
        rows, batch, _ = padded_batch(side, vocab)
        rows, batch = [row.to(device) for row in rows], {k: v.to(device) for k, v in batch.items()}
        model.train().zero_grad()
        out = model(**batch)
        out.loss.backward()
        grads = trainable_grads(model)
        model.zero_grad()
        ref_logits, ref_loss = reference_batch(model, rows, PROMPT_LENGTHS)
        ref_loss.backward()
        ref_grads = trainable_grads(model)
        largest_logit = max(float(want.detach().abs().max()) for want in ref_logits)
        got_logits = answer_logits(out.logits, batch, rows, PROMPT_LENGTHS)
        deviations = {
            "loss": float((out.loss - ref_loss).detach().abs()),
            "logits": max(float((g - w).detach().abs().max()) for g, w in zip(got_logits, ref_logits)),
            "gradients": max_abs_by_group(grads, ref_grads),
        }
        try:  # exactly the test's assertions
            tolerance.assert_close(out.loss, ref_loss, scale=2 * largest_logit)
            for got, want in zip(got_logits, ref_logits):
                tolerance.assert_close(got, want)
            assert grads.keys() == ref_grads.keys()
            for parameter in grads:
                tolerance.assert_close(grads[parameter], ref_grads[parameter], msg=parameter)
            exact, failure = True, None
        except AssertionError as error:
            exact, failure = False, str(error).splitlines()[0][:300]
        result[f"forward_{side}_padded"] = {"max_abs_difference": deviations, "exact": exact, "failure": failure}
    model.zero_grad(set_to_none=True)
    result["generate"] = check_greedy(model.eval(), vocab, device)
    result["exact"] = all(result[key]["exact"] for key in ("forward_left_padded", "forward_right_padded", "generate"))
    return result


def check_greedy(model, vocab: int, device: torch.device) -> dict:
    """Left-padded batched greedy decoding against the reference's step-by-step greedy tokens and scores (the scores
    within tests/test_generate.py's 1e-4; a token may differ only at a tie within it)."""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=generator) for n in GREEDY_PROMPTS]
    batch = {k: v.to(device) for k, v in left_padded(prompts).items()}
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=GREEDY_NEW_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        width = batch["input_ids"].shape[1]
        tolerance = float32_sums(1e-4)
        rows, largest = [], 0.0
        for i, prompt in enumerate(prompts):
            tokens = out.sequences[i, width:].tolist()
            scores = [step[i] for step in out.scores]
            want_tokens, want_scores = reference_greedy_steps(model, prompt.to(device), GREEDY_NEW_TOKENS)
            difference = max(float((g - w).abs().max()) for g, w in zip(scores, want_scores))
            largest = max(largest, difference)
            first_mismatch = next((s for s, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b), None)
            tie = first_mismatch is not None and float(
                want_scores[first_mismatch][want_tokens[first_mismatch]]
                - want_scores[first_mismatch][tokens[first_mismatch]]) <= tolerance.atol
            compared = slice(None) if first_mismatch is None else slice(0, first_mismatch + 1)
            scores_close = all(float((g - w).abs().max()) <= tolerance.atol
                               for g, w in list(zip(scores, want_scores))[compared])
            rows.append({"same_tokens": first_mismatch is None, "tie_at_step": first_mismatch if tie else None,
                         "exact": scores_close and (first_mismatch is None or tie)})
    return {"scores_atol": tolerance.atol, "max_abs_score_difference": largest, "rows": rows,
            "exact": all(row["exact"] for row in rows)}


def check_bf16_gradients(pair: ModelPair, plan: Plan) -> dict:
    """Each group's bf16 gradient against a float32 step on the same (bf16-representable) weights and batch."""
    batch = training_batch(*plan.gradient_batch, pair.size.get_text_config().vocab_size, pair.device)
    result = {"batch": dict(zip(("batch_size", "prompt_length", "answer_length"), plan.gradient_batch))}
    for name, model in pair.both().items():
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if "lora_B" in parameter_name:  # zero at init, which would leave A without gradient
                    parameter.normal_(std=0.01)
        gradients = {}
        for dtype in (torch.bfloat16, torch.float32):
            model.to(dtype).train().zero_grad(set_to_none=True)
            model(**batch).loss.backward()
            gradients[dtype] = {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)
        model.to(torch.bfloat16)
        agreement = gradient_agreement(gradients[torch.bfloat16], gradients[torch.float32])
        if name == "lora":
            agreement = {"lora weights": agreement["causal weights"]}
        result[name] = agreement
    return result


def peak_tflops(args: argparse.Namespace) -> tuple[float | None, str]:
    if args.peak_tflops is not None:
        return args.peak_tflops, "--peak_tflops"
    if args.device.type == "cuda":
        device_name = torch.cuda.get_device_name(args.device)
        for key, value in BF16_DENSE_PEAK_TFLOPS.items():
            if key in device_name:
                return value, f"data sheet, bf16 dense, {key}"
    return None, "unknown: pass --peak_tflops"


def check_speed(pair: ModelPair, plan: Plan, clock: Clock, peak: float | None,
                budget_left: Callable[[], bool]) -> dict:
    """Training step without and with checkpointing, prefill and decoding: Bitune over LoRA in the same run."""
    result: dict = {"train": {}, "generation": {}}
    model_flops = None
    for checkpointing in (False, True):
        key = "checkpointing" if checkpointing else "no_checkpointing"
        if not budget_left():
            result["train"][key] = {"skipped": "time budget"}
            continue
        if checkpointing:
            for model in pair.both().values():
                compat.enable_checkpointing(model.base_model.model, use_reentrant=False)
        cell = measure_training(pair, plan.train_cell, plan.policy, clock)
        if model_flops is None:  # the model's FLOPs are those without recomputation
            model_flops = {"lora": cell["lora_linear_flops"], "bitune": cell["bitune_linear_flops"]}
        cell["time_ratio_median"] = cell["time"]["median_ratio"]
        seconds = {"lora": cell["time"]["denominator_median_s"], "bitune": cell["time"]["numerator_median_s"]}
        cell["achieved_linear_tflops"] = {m: model_flops[m] / seconds[m] / 1e12 for m in seconds}
        cell["model_flop_utilisation"] = {m: (None if peak is None else v / peak)
                                          for m, v in cell["achieved_linear_tflops"].items()}
        result["train"][key] = cell
    for batch_size in plan.generation_batches:
        if not budget_left():
            result["generation"][f"batch_{batch_size}"] = {"skipped": "time budget"}
            continue
        cell = GenerationCell(batch_size, plan.generation_prompt, plan.new_tokens)
        result["generation"][f"batch_{batch_size}"] = measure_generation(pair, cell, plan.policy, clock)
    return result


def check_attention_kernels(pair: ModelPair, plan: Plan) -> dict:
    """The SDPA backend of each of Bitune's passes, in training (with and without padding) and in generation."""
    model, device = pair.bitune, pair.device
    text = pair.size.get_text_config()
    layers, vocab = text.num_hidden_layers, text.vocab_size
    batch_size, prompt, answer = plan.memory_batch
    unpadded = training_batch(batch_size, prompt, answer, vocab, device)
    padded = collate_right_padded(
        [(row[: prompt + answer - 7 * i], prompt - 5 * i) for i, row in enumerate(unpadded["input_ids"].cpu())],
        device)
    model.train()
    result = {}
    for name, batch in (("training_without_padding", unpadded), ("training_with_padding", padded)):
        calls = sdpa_backends.recorded_calls(lambda batch=batch: model(**batch).loss.backward())
        model.zero_grad(set_to_none=True)
        result[name] = sdpa_backends.bitune_training_passes(calls, layers)
    model.eval()
    prompts = {key: unpadded[key][:, :prompt] for key in ("input_ids", "attention_mask")}
    with torch.no_grad():
        calls = sdpa_backends.recorded_calls(lambda: model.generate(
            **prompts, max_new_tokens=plan.new_tokens, min_new_tokens=plan.new_tokens, do_sample=False,
            pad_token_id=0))
    result["generation"] = sdpa_backends.bitune_generation_passes(calls, layers, plan.new_tokens)
    result["math_fallback_in"] = [f"{run}/{part}" for run, parts in result.items() for part, seen in parts.items()
                                  if seen["math_fallback"]]
    return result


def check_flash_attention_2(pair: ModelPair, plan: Plan) -> dict:
    """If `flash_attn` imports: a Bitune training step and `generate` with `attn_implementation="flash_attention_2"`
    on the same weights, against SDPA's loss."""
    if importlib.util.find_spec("flash_attn") is None:
        return {"importable": False}
    import flash_attn

    result = {"importable": True, "version": getattr(flash_attn, "__version__", None)}
    if pair.device.type != "cuda":
        return {**result, "runs": False, "error": "flash attention runs on CUDA only"}
    flash = copy.deepcopy(pair.bitune)
    try:
        flash.base_model.model.set_attn_implementation("flash_attention_2")
        text = pair.size.get_text_config()
        batch = training_batch(*plan.memory_batch, text.vocab_size, pair.device)
        losses = {}
        for name, model in (("sdpa", pair.bitune), ("flash_attention_2", flash)):
            model.train()
            losses[name] = float(model(**batch).loss)
        flash.eval()
        with torch.no_grad():
            flash.generate(input_ids=batch["input_ids"][:, : plan.memory_batch[1]], max_new_tokens=4, pad_token_id=0)
        return {**result, "runs": True, "loss": losses,
                "loss_relative_difference": abs(losses["flash_attention_2"] - losses["sdpa"]) / abs(losses["sdpa"])}
    except Exception as error:  # reported, not raised: the other parts still count
        return {**result, "runs": False, "error": f"{type(error).__name__}: {error}"[:500]}
    finally:
        del flash


def check_memory(config, plan: Plan, device: torch.device) -> dict:
    """Peak bytes of a training step with checkpointing, per method (benchmarks/training_memory.py's steps)."""
    result = {"batch": dict(zip(("batch_size", "prompt_length", "answer_length"), plan.memory_batch)),
              "dtype": "bfloat16", "checkpointing": True, "peak_bytes": {}, "not_measured": {}}
    for method in training_memory.METHODS:
        if method in training_memory.FUSED_HEAD_METHODS:
            try:
                import trl.trainer.utils  # noqa: F401  (the loss as SFTTrainer computes it, through TRL's fused head)
            except Exception as error:  # not installed, or its own needs are not: the other methods still count
                reason = f"trl does not import ({type(error).__name__}: {error}); carry its wheels"
                result["not_measured"][method] = reason
                continue
        result["peak_bytes"][method] = training_memory.measure_method(
            config, method, True, plan.memory_batch, device, torch.bfloat16, skip_arithmetic=device.type == "cpu")
        free_memory()
    peaks = result["peak_bytes"]
    if "bitune" in peaks:  # measured unless TRL is missing, and then neither is LoRA's fused-head step
        result["bitune_over_lora"] = peaks["bitune"] / peaks["lora"]
        result["bitune_over_lora_full_logits"] = peaks["bitune"] / peaks["lora_full_logits"]
    return result


# ---------------------------------------------------------------------------------------------- the run
def run_shape(name: str, config, args: argparse.Namespace, plan: Plan, budget: Budget, clock: Clock,
              peak: float | None, log: Callable[[str], None]) -> dict:
    device = args.device
    log(f"{name}:")
    shape = {"parameters": parameter_count(config), "num_hidden_layers": config.get_text_config().num_hidden_layers}
    shape["exactness"] = budget.run("exactness", lambda: check_exactness(config, device), log)
    shape.update(pair_parts(config, device, plan, budget, clock, peak, log))
    free_memory()  # the pair is gone
    shape["memory"] = budget.run("memory", lambda: check_memory(config, plan, device), log)
    return shape


def pair_parts(config, device: torch.device, plan: Plan, budget: Budget, clock: Clock, peak: float | None,
               log: Callable[[str], None]) -> dict:
    """The parts that share one bf16 LoRA/Bitune pair (freed on return)."""
    pair = build_pair(config, device, torch.bfloat16, "sdpa")
    shape = {"bf16_gradients": budget.run("bf16_gradients", lambda: check_bf16_gradients(pair, plan), log),
             "attention_kernels": budget.run("attention_kernels", lambda: check_attention_kernels(pair, plan), log),
             "flash_attention_2": budget.run("attention_kernels", lambda: check_flash_attention_2(pair, plan), log)}
    deadline = time.perf_counter() + budget.remaining("speed")
    shape["speed"] = budget.run(
        "speed", lambda: check_speed(pair, plan, clock, peak, lambda: time.perf_counter() < deadline), log)
    return shape


def environment(args: argparse.Namespace) -> dict:
    flash = importlib.util.find_spec("flash_attn") is not None
    trl_spec = importlib.util.find_spec("trl")
    result = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
              "trl": None, "python": sys.version.split()[0], "machine": platform.machine(),
              "device": str(args.device), "flash_attn_importable": flash}
    if trl_spec is not None:
        from importlib.metadata import version

        result["trl"] = version("trl")
    if args.device.type == "cuda":
        result.update(device_name=torch.cuda.get_device_name(args.device), cuda=torch.version.cuda,
                      device_memory_bytes=torch.cuda.get_device_properties(args.device).total_memory)
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (the default) or cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks that every part runs")
    parser.add_argument("--json", type=Path, help="write every result to this JSON file")
    parser.add_argument("--peak_tflops", type=float, help="the device's bf16 dense peak (default: from its name)")
    parser.add_argument("--memory_gib", type=float,
                        help="memory the run may use (default: what the device has free); a shape that needs more is "
                             "refused before anything is built")
    args = parser.parse_args(argv)
    try:
        args.device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device must be cuda or cpu, got {args.device!r}.")
    if args.device.type not in ("cuda", "cpu"):
        parser.error(f"--device must be cuda or cpu, got {args.device!r}.")
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json: the folder {args.json.parent} does not exist; create it or write elsewhere.")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    plan = Plan(args.smoke)
    reason = refusal(args, plan)
    if reason:
        sys.exit(reason)
    start = time.perf_counter()
    if args.device.type == "cpu":
        torch.set_num_threads(1)  # threads of one process on a shared CPU wait at every barrier (benchmarks/README)
    clock = Clock("cuda_events" if args.device.type == "cuda" else "wall", args.device)
    peak, peak_source = peak_tflops(args)
    budget = Budget(BUDGETS_S)
    report = {
        "settings": {"smoke": args.smoke, "shapes": [name for name, _ in plan.configs()], "dtype": "bfloat16",
                     "exactness_dtype": "float32", "attn_implementation": "sdpa", "lora_rank": lora_config().r,
                     "train_cell": vars(plan.train_cell), "generation_prompt_length": plan.generation_prompt,
                     "generation_batches": list(plan.generation_batches), "new_tokens": plan.new_tokens,
                     "memory_batch": list(plan.memory_batch), "clock": clock.kind,
                     "budgets_s": BUDGETS_S},
        "environment": environment(args),
        "peak_bf16_tflops": peak,
        "peak_source": peak_source,
        "shapes": {},
    }
    for name, config in plan.configs():
        report["shapes"][name] = run_shape(name, config, args, plan, budget, clock, peak,
                                           lambda line: print(line, flush=True))
    report["seconds_per_part"] = budget.spent
    report["elapsed_s"] = time.perf_counter() - start
    report["summary"] = summary(report)
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


def summary(report: dict) -> dict:
    """The answers: exact everywhere, any math fallback, any part cut short."""
    shapes = report["shapes"].values()
    return {
        "exact": all(s["exactness"].get("exact", False) for s in shapes),
        "math_fallbacks": {name: s["attention_kernels"].get("math_fallback_in")
                           for name, s in report["shapes"].items()},
        "skipped": [f"{name}/{part}" for name, s in report["shapes"].items() for part in PARTS
                    if "skipped" in s.get(part, {})]
        + [f"{name}/speed/{kind}/{cell}" for name, s in report["shapes"].items()
           for kind in ("train", "generation") for cell, result in s.get("speed", {}).get(kind, {}).items()
           if "skipped" in result],
    }


def table(report: dict) -> str:
    def number(value, fmt="{:.2f}"):
        return "-" if value is None else fmt.format(value)

    lines = ["shape                     exact  train x (ckpt)  flops x  MFU lora/bitune  prefill x b1/b16  "
             "decode x b1/b16  mem x (ckpt)  math fallback"]
    for name, shape in report["shapes"].items():
        speed = shape.get("speed", {})
        train = speed.get("train", {}).get("no_checkpointing", {})
        ckpt = speed.get("train", {}).get("checkpointing", {})
        generation = speed.get("generation", {})
        mfu = train.get("model_flop_utilisation", {})
        prefill = "/".join(number(generation.get(f"batch_{b}", {}).get("prefill", {}).get("median_ratio"))
                           for b in report["settings"]["generation_batches"])
        decode = "/".join(number(generation.get(f"batch_{b}", {}).get("decode", {}).get("median_ratio"))
                          for b in report["settings"]["generation_batches"])
        lines.append(
            f"{name:25} {str(shape['exactness'].get('exact', '-')):6} "
            f"{number(train.get('time_ratio_median'))} ({number(ckpt.get('time_ratio_median'))})     "
            f"{number(train.get('linear_flop_ratio')):7}  {number(mfu.get('lora'), '{:.3f}')}/"
            f"{number(mfu.get('bitune'), '{:.3f}'):9}  {prefill:16}  {decode:15}  "
            f"{number(shape.get('memory', {}).get('bitune_over_lora')):12}  "
            f"{shape.get('attention_kernels', {}).get('math_fallback_in', '-')}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
