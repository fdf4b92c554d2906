"""
Answers of a plain-LoRA-tuned and a Bitune-tuned model to the same prompts, side by side in Markdown (paper, A.13).

Real use, with a base model and two adapters trained from it (the base is loaded once; the LoRA adapter is unloaded
before the Bitune adapter is loaded, so only one copy of the base model is ever in memory):

    python examples/compare_answers.py --model_name_or_path google/gemma-2b \
        --lora_adapter runs/lora --bitune_adapter runs/bitune \
        --prompts gsm8k_questions.jsonl --template $'Question: {prompt}\nAnswer:' --output answers.md

Without arguments it runs offline: it builds a character-level tokenizer and a tiny random Llama, tunes a LoRA copy
and a Bitune copy of it for a few seconds with TRL (`SFTTrainer` and `BituneSFTTrainer`) on a toy task (sort the
digits of a number), and compares their answers.
That demo shows the tool working end to end, not the method's quality: the base model knows nothing.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import random
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

import peft_bitune  # noqa: F401  (registers the BITUNE peft type, needed to load a Bitune adapter)
from peft_bitune import BituneConfig, compat
from trl_integration import BituneSFTConfig, BituneSFTTrainer


# ---------------------------------------------------------------------------------------------------- Markdown
def markdown_cell(text: str) -> str:
    """One table cell: HTML escaped, `|` escaped, newlines as `<br>`, so any model output keeps the table intact."""
    text = html.escape(text.strip(), quote=False).replace("|", "\\|")
    return "<br>".join(text.splitlines()) or "*(empty)*"


def side_by_side_markdown(
    prompts: Sequence[str], lora_answers: Sequence[str], bitune_answers: Sequence[str], header: str = ""
) -> str:
    """A Markdown document: for each prompt, the prompt as a quote and a two-column table LoRA | Bitune."""
    if not len(prompts) == len(lora_answers) == len(bitune_answers):
        raise ValueError(
            f"Got {len(prompts)} prompts, {len(lora_answers)} LoRA answers and {len(bitune_answers)} Bitune answers."
        )
    parts = ["# LoRA and Bitune answers, side by side\n"]
    if header:
        parts.append(header + "\n")
    for number, (prompt, lora, bitune) in enumerate(zip(prompts, lora_answers, bitune_answers), start=1):
        quoted = "\n".join(f"> {html.escape(line, quote=False)}" for line in prompt.splitlines() or [""])
        parts.append(
            f"## Prompt {number}\n\n{quoted}\n\n| LoRA | Bitune |\n| --- | --- |\n"
            f"| {markdown_cell(lora)} | {markdown_cell(bitune)} |\n"
        )
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------------- generation
@torch.no_grad()
def generate_answers(
    model: Any, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int, batch_size: int = 8
) -> list[str]:
    """Greedy answers to `prompts` (left-padded batches, as Bitune generation requires); only the new tokens."""
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    answers = []
    model.eval()
    for start in range(0, len(prompts), batch_size):
        batch = tokenizer(list(prompts[start : start + batch_size]), return_tensors="pt", padding=True).to(device)
        output = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        new_tokens = output[:, batch["input_ids"].shape[1] :]
        answers.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
    return answers


# ---------------------------------------------------------------------------------------------------- offline demo
DEMO_CHARACTERS = list(" 0123456789abcdefghijklmnopqrstuvwxyz:?+=.,")
DEMO_SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def build_char_tokenizer(directory: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer built locally (nothing downloaded), saved to and loaded back from `directory`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(list(DEMO_SPECIAL_TOKENS.values()) + DEMO_CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=DEMO_SPECIAL_TOKENS["unk_token"]))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=backend, **DEMO_SPECIAL_TOKENS).save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


def build_tiny_model(tokenizer: Any, seed: int, num_layers: int = 4) -> torch.nn.Module:
    """
    A tiny random Llama sized for the tokenizer, with eager attention (attention maps need it anyway).

    The wide initialisation matters: with the usual 0.02, a frozen LM head after RMSNorm cannot produce logits large
    enough for any adapter to fit the task.
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.2,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def toy_example(rng: random.Random) -> tuple[str, str]:
    """Sort the digits of a number: prompt 'sort 3142:', answer ' 1234' (the answer starts with a space, A.10)."""
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
    return f"sort {digits}:", " " + "".join(sorted(digits))


def toy_rows(count: int, seed: int) -> Dataset:
    """Prompt-completion rows of the toy task, the format TRL's trainers and collator read."""
    rng = random.Random(seed)
    return Dataset.from_list([dict(zip(("prompt", "completion"), toy_example(rng))) for _ in range(count)])


