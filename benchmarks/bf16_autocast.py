"""
Is bfloat16 autocast worth it for training on this CPU? A LoRA and a Bitune training step (forward + backward) on the
shape of SmolLM2-135M-Instruct, in float32 and under `torch.autocast("cpu", dtype=torch.bfloat16)`, timed in
interleaved rounds; and how far the bf16 loss and gradients are from float32's on the same batch.

    python benchmarks/bf16_autocast.py --json bf16.json          # ~5 minutes on one core
    python benchmarks/bf16_autocast.py --base <folder>          # real weights (e.g. examples/smollm2/load.py's)

It reports, per method, `speedup` (float32 step time over bf16 step time, from the fastest run of each), the relative
difference of the loss, and the cosine similarity of the flattened trainable gradients between the two precisions.
A CPU without native bf16 instructions (`avx512_bf16`, `amx_bf16`) emulates them and is slower in bf16.
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


def step(model, batch, bf16: bool) -> tuple[float, torch.Tensor]:
    """One forward + backward; returns the loss and the flattened trainable gradients."""
    model.zero_grad(set_to_none=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with autocast:
        loss = model(**batch).loss
    loss.backward()
    gradients = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
    return float(loss), gradients


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="a saved model folder (default: random weights of the SmolLM2 shape)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--answer", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.base:
        base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    else:
        base = AutoModelForCausalLM.from_config(MODEL_SIZES["smollm2"].llama_config(), dtype=torch.float32)
    vocab_size = base.config.vocab_size
    models = {"lora": get_peft_model(copy.deepcopy(base), lora_config()),
              "bitune": get_peft_model(base, BituneConfig(adapter_config=lora_config()))}
    batch = training_batch(args.batch, args.prompt, args.answer, vocab_size, torch.device("cpu"))
    clock = Clock("cpu" if args.threads == 1 else "wall", torch.device("cpu"))
    policy = RoundPolicy(args.rounds, args.rounds, 0.0)
    report = {"settings": vars(args), "cpu_flags": cpu_flags(), "torch": torch.__version__,
              "machine": platform.machine(), "methods": {}}
    for name, model in models.items():
        model.train()
        workloads = {precision: (lambda model=model, bf16=precision == "bf16":
                                 {"step": clock.timed(lambda: step(model, batch, bf16))})
                     for precision in ("fp32", "bf16")}
        ratio = Ratio.from_rounds(interleaved_rounds(workloads, policy), "fp32/step", "bf16/step")
        loss32, grad32 = step(model, batch, bf16=False)
        loss16, grad16 = step(model, batch, bf16=True)
        report["methods"][name] = {
            "speedup": ratio.value, "fp32_step_s": ratio.numerator_s, "bf16_step_s": ratio.denominator_s,
            "loss_fp32": loss32, "loss_bf16": loss16, "loss_relative_difference": abs(loss16 - loss32) / abs(loss32),
            "gradient_cosine": float(torch.nn.functional.cosine_similarity(grad32, grad16, dim=0)),
        }
        model.zero_grad(set_to_none=True)
        print(f"{name}: fp32 {ratio.numerator_s:.2f} s, bf16 {ratio.denominator_s:.2f} s, speedup {ratio.value:.2f}x; "
              f"loss {loss32:.4f} vs {loss16:.4f}, gradient cosine {report['methods'][name]['gradient_cosine']:.4f}",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
