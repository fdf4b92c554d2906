"""
The miniature experiment: tune the pretrained miniature base (`base/`) on the held-out suite (`tasks.py`) with plain
LoRA, with Bitune, and with the paper's three ablations of Bitune, over three seeds; write a Markdown table and JSON.

    python examples/miniature/run.py --json docs/miniature.json

(the table goes to stdout, and to `--markdown PATH` if given; about 21 minutes on one core, see docs/miniature.md).

Every method gets the same LoRA (rank 8, alpha 16, all linear layers), the same training rows, the same number of
steps and batch size, and the same learning-rate search: each learning rate of `--learning_rates` is tried with the
first seed and scored on a validation split (not the test split); the best one is then run with every seed (the
first seed's search run is reused). LoRA trains with TRL's `SFTTrainer`, the Bitune variants with
`BituneSFTTrainer`; both compute the loss on the completion only.

Scoring: multiple-choice tasks by the summed log-likelihood of each choice as the answer, through the model's own
forward (the Bitune training forward for Bitune adapters, so the instruction is read as in training); `sum` by exact
match of the greedy answer (`generate`, cut at the first newline or end of text). The untuned base is scored the
same way. `--small` is a quick run of the whole pipeline for CI (LoRA and Bitune, one seed, 30 steps; about 30 s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import datasets
import peft
import torch
import transformers
import trl
from peft import LoraConfig, get_peft_model
from torch.nn import functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
from trl import SFTConfig, SFTTrainer

if str(Path(__file__).parent) not in sys.path:  # the sibling modules, also when imported from elsewhere
    sys.path.insert(0, str(Path(__file__).parent))
import tasks  # noqa: E402

from peft_bitune import BituneConfig  # noqa: E402
from trl_integration import BituneSFTConfig, BituneSFTTrainer  # noqa: E402

BASE = Path(__file__).parent / "base"
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Method:
    name: str
    title: str
    bitune: dict | None  # BituneConfig arguments besides the adapter; None for plain LoRA


METHODS = {
    method.name: method
    for method in (
        Method("lora", "LoRA", None),
        Method("bitune", "Bitune", {}),
        Method("shared_weights", "Bitune, shared weights", {"shared_weights": True}),
        Method("causal_second_pass", "Bitune, causal 2nd pass", {"second_pass_attention": "causal"}),
        Method("fixed_mixing", "Bitune, fixed mixing (α = 0.5)", {"train_mixing": False}),
    )
}


@dataclass(frozen=True)
class Settings:
    base: str
    methods: tuple[str, ...]
    seeds: tuple[int, ...]
    learning_rates: tuple[float, ...]
    steps: int
    batch_size: int
    rank: int
    train_rows_per_task: int
    validation_rows_per_task: int
    test_rows_per_task: int
    threads: int

    def to_json(self) -> dict:
        return {name: list(value) if isinstance(value, tuple) else value for name, value in vars(self).items()}


FULL = dict(methods=tuple(METHODS), seeds=(0, 1, 2), learning_rates=(3e-3, 1e-2), steps=150, batch_size=16,
            train_rows_per_task=300, validation_rows_per_task=40, test_rows_per_task=200)
SMALL = dict(methods=("lora", "bitune"), seeds=(0,), learning_rates=(1e-2,), steps=30, batch_size=16,
             train_rows_per_task=64, validation_rows_per_task=0, test_rows_per_task=16)


# ---------------------------------------------------------------- training
def peft_config(method: Method, rank: int) -> LoraConfig | BituneConfig:
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    return lora if method.bitune is None else BituneConfig(adapter_config=lora, **method.bitune)


def train(method: Method, learning_rate: float, seed: int, rows: datasets.Dataset, settings: Settings, tokenizer):
    """A fresh adapter of `method` on the base, trained with TRL; returns the PEFT model (eval mode) and its loss."""
    transformers.set_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(settings.base, dtype=torch.float32)
    model = get_peft_model(base, peft_config(method, settings.rank))  # initialised under `seed`
    with tempfile.TemporaryDirectory() as output_dir:
        common = dict(
            output_dir=output_dir, seed=seed, data_seed=seed, learning_rate=learning_rate, max_steps=settings.steps,
            per_device_train_batch_size=settings.batch_size, lr_scheduler_type="cosine", warmup_steps=10,
            weight_decay=0.0, save_strategy="no", logging_strategy="no", report_to="none", disable_tqdm=True,
            use_cpu=True, bf16=False, activation_checkpointing=False, dataloader_num_workers=0,
        )
        if method.bitune is None:
            trainer = SFTTrainer(model=model, args=SFTConfig(**common), train_dataset=rows, processing_class=tokenizer)
        else:
            trainer = BituneSFTTrainer(model=model, args=BituneSFTConfig(**common, mixing_logging_steps=None),
                                       train_dataset=rows, processing_class=tokenizer)
        trainer.remove_callback(PrinterCallback)
        result = trainer.train()
    model = trainer.model
    model.eval()
    return model, result.training_loss


def training_rows(settings: Settings) -> datasets.Dataset:
    examples = tasks.make_split("train", settings.train_rows_per_task)
    return datasets.Dataset.from_list([{"prompt": e.prompt, "completion": e.completion} for e in examples])


# ---------------------------------------------------------------- scoring
def _batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]


@torch.no_grad()
def answer_log_likelihoods(model, tokenizer, pairs: list[tuple[str, str]], batch_size: int = 64) -> list[float]:
    """Summed log-probability of each answer given its prompt, from the model's own forward (right padding)."""
    encoded = []
    for prompt, answer in pairs:
        prompt_ids = tokenizer(prompt)["input_ids"]
        answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        encoded.append((prompt_ids + answer_ids, len(prompt_ids)))
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))
    scores = [0.0] * len(encoded)
    for batch in _batches(order, batch_size):
        width = max(len(encoded[i][0]) for i in batch)
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        labels = torch.full((len(batch), width), IGNORE_INDEX)
        for row, i in enumerate(batch):
            ids, prompt_length = encoded[i]
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
            labels[row, prompt_length : len(ids)] = torch.tensor(ids[prompt_length:])
        logits = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).logits.float()
        targets = labels[:, 1:]
        log_probs = F.log_softmax(logits[:, :-1], dim=-1)
        picked = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        per_row = (picked * (targets != IGNORE_INDEX)).sum(-1)
        for row, i in enumerate(batch):
            scores[i] = per_row[row].item()
    return scores


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[str], max_new_tokens: int = 4, batch_size: int = 64) -> list[str]:
    """Greedy answers (left-padded batches), cut at the end of text or the first newline, stripped."""
    answers = []
    for batch in _batches(prompts, batch_size):
        inputs = tokenizer(batch, return_tensors="pt", padding=True, padding_side="left")
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        for row in output[:, inputs["input_ids"].shape[1] :]:
            text = tokenizer.decode(row, skip_special_tokens=True)
            answers.append(text.split("\n")[0].strip())
    return answers