def tune(model: PeftModel, tokenizer: Any, steps: int, seed: int, batch_size: int = 16, lr: float = 1e-2) -> float:
    """
    A few optimizer steps on the toy task with TRL's SFT pipeline (tokenization, EOS, its collator, AdamW): the Bitune
    model with `BituneSFTTrainer`, the LoRA model with TRL's own `SFTTrainer`. Both see the same rows in the same
    order. Returns the last training loss.
    """
    is_bitune = isinstance(model.peft_config[model.active_adapter], BituneConfig)
    trainer_class, config_class = (BituneSFTTrainer, BituneSFTConfig) if is_bitune else (SFTTrainer, SFTConfig)
    with tempfile.TemporaryDirectory(prefix="bitune_demo_run_") as output_dir:
        args = config_class(
            output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch_size, learning_rate=lr,
            lr_scheduler_type="constant", weight_decay=0.0, seed=seed, data_seed=seed, logging_steps=1,
            bf16=False, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
            dataset_num_proc=None, **{compat.CHECKPOINTING_ARGUMENT: False},
        )
        trainer = trainer_class(
            model=model, args=args, train_dataset=toy_rows(steps * batch_size, seed), processing_class=tokenizer
        )
        trainer.train()
    model.eval()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return float(losses[-1]) if losses else float("nan")


@dataclass
class DemoModels:
    tokenizer: Any
    lora: PeftModel
    bitune: PeftModel
    prompts: list[str]
    losses: dict[str, float]


def train_demo_model(method: str, tokenizer: Any, steps: int, seed: int) -> tuple[PeftModel, float]:
    """
    The tiny base tuned on the toy task with `method` ("lora" or "bitune", same LoRA settings); and its last loss.
    """
    adapter_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    configs = {"lora": adapter_config, "bitune": BituneConfig(adapter_config=adapter_config)}
    if method not in configs:
        raise ValueError(f"`method` must be 'lora' or 'bitune', got {method!r}.")
    model = get_peft_model(build_tiny_model(tokenizer, seed), configs[method])
    return model, tune(model, tokenizer, steps, seed)


def train_demo_models(steps: int = 100, seed: int = 0, workdir: str | None = None, num_prompts: int = 4) -> DemoModels:
    """The offline demo: one tiny random base, tuned once with plain LoRA and once with Bitune."""
    workdir = workdir or tempfile.mkdtemp(prefix="bitune_demo_")
    tokenizer = build_char_tokenizer(os.path.join(workdir, "tokenizer"))
    lora, lora_loss = train_demo_model("lora", tokenizer, steps, seed)
    bitune, bitune_loss = train_demo_model("bitune", tokenizer, steps, seed)
    losses = {"lora": lora_loss, "bitune": bitune_loss}
    rng = random.Random(seed + 1)
    prompts = [toy_example(rng)[0] for _ in range(num_prompts)]
    return DemoModels(tokenizer, lora, bitune, prompts, losses)


# ---------------------------------------------------------------------------------------------------- real models
def read_prompts(path: str, field: str) -> list[str]:
    """Prompts from a `.jsonl` file (one object per line, text under `field`) or a text file (one prompt a line)."""
    with open(path, encoding="utf-8") as file:
        lines = [line for line in file.read().splitlines() if line.strip()]
    if not path.endswith(".jsonl"):
        return lines
    prompts = []
    for number, line in enumerate(lines, start=1):
        record = json.loads(line)
        if field not in record:
            raise ValueError(
                f"{path}, line {number}: no `{field}` field (set `--prompt_field`); keys: {sorted(record)}."
            )
        prompts.append(str(record[field]))
    return prompts


def compare_real_models(args: argparse.Namespace, prompts: list[str]) -> tuple[list[str], list[str]]:
    """Generate with the LoRA adapter, unload it, then generate with the Bitune adapter on the same base model."""
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    base = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=args.dtype, device_map=args.device)
    lora = PeftModel.from_pretrained(base, args.lora_adapter)
    lora_answers = generate_answers(lora, tokenizer, prompts, args.max_new_tokens, args.batch_size)
    base = lora.unload()
    bitune = PeftModel.from_pretrained(base, args.bitune_adapter)
    bitune_answers = generate_answers(bitune, tokenizer, prompts, args.max_new_tokens, args.batch_size)
    return lora_answers, bitune_answers


