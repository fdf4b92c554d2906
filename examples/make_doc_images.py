"""
Make the pictures in docs/images/ offline: one attention-map figure and one mixing-coefficients figure of a Bitune
model, drawn with `peft_bitune.visualize` (needs the `viz` extra).

The model is the offline demo of `compare_answers.py`: a tiny random Llama with a character-level tokenizer, tuned
with Bitune for a few seconds to sort the digits of a number. The pictures show what the functions draw (the causal
map is lower-triangular, the bidirectional one is not; one alpha per layer for keys and for values), not what a real
tuned LLM learns. For a real model:

    from peft_bitune.visualize import plot_prompt_attention, plot_mixing_coefficients
    plot_prompt_attention(model, tokenizer, "Natalia sold clips to 48 of her friends...", path="attention.png")
    plot_mixing_coefficients("runs/bitune", path="mixing.png")     # a saved adapter directory, or the model

Run: python examples/make_doc_images.py [--output_dir docs/images] [--steps 100]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare_answers import build_char_tokenizer, train_demo_model  # noqa: E402

from peft_bitune.visualize import attention_maps, plot_attention_maps, plot_mixing_coefficients  # noqa: E402

ATTENTION_IMAGE = "attention_maps.png"
MIXING_IMAGE = "mixing_coefficients.png"
DEMO_PROMPT = "sort 8301957:"


def main(argv: Sequence[str] | None = None) -> list[str]:
    """Write both images; returns their paths."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "docs", "images")
    parser.add_argument("--output_dir", default=os.path.normpath(default_dir))
    parser.add_argument("--steps", type=int, default=100, help="Bitune training steps of the demo model.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 0:
        parser.error(f"--steps must be non-negative, got {args.steps}.")
    os.makedirs(args.output_dir, exist_ok=True)
    # The demo model is tiny: one thread avoids thread hand-off costs that dominate at this size.
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="bitune_doc_images_") as workdir:
        tokenizer = build_char_tokenizer(os.path.join(workdir, "tokenizer"))
        bitune, _ = train_demo_model("bitune", tokenizer, args.steps, args.seed)
        batch = tokenizer(DEMO_PROMPT, return_tensors="pt")
        maps = attention_maps(bitune, batch["input_ids"], batch["attention_mask"])
        attention_path = os.path.join(args.output_dir, ATTENTION_IMAGE)
        plot_attention_maps(
            maps,
            tokenizer=tokenizer,
            path=attention_path,
            title=f"Prompt {DEMO_PROMPT!r} (the prompt passes read all of it but the last token)",
        )
        # Through the saved adapter, the way a finished training run is usually inspected.
        adapter_dir = os.path.join(workdir, "bitune_adapter")
        bitune.save_pretrained(adapter_dir)
        mixing_path = os.path.join(args.output_dir, MIXING_IMAGE)
        plot_mixing_coefficients(adapter_dir, path=mixing_path, title="Learned mixing coefficients (demo model)")
    for path in (attention_path, mixing_path):
        print(f"Wrote {path}")
    return [attention_path, mixing_path]


if __name__ == "__main__":
    main()
