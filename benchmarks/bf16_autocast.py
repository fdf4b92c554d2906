"""
Is bfloat16 autocast worth it for training on this CPU? A LoRA and a Bitune training step (forward + backward) on the
shape of SmolLM2-135M-Instruct, in float32 and under `torch.autocast("cpu", dtype=torch.bfloat16)`, timed in
interleaved rounds; and how far the bf16 loss and gradients are from float32's on the same batch.

    python benchmarks/bf16_autocast.py --json bf16.json          # ~5 minutes on one core
    python benchmarks/bf16_autocast.py --base <folder>          # real weights (e.g. examples/smollm2/load.py's)

It reports, per method, `speedup` (float32 step time over bf16 step time, from the fastest run of each), the relative
difference of the loss, and, for each group of trainable parameters (LoRA's weights; Bitune's causal weights,
bidirectional weights and mixing scalars), the cosine similarity and norm ratio of its gradient against a float64
reference of the same step. A CPU without native bf16 instructions (`avx512_bf16`, `amx_bf16`) emulates them and is
slower in bf16. `--second_pass_attention causal` runs Bitune's ablation with a causal second pass instead.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
from pathlib import Path

import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from measure import Clock, Ratio, RoundPolicy, interleaved_rounds
from models import MODEL_SIZES, lora_config, training_batch
from peft_bitune import BituneConfig


def cpu_flags() -> list[str]:
    """The bf16-related instruction sets this CPU reports (Linux only; empty elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return []
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("flags")), [])
    return sorted(flag for flag in flags if "bf16" in flag or flag.startswith("amx"))


def step(model, batch, precision: str) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward + backward in `precision` ("fp32", "bf16" autocast, or "fp64"); returns the loss and the
    gradients by parameter name."""
    model.to(torch.float64 if precision == "fp64" else torch.float32)
    model.zero_grad(set_to_none=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with autocast:
        loss = model(**batch).loss
    loss.backward()
    gradients = {name: p.grad.detach().double() for name, p in model.named_parameters() if p.grad is not None}
    model.to(torch.float32)
    return float(loss.detach()), gradients


def parameter_group(name: str) -> str:
    if "mix" in name:
        return "mixing scalars"
    return "bidirectional weights" if "bidirectional" in name else "causal weights"


def gradient_agreement(gradients: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict:
    """Per parameter group: cosine similarity and norm ratio of the flattened gradient against the reference."""
    agreement = {}
    for group in sorted({parameter_group(name) for name in reference}):
        names = [name for name in reference if parameter_group(name) == group]
        actual = torch.cat([gradients[name].flatten() for name in names])
        expected = torch.cat([reference[name].flatten() for name in names])
        agreement[group] = {"cosine": float(torch.nn.functional.cosine_similarity(actual, expected, dim=0)),
                            "norm_ratio": float(actual.norm() / expected.norm())}
    return agreement


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="a saved model folder (default: random weights of the `--model` shape)")
    parser.add_argument("--model", default="smollm2", choices=list(MODEL_SIZES), help="the random shape (models.py)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--answer", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--second_pass_attention", default="bidirectional", choices=["bidirectional", "causal"])
    parser.add_argument("--lora_b_std", type=float, default=0.01,
                        help="LoRA's B starts at zero, which leaves A without gradient; draw it from N(0, std) so "
                             "that every weight has one, as after some training")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.base:
        base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    else:
        base = AutoModelForCausalLM.from_config(MODEL_SIZES[args.model].llama_config(), dtype=torch.float32)
    vocab_size = base.config.vocab_size
    models = {"lora": get_peft_model(copy.deepcopy(base), lora_config()),
              "bitune": get_peft_model(base, BituneConfig(adapter_config=lora_config(),
                                                          second_pass_attention=args.second_pass_attention))}
    for model in models.values():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(parameter, std=args.lora_b_std)
    batch = training_batch(args.batch, args.prompt, args.answer, vocab_size, torch.device("cpu"))
    clock = Clock("cpu" if args.threads == 1 else "wall", torch.device("cpu"))
    policy = RoundPolicy(args.rounds, args.rounds, 0.0)
    report = {"settings": vars(args), "cpu_flags": cpu_flags(), "torch": torch.__version__,
              "machine": platform.machine(), "methods": {}}
    for name, model in models.items():
        model.train()
        workloads = {precision: (lambda model=model, precision=precision:
                                 {"step": clock.timed(lambda: step(model, batch, precision))})
                     for precision in ("fp32", "bf16")}
        ratio = Ratio.from_rounds(interleaved_rounds(workloads, policy), "fp32/step", "bf16/step")
        losses, gradients = {}, {}
        for precision in ("fp64", "fp32", "bf16"):
            losses[precision], gradients[precision] = step(model, batch, precision)
        model.zero_grad(set_to_none=True)
        report["methods"][name] = {
            "speedup": ratio.value, "fp32_step_s": ratio.numerator_s, "bf16_step_s": ratio.denominator_s,
            "loss": losses,
            "loss_relative_difference_bf16": abs(losses["bf16"] - losses["fp64"]) / abs(losses["fp64"]),
            "gradients_vs_fp64": {precision: gradient_agreement(gradients[precision], gradients["fp64"])
                                  for precision in ("fp32", "bf16")},
        }
        print(f"{name}: fp32 {ratio.numerator_s:.2f} s, bf16 {ratio.denominator_s:.2f} s, speedup {ratio.value:.2f}x; "
              f"loss fp64 {losses['fp64']:.4f}, bf16 {losses['bf16']:.4f}", flush=True)
        for group, agreement in report["methods"][name]["gradients_vs_fp64"]["bf16"].items():
            print(f"    bf16 gradient of the {group}: cosine {agreement['cosine']:.4f}, "
                  f"norm ratio {agreement['norm_ratio']:.3f} (against float64)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