def evaluate(model, tokenizer, examples: list[tasks.Example]) -> dict:
    """Accuracy per task (exact match for generation), and per question placement, as fractions."""
    correct: dict[str, list[bool]] = {}
    placement: dict[str, list[bool]] = {"question_first": [], "question_last": []}
    choice_rows = [e for e in examples if e.is_multiple_choice]
    pairs = [(e.prompt, " " + choice) for e in choice_rows for choice in e.choices]
    scores = iter(answer_log_likelihoods(model, tokenizer, pairs))
    outcomes = []
    for example in choice_rows:
        choice_scores = [next(scores) for _ in example.choices]
        outcomes.append((example, max(range(len(choice_scores)), key=choice_scores.__getitem__) == example.label))
    generation_rows = [e for e in examples if not e.is_multiple_choice]
    answers = greedy_answers(model, tokenizer, [e.prompt for e in generation_rows])
    outcomes += [(e, answer == e.completion.strip()) for e, answer in zip(generation_rows, answers)]
    for example, is_correct in outcomes:
        correct.setdefault(example.task, []).append(is_correct)
        placement["question_first" if example.question_first else "question_last"].append(is_correct)
    per_task = {task: statistics.fmean(values) for task, values in correct.items()}
    per_task["average"] = statistics.fmean(per_task[task] for task in correct)
    return {"tasks": per_task, "placement": {k: statistics.fmean(v) for k, v in placement.items() if v}}


