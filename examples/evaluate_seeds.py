"""
Train and evaluate Bitune and plain LoRA over several seeds; print mean ± std per task and on average (paper, A.11).

Per-task finetuning as in the paper: for every task, seed and method, a fresh adapter is trained on the task's training
split written in the paper's format (`peft_bitune.evaluation.tasks`) and evaluated on the harness task `bitune_<task>`,
which uses the same format. Bitune trains with `BituneSFTTrainer` and is scored by the harness model `bitune`; LoRA
trains with TRL's `SFTTrainer` (same LoRA settings, one weight set) and is scored by the harness's `hf` model. The
table reports accuracy (exact match of the final number for GSM8K) in percent: the mean over seeds ± the sample
standard deviation; "Average" is the mean over tasks of each seed, then mean ± std over seeds.

    python examples/evaluate_seeds.py --model_name_or_path google/gemma-2b \
        --tasks piqa arc_challenge csqa siqa gsm8k --seeds 0 1 2 --output results.json

(MMLU has no training split; the paper evaluated it zero-shot after instruction tuning.)

With `--smoke` (or without `--model_name_or_path`) it runs offline in a minute on a CPU: a tiny random Llama, a
character-level tokenizer, and a few synthetic rows in the PIQA and GSM8K schemas. That shows the pipeline working,
not the method's quality.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import datasets
import torch
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from peft_bitune import BituneConfig
from peft_bitune.evaluation import TASKS_DIR, TaskFormat, format_dataset, get_task
from peft_bitune.evaluation.harness import BituneLM
from trl_integration import BituneSFTConfig, BituneSFTTrainer

METHODS = ("lora", "bitune")
METHOD_TITLES = {"lora": "LoRA", "bitune": "Bitune"}


@dataclass
class Settings:
    model_name_or_path: str
    tasks: list[str]
    seeds: list[int]
    output_dir: str
    task_dir: str = TASKS_DIR
    rank: int = 8
    learning_rate: float = 3e-4
    epochs: float = 1.0
    max_steps: int = -1
    train_batch_size: int = 8
    eval_batch_size: int = 8
    max_train_rows: int | None = None
    eval_limit: int | None = None
    smoke: bool = False
    dataset_files: dict[str, str] = field(default_factory=dict)  # smoke: task -> local training JSONL


# ---------------------------------------------------------------------------------------------------- training
def training_rows(task: TaskFormat, settings: Settings, seed: int) -> datasets.Dataset:
    """The task's training split in the paper's prompt-completion format."""
    if task.name in settings.dataset_files:
        rows = datasets.load_dataset("json", data_files=settings.dataset_files[task.name], split="train")
    else:
        rows = datasets.load_dataset(task.dataset_path, task.dataset_name, split=task.train_split)
    rows = rows.shuffle(seed=seed)
    if settings.max_train_rows is not None:
        rows = rows.select(range(min(settings.max_train_rows, len(rows))))
    return format_dataset(rows, task)


def train(method: str, task: TaskFormat, seed: int, settings: Settings, tokenizer):
    """A fresh adapter of `method` trained on `task`; returns the PEFT model."""
    lora = LoraConfig(
        r=settings.rank, lora_alpha=2 * settings.rank, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    on_gpu = torch.cuda.is_available()
    common = dict(
        output_dir=str(Path(settings.output_dir) / f"{method}-{task.name}-seed{seed}"),
        seed=seed,
        learning_rate=settings.learning_rate,
        num_train_epochs=settings.epochs,
        max_steps=settings.max_steps,
        per_device_train_batch_size=settings.train_batch_size,
        save_strategy="no",
        report_to="none",
        logging_steps=10,
        disable_tqdm=True,
        bf16=on_gpu and torch.cuda.is_bf16_supported(),  # TRL defaults to bf16, which a CPU run refuses
        use_cpu=not on_gpu,
    )
    model = AutoModelForCausalLM.from_pretrained(settings.model_name_or_path, dtype="auto")
    train_dataset = training_rows(task, settings, seed)
    if method == "bitune":
        trainer = BituneSFTTrainer(
            model=model, args=BituneSFTConfig(**common), train_dataset=train_dataset, processing_class=tokenizer,
            peft_config=BituneConfig(adapter_config=lora),
        )
    else:
        trainer = SFTTrainer(
            model=model, args=SFTConfig(**common), train_dataset=train_dataset, processing_class=tokenizer,
            peft_config=lora,
        )
    with contextlib.redirect_stdout(sys.stderr):  # the trainer prints its logs; stdout is for the results
        trainer.train()
    return trainer.model


# ---------------------------------------------------------------------------------------------------- evaluation
def evaluate(method: str, model, task: TaskFormat, settings: Settings, tokenizer) -> float:
    """The task's main metric (accuracy, or exact match for generation) from the harness, as a fraction."""
    harness_model = BituneLM if method == "bitune" else HFLM
    lm = harness_model(pretrained=model, tokenizer=tokenizer, batch_size=settings.eval_batch_size)
    task_name = f"bitune_{task.name}"
    results = simple_evaluate(
        model=lm,
        tasks=[task_name],
        task_manager=TaskManager(include_path=settings.task_dir, include_defaults=False),
        limit=settings.eval_limit,
        log_samples=False,
    )
    metric = "acc,none" if task.is_multiple_choice else "exact_match,none"
    return float(results["results"][task_name][metric])