# ---------------------------------------------------------------------------------------------------- command line
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    real = parser.add_argument_group("real models (all three or none: without them the offline demo runs)")
    real.add_argument("--model_name_or_path", help="The base model both adapters were trained from.")
    real.add_argument("--lora_adapter", help="Directory (or Hub id) of the plain LoRA adapter.")
    real.add_argument("--bitune_adapter", help="Directory (or Hub id) of the Bitune adapter.")
    real.add_argument("--tokenizer", help="Tokenizer to use; defaults to the base model's.")
    real.add_argument("--dtype", default="auto", help="dtype to load the base model in (default: auto).")
    real.add_argument("--device", default=None, help="`device_map` for the base model, e.g. 'cuda' or 'auto'.")
    prompts = parser.add_argument_group("prompts")
    prompts.add_argument("--prompts", help="A .jsonl file (see --prompt_field) or a text file with one prompt a line.")
    prompts.add_argument("--prompt_field", default="prompt", help="Field of each .jsonl record holding the prompt.")
    prompts.add_argument("--prompt", action="append", default=[], help="A prompt; repeat for several.")
    prompts.add_argument("--template", default="{prompt}", help="Wraps every prompt; must contain '{prompt}'.")
    parser.add_argument(
        "--max_new_tokens", type=int, default=None, help="Default: 128 with real models, 12 in the offline demo."
    )
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--output", default="compare_answers.md", help="Markdown file to write; '-' for stdout.")
    demo = parser.add_argument_group("offline demo")
    demo.add_argument("--demo_steps", type=int, default=100, help="Training steps of each demo model.")
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    given = [name for name in ("model_name_or_path", "lora_adapter", "bitune_adapter") if getattr(args, name)]
    if given and len(given) != 3:
        parser.error(
            "Pass all of --model_name_or_path, --lora_adapter and --bitune_adapter (or none, for the offline demo); "
            f"got only {', '.join('--' + name for name in given)}."
        )
    args.demo = not given
    if "{prompt}" not in args.template:
        parser.error(f"--template must contain '{{prompt}}', got {args.template!r}.")
    if args.max_new_tokens is None:
        args.max_new_tokens = 12 if args.demo else 128
    if args.max_new_tokens < 1 or args.batch_size < 1 or args.demo_steps < 0:
        parser.error("--max_new_tokens and --batch_size must be positive and --demo_steps non-negative.")
    if not args.demo and not (args.prompts or args.prompt):
        parser.error("With real models, pass the prompts: --prompts FILE or --prompt TEXT (repeatable).")
    if args.prompts and not os.path.isfile(args.prompts):
        parser.error(f"--prompts {args.prompts}: no such file.")
    if args.output != "-" and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        parser.error(f"--output {args.output}: its directory does not exist.")
    return args


def main(argv: Sequence[str] | None = None) -> str:
    """Run the comparison and write the Markdown; returns it too."""
    args = parse_args(argv)
    prompts = list(args.prompt)
    if args.prompts:
        prompts += read_prompts(args.prompts, args.prompt_field)
    if args.demo:
        # The demo model is tiny: one thread avoids thread hand-off costs that dominate at this size.
        torch.set_num_threads(1)
        demo = train_demo_models(steps=args.demo_steps, seed=args.seed)
        prompts = prompts or demo.prompts
        prompts = [args.template.replace("{prompt}", prompt) for prompt in prompts]
        lora_answers = generate_answers(demo.lora, demo.tokenizer, prompts, args.max_new_tokens, args.batch_size)
        bitune_answers = generate_answers(demo.bitune, demo.tokenizer, prompts, args.max_new_tokens, args.batch_size)
        header = (
            f"Offline demo: a tiny random Llama with a character-level tokenizer, tuned for {args.demo_steps} steps "
            f"to sort digits (final training loss: LoRA {demo.losses['lora']:.3f}, "
            f"Bitune {demo.losses['bitune']:.3f}). Greedy decoding."
        )
    else:
        prompts = [args.template.replace("{prompt}", prompt) for prompt in prompts]
        lora_answers, bitune_answers = compare_real_models(args, prompts)
        header = (
            f"Base model `{args.model_name_or_path}`; LoRA adapter `{args.lora_adapter}`; Bitune adapter "
            f"`{args.bitune_adapter}`. Greedy decoding, at most {args.max_new_tokens} new tokens."
        )
    markdown = side_by_side_markdown(prompts, lora_answers, bitune_answers, header)
    if args.output == "-":
        sys.stdout.write(markdown)
    else:
        with open(args.output, "w", encoding="utf-8") as file:
            file.write(markdown)
        print(f"Wrote {len(prompts)} side-by-side answers to {args.output}")
    return markdown


if __name__ == "__main__":
    main()
