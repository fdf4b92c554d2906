"""
Make the pictures of docs/visualize.md offline, from the trained miniature: a short Bitune training of the embedded
~1M-parameter model (examples/miniature/base) on the embedded data (examples/miniature/data) with `BituneSFTTrainer`,
then, with `peft_bitune.visualize`:

- attention_maps.png: the attention of the two prompt passes on a prompt of the test split (question before the story,
  so the question can only see the story in the bidirectional pass), averaged over layers and heads;
- mixing_coefficients.png: the learned alpha per layer, from the saved adapter;
- mixing_history.png: the alphas over training, from `trainer.state.log_history`.

The miniature is a toy (see docs/miniature.md); the pictures show what the functions draw on a trained adapter, not
what a large tuned LLM learns. For a real model:

    from peft_bitune.visualize import plot_prompt_attention, plot_mixing_coefficients, plot_mixing_history
    plot_prompt_attention(model, tokenizer, "Natalia sold clips to 48 of her friends...", path="attention.png")
    plot_mixing_coefficients("runs/bitune", path="mixing.png")     # a saved adapter directory, or the model
    plot_mixing_history("runs/bitune/checkpoint-500", path="history.png")  # or trainer.state.log_history

Run: python examples/make_doc_images.py [--output_dir docs/images] [--steps 150]   (a few minutes on one CPU core)
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence

import torch
from datasets import load_dataset
from transformers import AutoTokenizer

from peft_bitune import compat
from peft_bitune.visualize import (
    attention_maps,
    plot_attention_maps,
    plot_mixing_coefficients,
    plot_mixing_history,
)
from trl_integration import BituneSFTConfig, BituneSFTTrainer

EXAMPLES = os.path.dirname(os.path.abspath(__file__))
MINIATURE_BASE = os.path.join(EXAMPLES, "miniature", "base")
MINIATURE_DATA = os.path.join(EXAMPLES, "miniature", "data")
ATTENTION_IMAGE = "attention_maps.png"
MIXING_IMAGE = "mixing_coefficients.png"
HISTORY_IMAGE = "mixing_history.png"
# The test row drawn: a question asked before the story it is about.
PROMPT_ROW = 0


def main(argv: Sequence[str] | None = None) -> list[str]:
    """Train, then write the three images; returns their paths."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=os.path.normpath(os.path.join(EXAMPLES, os.pardir, "docs", "images")))
    parser.add_argument("--steps", type=int, default=150, help="Training steps (the miniature protocol's 150).")
    parser.add_argument("--learning_rate", type=float, default=1e-2, help="Bitune's rate in docs/miniature.md.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be positive, got {args.steps}.")
    if not os.path.isdir(MINIATURE_BASE):
        parser.error(f"The embedded miniature model is missing ({MINIATURE_BASE}); restore it with git.")
    os.makedirs(args.output_dir, exist_ok=True)
    torch.set_num_threads(1)  # the model is tiny: thread hand-offs cost more than they save

    data = load_dataset(MINIATURE_DATA)
    tokenizer = AutoTokenizer.from_pretrained(MINIATURE_BASE, padding_side="left")
    with tempfile.TemporaryDirectory(prefix="bitune_doc_images_") as workdir:
        trainer = BituneSFTTrainer(
            model=MINIATURE_BASE,
            args=BituneSFTConfig(
                output_dir=workdir, max_steps=args.steps, learning_rate=args.learning_rate,
                per_device_train_batch_size=16, lr_scheduler_type="cosine", warmup_steps=10, logging_steps=1,
                mixing_logging_steps=5, seed=args.seed, bf16=False, use_cpu=True, report_to="none",
                save_strategy="no", disable_tqdm=True,
                **{compat.CHECKPOINTING_ARGUMENT: False},  # a tiny model on a CPU: recomputing only costs time
            ),
            train_dataset=data["train"].select_columns(["prompt", "completion"]),
            processing_class=tokenizer,
        )
        trainer.train()
        model = trainer.model.eval()

        prompt = data["test"][PROMPT_ROW]["prompt"]
        batch = tokenizer(prompt, return_tensors="pt")
        maps = attention_maps(model, batch["input_ids"], batch["attention_mask"])
        attention_path = os.path.join(args.output_dir, ATTENTION_IMAGE)
        plot_attention_maps(
            maps, tokenizer=tokenizer, path=attention_path, shared_scale=True,
            title=f"Attention of the two prompt passes: the miniature after {args.steps} steps of Bitune training\n"
                  f"prompt: test row {PROMPT_ROW} of examples/miniature/data (the last token, \":\", is read later)",
        )
        adapter_dir = os.path.join(workdir, "adapter")
        model.save_pretrained(adapter_dir)  # inspected through the saved adapter, as after a finished run
        mixing_path = os.path.join(args.output_dir, MIXING_IMAGE)
        plot_mixing_coefficients(
            adapter_dir, path=mixing_path, title=f"Learned mixing coefficients (miniature, {args.steps} steps)"
        )
        history_path = os.path.join(args.output_dir, HISTORY_IMAGE)
        plot_mixing_history(
            trainer.state.log_history, path=history_path,
            title=(
                "Mixing coefficients during Bitune training of the miniature "
                f"(learning rate {args.learning_rate:g})"
            ),
        )
    for path in (attention_path, mixing_path, history_path):
        print(f"Wrote {path}")
    return [attention_path, mixing_path, history_path]


if __name__ == "__main__":
    main()