# ---------------------------------------------------------------- the experiment
def run(settings: Settings, log=print) -> dict:
    torch.set_num_threads(settings.threads)
    started = time.time()
    tokenizer = AutoTokenizer.from_pretrained(settings.base)
    rows = training_rows(settings)
    validation = tasks.make_split("validation", settings.validation_rows_per_task)
    test = tasks.make_split("test", settings.test_rows_per_task)

    base = AutoModelForCausalLM.from_pretrained(settings.base, dtype=torch.float32).eval()
    results: dict = {"base": evaluate(base, tokenizer, test), "methods": {}}
    log(f"base: average {results['base']['tasks']['average']:.3f}  ({time.time() - started:.0f}s)")

    for name in settings.methods:
        method = METHODS[name]
        first_seed, *other_seeds = settings.seeds
        search, models = {}, {}
        for learning_rate in settings.learning_rates:
            model, loss = train(method, learning_rate, first_seed, rows, settings, tokenizer)
            score = evaluate(model, tokenizer, validation)["tasks"]["average"] if validation else math.nan
            search[learning_rate], models[learning_rate] = {"validation_average": score, "train_loss": loss}, model
            log(f"{name}: lr {learning_rate:g} seed {first_seed} loss {loss:.3f} validation {score:.3f}  "
                f"({time.time() - started:.0f}s)")
        best = max(settings.learning_rates, key=lambda lr: search[lr]["validation_average"]
                   if not math.isnan(search[lr]["validation_average"]) else -search[lr]["train_loss"])
        seeds = {first_seed: (models[best], search[best]["train_loss"])}
        del models
        for seed in other_seeds:
            seeds[seed] = train(method, best, seed, rows, settings, tokenizer)
        per_seed = {}
        for seed, (model, loss) in seeds.items():
            per_seed[seed] = {"train_loss": loss, **evaluate(model, tokenizer, test)}
            if method.bitune is not None:
                alphas = model.base_model.get_mixing_coefficients()
                per_seed[seed]["alpha_mean"] = {k: float(v.mean()) for k, v in alphas.items()}
            log(f"{name}: lr {best:g} seed {seed} test average {per_seed[seed]['tasks']['average']:.3f}  "
                f"({time.time() - started:.0f}s)")
        results["methods"][name] = {"learning_rate": best, "search": {str(k): v for k, v in search.items()},
                                    "seeds": {str(k): v for k, v in per_seed.items()}}
    results["summary"] = summarize(results)
    results["settings"] = settings.to_json()
    results["seconds"] = round(time.time() - started)
    results["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "peft": peft.__version__, "trl": trl.__version__}
    return results


def _stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None}


def summarize(results: dict) -> dict:
    """Mean ± sample std over seeds of each task, of the per-seed average, and of each question placement."""
    summary = {"base": dict(results["base"]["tasks"])}
    for name, method in results["methods"].items():
        seeds = list(method["seeds"].values())
        columns = list(seeds[0]["tasks"]) + [f"placement:{p}" for p in seeds[0]["placement"]]
        summary[name] = {
            column: _stats([seed["placement"][column.split(":")[1]] if column.startswith("placement:")
                            else seed["tasks"][column] for seed in seeds])
            for column in columns
        }
    return summary