# ---------------------------------------------------------------------------------------------------- summary
def statistics_of(values: list[float]) -> dict:
    """Mean and sample standard deviation (`None` for a single seed) of per-seed values."""
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else None,
        "values": list(values),
    }


def summarize(scores: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, dict]]:
    """
    `scores[method][task]` holds one value per seed, in seed order. Returns `summary[method][task]` and
    `summary[method]["average"]` (the mean over tasks of each seed, then its mean ± std over seeds).
    """
    summary = {}
    for method, per_task in scores.items():
        seed_counts = {len(values) for values in per_task.values()}
        if len(seed_counts) != 1:
            raise ValueError(f"`{method}` has a different number of seeds per task: {seed_counts}.")
        per_seed_average = [statistics.fmean(seed_values) for seed_values in zip(*per_task.values())]
        summary[method] = {task: statistics_of(values) for task, values in per_task.items()}
        summary[method]["average"] = statistics_of(per_seed_average)
    return summary


def _cell(stats: dict) -> str:
    mean = f"{100 * stats['mean']:.1f}"
    return mean if stats["std"] is None else f"{mean} ± {100 * stats['std']:.1f}"


def markdown_table(summary: dict[str, dict[str, dict]]) -> str:
    """Tasks as rows (then "Average"), methods as columns: `mean ± std` in percent."""
    methods = [method for method in METHODS if method in summary]
    rows = [name for name in next(iter(summary.values())) if name != "average"] + ["average"]
    lines = [
        "| Task | " + " | ".join(METHOD_TITLES[m] for m in methods) + " |",
        "| --- | " + " | ".join("---:" for _ in methods) + " |",
    ]
    for row in rows:
        title = "**Average**" if row == "average" else row
        lines.append(f"| {title} | " + " | ".join(_cell(summary[m][row]) for m in methods) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- smoke setup
SMOKE_TASKS = ("piqa", "gsm8k")


def _smoke_rows(task: str, count: int, rng: random.Random) -> list[dict]:
    rows = []
    for _ in range(count):
        if task == "piqa":
            # Both solutions have the same length, so that an untrained model has no length bias to exploit.
            word, other = rng.sample(["".join(letters) for letters in itertools.permutations("abcdef", 3)], 2)
            label = rng.randrange(2)
            solutions = [word, other] if label == 0 else [other, word]
            rows.append({"goal": f"Copy {word}", "sol1": solutions[0], "sol2": solutions[1], "label": label})
        elif task == "gsm8k":
            a, b = rng.randrange(10), rng.randrange(10)
            rows.append({"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
        else:
            raise ValueError(f"The smoke run has synthetic data for {SMOKE_TASKS}, not {task!r}.")
    return rows


def prepare_smoke(directory: Path, tasks: list[str]) -> tuple[str, dict[str, str], str]:
    """Tiny model + tokenizer, synthetic data and local task YAMLs. Returns (model path, training files, task dir)."""
    characters = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,?!:;'-+=#\n")
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {token: index for index, token in enumerate(specials + characters)}
    from tokenizers import Tokenizer, decoders, models, processors

    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token per character
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    model_path = directory / "model"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(model_path)
    tokenizer.save_pretrained(model_path)

    rng = random.Random(0)
    task_dir = directory / "tasks"
    task_dir.mkdir()
    train_files = {}
    for name in tasks:
        task = get_task(name)
        for split, count in (("train", 64), ("eval", 16)):
            path = directory / f"{task.name}-{split}.jsonl"
            path.write_text("".join(json.dumps(row) + "\n" for row in _smoke_rows(task.name, count, rng)))
        train_files[task.name] = str(directory / f"{task.name}-train.jsonl")
        overrides = {"dataset_path": "json", "dataset_name": None, "training_split": None,
                     "dataset_kwargs": {"data_files": {task.eval_split: str(directory / f"{task.name}-eval.jsonl")}},
                     "custom_dataset": None}  # the harness's own loading of the local files, not the Hub's rows
        if not task.is_multiple_choice:
            overrides["generation_kwargs"] = {"until": ["Question:", "\n\n"], "do_sample": False, "max_gen_toks": 16}
        lines = [f"include: {Path(TASKS_DIR) / f'bitune_{task.name}.yaml'}"] + [
            f"{key}: {json.dumps(value)}" for key, value in overrides.items()  # JSON is valid YAML
        ]
        (task_dir / f"bitune_{task.name}.yaml").write_text("\n".join(lines) + "\n")
    return str(model_path), train_files, str(task_dir)


# ---------------------------------------------------------------------------------------------------- main
def run(settings: Settings) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(settings.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tasks = [get_task(name) for name in settings.tasks]
    missing = [task.name for task in tasks if task.train_split is None and task.name not in settings.dataset_files]
    if missing:
        raise ValueError(f"{missing} have no training split (the paper evaluated them zero-shot); leave them out.")
    scores: dict[str, dict[str, list[float]]] = {method: {task.name: [] for task in tasks} for method in METHODS}
    for task in tasks:
        for seed in settings.seeds:
            for method in METHODS:
                model = train(method, task, seed, settings, tokenizer)
                score = evaluate(method, model, task, settings, tokenizer)
                scores[method][task.name].append(score)
                print(f"{task.name} seed {seed} {METHOD_TITLES[method]}: {100 * score:.1f}", file=sys.stderr)
    summary = summarize(scores)
    return {"settings": asdict(settings), "scores": scores, "summary": summary}


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_name_or_path", help="base model; without it, the offline smoke run")
    parser.add_argument("--smoke", action="store_true", help="offline run on a tiny random model and synthetic data")
    parser.add_argument("--tasks", nargs="+", default=None, help="paper tasks (piqa arc_challenge csqa siqa gsm8k)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=3e-4)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--max_steps", type=int, default=-1, help="overrides --epochs when positive")
    parser.add_argument("--train_batch_size", type=int, default=8)
    parser.add_argument("--eval_batch_size", type=int, default=8)
    parser.add_argument("--max_train_rows", type=int, default=None)
    parser.add_argument("--eval_limit", type=int, default=None, help="evaluate on the first N examples only")
    parser.add_argument("--output_dir", default=None, help="trainer output folders (default: a temporary folder)")
    parser.add_argument("--output", default=None, help="write the results as JSON to this file")
    arguments = parser.parse_args(argv)
    arguments.smoke = arguments.smoke or arguments.model_name_or_path is None
    if arguments.smoke and arguments.model_name_or_path is not None:
        parser.error("`--smoke` builds its own tiny model; drop `--model_name_or_path`.")
    if len(set(arguments.seeds)) != len(arguments.seeds):
        parser.error(f"`--seeds` repeats a seed: {arguments.seeds}.")
    if arguments.tasks is None:
        arguments.tasks = list(SMOKE_TASKS) if arguments.smoke else ["piqa", "arc_challenge", "csqa", "siqa", "gsm8k"]
    for name in arguments.tasks:
        try:
            get_task(name)
        except ValueError as error:
            parser.error(str(error))
    return arguments


def main(argv: list[str] | None = None) -> dict:
    arguments = parse_arguments(argv)
    with tempfile.TemporaryDirectory() as scratch:
        settings = Settings(
            model_name_or_path=arguments.model_name_or_path or "",
            tasks=arguments.tasks,
            seeds=arguments.seeds,
            output_dir=arguments.output_dir or str(Path(scratch) / "runs"),
            rank=arguments.rank,
            learning_rate=arguments.learning_rate,
            epochs=arguments.epochs,
            max_steps=arguments.max_steps,
            train_batch_size=arguments.train_batch_size,
            eval_batch_size=arguments.eval_batch_size,
            max_train_rows=arguments.max_train_rows,
            eval_limit=arguments.eval_limit,
            smoke=arguments.smoke,
        )
        if settings.smoke:
            settings.model_name_or_path, settings.dataset_files, settings.task_dir = prepare_smoke(
                Path(scratch), settings.tasks
            )
            if settings.max_steps <= 0:
                settings.max_steps = 8
        results = run(settings)
    print(markdown_table(results["summary"]))
    print(json.dumps(results["summary"], indent=2))
    if arguments.output:
        Path(arguments.output).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