def markdown_table(results: dict) -> str:
    """Tasks as rows, methods as columns, accuracy in percent: mean ± std over seeds."""
    summary, methods = results["summary"], list(results["methods"])
    task_rows = [t for t in tasks.TASKS if t in summary["base"]] + ["average"]
    placement_rows = [c for c in summary[methods[0]] if c.startswith("placement:")] if methods else []

    def cell(stats) -> str:
        if isinstance(stats, float):
            return f"{100 * stats:.1f}"
        return f"{100 * stats['mean']:.1f}" + ("" if stats["std"] is None else f" ± {100 * stats['std']:.1f}")

    header = "| Task | Base (untuned) | " + " | ".join(METHODS[m].title for m in methods) + " |"
    lines = [header, "| --- | ---: | " + " | ".join("---:" for _ in methods) + " |"]
    for row in task_rows:
        title = "**Average**" if row == "average" else f"`{row}`" + (" (EM)" if row in tasks.GENERATION_TASKS else "")
        lines.append(f"| {title} | {cell(summary['base'][row])} | "
                     + " | ".join(cell(summary[m][row]) for m in methods) + " |")
    for row in placement_rows:
        title = "question " + ("before" if row.endswith("first") else "after") + " the passage (all tasks)"
        base = results["base"]["placement"][row.split(":")[1]]
        lines.append(f"| *{title}* | {cell(base)} | " + " | ".join(cell(summary[m][row]) for m in methods) + " |")
    lrs = " | ".join(f"{results['methods'][m]['learning_rate']:g}" for m in methods)
    lines.append(f"| *learning rate chosen* | – | {lrs} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> tuple[Settings, dict[str, str | None]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=str(BASE), help="the pretrained base (defaults to the committed one)")
    parser.add_argument("--small", action="store_true", help="a quick run of the whole pipeline, for CI")
    parser.add_argument("--json", help="write all results here")
    parser.add_argument("--markdown", help="write the results table here")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int)
    parser.add_argument("--learning_rates", nargs="+", type=float)
    for name in ("steps", "batch_size", "train_rows_per_task", "validation_rows_per_task", "test_rows_per_task"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for a model this small)")
    args = parser.parse_args(argv)
    defaults = SMALL if args.small else FULL
    chosen = {name: getattr(args, name) if getattr(args, name) is not None else default
              for name, default in defaults.items()}
    for name in ("methods", "seeds", "learning_rates"):
        chosen[name] = tuple(chosen[name])
    if chosen["validation_rows_per_task"] == 0 and len(chosen["learning_rates"]) > 1:
        parser.error("a learning-rate search needs a validation split: set `--validation_rows_per_task` above 0 or "
                     "give one learning rate.")
    if not (Path(args.base) / "config.json").is_file():
        parser.error(f"`--base` must be a folder saved with `save_pretrained` (model and tokenizer), got {args.base!r}.")
    for name in ("steps", "batch_size", "train_rows_per_task", "test_rows_per_task"):
        if chosen[name] < 1:
            parser.error(f"`--{name}` must be at least 1, got {chosen[name]}.")
    if len(set(chosen["seeds"])) != len(chosen["seeds"]):
        parser.error(f"`--seeds` must be distinct, got {chosen['seeds']}.")
    settings = Settings(base=args.base, rank=args.rank, threads=args.threads, **chosen)
    return settings, {"json": args.json, "markdown": args.markdown}


def main(argv: list[str] | None = None) -> None:
    settings, paths = parse_args(argv)
    datasets.disable_progress_bars()  # dozens of trainings: keep the log to one line per run
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for path in filter(None, paths.values()):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    with contextlib.redirect_stdout(sys.stderr):  # trainers and libraries print; stdout carries only the table
        results = run(settings, log=lambda line: print(line, file=sys.stderr, flush=True))
    table = markdown_table(results)
    if paths["json"]:
        Path(paths["json"]).write_text(json.dumps(results, indent=2) + "\n")
    if paths["markdown"]:
        Path(paths["markdown"]).write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
