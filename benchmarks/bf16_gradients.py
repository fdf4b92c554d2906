"""
How far are bf16 gradients from float64 on the rows users train on? Per group of trainable weights (LoRA's; Bitune's
bidirectional weights, causal weights and mixing scalars), the cosine and norm ratio of the bf16 gradient against a
float64 gradient of the same step, on rows of the paper-tasks training mixture in the batches `BituneSFTTrainer`
builds (its collator, right padding included), on real models, under each oneDNN instruction set this CPU offers.

    python benchmarks/bf16_gradients.py --json docs/results/bf16_gradients.json     # ~40 minutes on one core
    python benchmarks/bf16_gradients.py --models smollm2 --isas AVX512_CORE_BF16 --batches 1   # a quick look

Two bf16 settings, each against its own float64 reference:

- `autocast`: float32 weights under `torch.autocast("cpu", dtype=torch.bfloat16)` (TRL's `bf16=True`), against
  float64 of the same weights;
- `bf16_weights`: the model loaded in bf16 (mixing scalars kept in float32, as `BituneSFTTrainer` does), under the
  same autocast, against float64 of the *same bf16-rounded weights* (the rounded model is another model: comparing it
  with the float32 one would measure the rounding of the weights, not the precision of the step).

oneDNN picks its kernels when torch loads, so every instruction set (`ONEDNN_MAX_CPU_ISA`) runs in a process of its
own; the float64 references (which oneDNN does not compute) are computed once, in another. The kernel oneDNN really
ran for a bf16 matrix product is recorded beside each (`ONEDNN_VERBOSE`), with `lscpu`'s model name and flags.

The random-token batch of `bf16_autocast.py` (batch 8, 64 instruction and 8 answer tokens) is measured too, with a
control: the float64 gradient after perturbing every weight by relative noise of bf16's rounding size (N(0, 2**-9),
about the root mean square of a rounding to 8 significant bits). If that perturbation moves the gradient as much as
bf16 does, the input is ill-conditioned (any rounding moves its gradient); if not, an operation loses precision.

`--bitune_at` chooses the point where Bitune's gradients are taken: the paper's start (`paper_start`, alpha = 0.5, the
default), the near-causal start the paper-tasks page chose (`near_causal`, alpha ~ 0.05), both with LoRA's B drawn as
above, or a trained Bitune adapter (its folder, as `save_pretrained` wrote it), loaded as it was trained:

    python benchmarks/bf16_gradients.py --models smollm2 --batches 1 --isas AVX512_CORE_AMX AVX2 \
        --bitune_at out/paper_tasks/smollm2/adapters/7bfdcb920aea-bitune_near_causal-lr0.0015-seed0
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
REPOSITORY = BENCHMARKS.parent
ISAS = ("AVX2", "AVX512_CORE", "AVX512_CORE_BF16", "AVX512_CORE_AMX")
# The lscpu flags each oneDNN ISA needs beyond the previous one (oneDNN's cpu_isa_traits).
ISA_FLAGS = {"AVX2": ("avx2",), "AVX512_CORE": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
             "AVX512_CORE_BF16": ("avx512_bf16",), "AVX512_CORE_AMX": ("amx_bf16", "amx_tile")}
MODELS = {"smollm2": "smollm2", "gemma3-270m": "gemma3-270m"}  # the bases of examples/paper_tasks/run.py
BATCH_SIZES = {"smollm2": 8, "gemma3-270m": 4}  # Gemma's 262k vocabulary: float64 logits of 8 rows take gigabytes
METHODS = ("lora", "bitune")
BITUNE_STARTS = {"paper_start": "bitune_paper_start", "near_causal": "bitune_near_causal"}  # run.py's methods
SETTINGS = ("autocast", "bf16_weights")
PERTURBATION = 2.0**-9
LORA_B_STD = 0.01


# ---------------------------------------------------------------------- the CPU
def lscpu() -> dict:
    """`lscpu`'s model name and its flags."""
    fields = dict(line.split(":", 1) for line in subprocess.run(["lscpu"], capture_output=True, text=True,
                                                                 check=True).stdout.splitlines() if ":" in line)
    return {"model_name": fields.get("Model name", "").strip(), "flags": fields.get("Flags", "").split()}


def offered_isas(flags: list[str]) -> list[str]:
    """The oneDNN ISAs this CPU offers, each needing the flags of the ones before it."""
    offered = []
    for isa in ISAS:
        if not all(flag in flags for flag in ISA_FLAGS[isa]):
            break
        offered.append(isa)
    return offered


def onednn_kernel(isa: str) -> dict:
    """What oneDNN reports for a bf16 matrix product under `isa`: its ISA line and the implementation it ran."""
    code = "import torch; a = torch.randn(64, 64).bfloat16(); torch.mm(a, a)"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa, "ONEDNN_VERBOSE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    isa_line = next((line.split("isa:", 1)[1] for line in out.splitlines() if "isa:" in line), "")
    if ",exec," not in out:
        return {"isa": "", "matmul_kernels": ["oneDNN not called: ATen's own bf16 matrix product"]}
    kernels = sorted({match for line in out.splitlines() if ",exec," in line
                      for match in re.findall(r",(brg[^,]*|gemm:[^,]*|jit[^,]*|ref[^,]*),", line)})
    return {"isa": isa_line.strip(), "matmul_kernels": kernels}


# ---------------------------------------------------------------------- inputs (in the reference process)
def paper_tasks_module():
    """examples/paper_tasks/run.py (a script, not a package), loaded once."""
    if "paper_tasks_run" not in sys.modules:
        spec = importlib.util.spec_from_file_location("paper_tasks_run", REPOSITORY / "examples/paper_tasks/run.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["paper_tasks_run"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["paper_tasks_run"]


def trainer_batches(folder: str, count: int, batch_size: int) -> list[dict]:
    """The first `count` batches `BituneSFTTrainer` builds from the paper-tasks training mixture (seed 0)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_integration import BituneSFTConfig, BituneSFTTrainer

    run = paper_tasks_module()
    settings = run.Settings(base=folder)
    data = run.load_data(settings, smoke=True)  # `smoke` shrinks the test subsets only; the training rows are the same
    tokenizer = AutoTokenizer.from_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = get_peft_model(base, run.peft_config("bitune_paper_start", settings.rank,
                                                 base.config.get_text_config().num_hidden_layers))
    with tempfile.TemporaryDirectory() as output_dir:
        args = BituneSFTConfig(output_dir=output_dir, per_device_train_batch_size=batch_size, seed=0, data_seed=0,
                               max_length=settings.max_length, report_to="none", use_cpu=True, bf16=False,
                               dataloader_num_workers=0, disable_tqdm=True)
        trainer = BituneSFTTrainer(model=model, args=args, train_dataset=data.train, processing_class=tokenizer)
        batches = []
        for batch in trainer.get_train_dataloader():
            batches.append({name: batch[name].cpu() for name in ("input_ids", "attention_mask", "labels")})
            if len(batches) == count:
                break
    return batches


def random_token_batch(vocab_size: int, rows: int) -> dict:
    """`bf16_autocast.py`'s rows: 64 instruction and 8 answer tokens drawn uniformly, no padding."""
    sys.path.insert(0, str(BENCHMARKS))
    import torch

    from models import training_batch

    return training_batch(rows, 64, 8, vocab_size, torch.device("cpu"))


# ---------------------------------------------------------------------- models and steps
def build(folder: str, method: str, bitune_at: str = "paper_start"):
    """A LoRA or Bitune model on the float32 base: a fresh adapter (the paper-tasks configurations; Bitune at the start
    `bitune_at` names) with B ~ N(0, 0.01) so that every weight has a gradient (as after some training), the same in
    every process; or, for Bitune, the trained adapter in the folder `bitune_at`, as it was saved."""
    import torch
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    run = paper_tasks_module()
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if method == "bitune" and bitune_at not in BITUNE_STARTS:
        return PeftModel.from_pretrained(base, bitune_at, is_trainable=True).train()
    torch.manual_seed(0)
    model = get_peft_model(base, run.peft_config("lora" if method == "lora" else BITUNE_STARTS[bitune_at], 8,
                                                 base.config.get_text_config().num_hidden_layers))
    generator = torch.Generator().manual_seed(1)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            with torch.no_grad():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * LORA_B_STD)
    return model.train()


def to_precision(model, dtype) -> None:
    """Every weight in `dtype`, except Bitune's mixing scalars, which stay in float32 when the rest is bf16 (as
    `BituneSFTTrainer` keeps them), and go to float64 with the rest for a reference."""
    import torch

    from peft_bitune.tuner.find_tuner import find_bitune_tuner

    bitune = find_bitune_tuner(model)
    mixers = {name: p.detach().clone() for name, p in bitune.bitune_mixers.named_parameters()} if bitune else {}
    model.to(dtype)
    for name, parameter in bitune.bitune_mixers.named_parameters() if bitune else ():
        parameter.data = mixers[name].to(torch.float64 if dtype == torch.float64 else torch.float32)


def loss_of(model, batch: dict):
    """The mean next-token cross-entropy on the answer tokens. For LoRA the LM head runs only at the positions that
    predict an answer token (a 262k vocabulary in float64 at every position would not fit); Bitune's forward does that
    itself."""
    import torch
    from torch.nn import functional as F

    from peft_bitune.tuner.find_tuner import find_bitune_tuner

    if find_bitune_tuner(model) is not None:
        return model(**batch).loss
    labels = batch["labels"]
    targets = labels[:, 1:]
    positions = (targets != -100).any(dim=0).nonzero().flatten()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   logits_to_keep=positions).logits
    logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[:, positions].reshape(-1),
                           ignore_index=-100)


def gradients(model, batch: dict, autocast: bool) -> dict:
    """One forward + backward; the gradients of the trainable weights by name, in float64."""
    import torch

    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = loss_of(model, batch)
    loss.backward()
    grads = {name: p.grad.detach().double().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return {"loss": float(loss.detach()), "gradients": grads}


def parameter_group(name: str) -> str:
    if "bitune_mixers" in name:
        return "mixing scalars"
    if "bidirectional" in name:
        return "bidirectional weights"
    return "causal weights" if "causal" in name else "lora"


def agreement(actual: dict, expected: dict) -> dict:
    """Per group: the cosine and norm ratio of the flattened gradient against the reference."""
    import torch

    result = {}
    for group in sorted({parameter_group(name) for name in expected}):
        names = sorted(name for name in expected if parameter_group(name) == group)
        a = torch.cat([actual[name].flatten() for name in names])
        e = torch.cat([expected[name].flatten() for name in names])
        result[group] = {"cosine": round(float(torch.nn.functional.cosine_similarity(a, e, dim=0)), 5),
                         "norm_ratio": round(float(a.norm() / e.norm()), 4)}
    return result


def perturb(model, relative: float, seed: int) -> None:
    """Multiply every weight by (1 + relative * N(0, 1)), in place."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
            parameter.mul_(1 + relative * noise.to(parameter.dtype))


# ---------------------------------------------------------------------- the two kinds of process
def reference_process(model_name: str, batches: int, batch_size: int, random_tokens: bool, bitune_at: str,
                      out: str) -> None:
    """The inputs and the float64 gradients (of the float32 weights, of the bf16-rounded ones, and after the
    perturbation), saved for the bf16 processes."""
    import torch

    torch.set_num_threads(1)
    folder = paper_tasks_module().base_folder(model_name)
    inputs = {f"rows{i}": batch for i, batch in enumerate(trainer_batches(folder, batches, batch_size))}
    gc.collect()
    references, perturbed, rounded = {}, {}, {}
    for method in METHODS:
        model = build(folder, method, bitune_at)
        if random_tokens:
            inputs.setdefault("random", random_token_batch(model.config.vocab_size, batch_size))
        to_precision(model, torch.float64)
        for name, batch in inputs.items():
            references[method, "autocast", name] = gradients(model, batch, autocast=False)
            log(f"{model_name} {method} {name}: float64 loss {references[method, 'autocast', name]['loss']:.4f}")
        to_precision(model, torch.float32)
        to_precision(model, torch.bfloat16)  # the rounded model, then exactly in float64
        to_precision(model, torch.float64)
        for name, batch in real_rows(inputs).items():
            references[method, "bf16_weights", name] = gradients(model, batch, autocast=False)
            # Rounding the weights alone, every step in float64: how much that moves the gradient
            rounded[method, name] = agreement(references[method, "bf16_weights", name]["gradients"],
                                              references[method, "autocast", name]["gradients"])
            log(f"{model_name} {method} {name}: float64 of the bf16-rounded weights: {rounded[method, name]}")
        del model
        gc.collect()
        for name in ("rows0", "random") if random_tokens else ():
            model = build(folder, method, bitune_at)
            to_precision(model, torch.float64)
            perturb(model, PERTURBATION, seed=2)
            perturbed[method, name] = agreement(gradients(model, inputs[name], autocast=False)["gradients"],
                                                references[method, "autocast", name]["gradients"])
            log(f"{model_name} {method} {name}: float64 perturbed by 2^-9: {perturbed[method, name]}")
            del model
            gc.collect()
    shapes = {name: {"rows": int(b["input_ids"].shape[0]), "length": int(b["input_ids"].shape[1]),
                     "real_tokens": int(b["attention_mask"].sum()), "answer_tokens": int((b["labels"] != -100).sum())}
              for name, b in inputs.items()}
    torch.save({"inputs": inputs, "references": references, "perturbed": perturbed, "rounded": rounded,
                "shapes": shapes, "peak_rss_gib": peak_rss_gib(),
                "folder": folder, "bitune_at": bitune_at}, out)


def bitune_at_problem(bitune_at: str) -> str | None:
    """Why `--bitune_at` names neither a start nor a saved Bitune adapter's folder, or None (shared with
    bf16_sensitivity.py)."""
    if bitune_at in BITUNE_STARTS:
        return None
    config = Path(bitune_at) / "adapter_config.json"
    if not config.is_file():
        problem = f"{bitune_at!r} has no adapter_config.json"
    else:
        peft_type = json.loads(config.read_text()).get("peft_type")
        if peft_type == "BITUNE":
            return None
        problem = f"{bitune_at!r} holds a {peft_type} adapter, not a BITUNE one"
    return f"`--bitune_at` must be {' or '.join(BITUNE_STARTS)} or a saved Bitune adapter's folder: {problem}."


def real_rows(inputs: dict) -> dict:
    """The trainer's batches of real rows (random tokens run under autocast only)."""
    return {name: batch for name, batch in inputs.items() if name != "random"}


def bf16_process(saved: str, isa: str, out: str) -> None:
    """The bf16 gradients of every method, setting and input under this process's ISA, against the references."""
    import torch

    torch.set_num_threads(1)
    state = torch.load(saved, weights_only=False)
    result = {}
    for method in METHODS:
        model = build(state["folder"], method, state["bitune_at"])
        for setting in SETTINGS:
            if setting == "bf16_weights":
                to_precision(model, torch.bfloat16)
            for name, batch in (state["inputs"] if setting == "autocast" else real_rows(state["inputs"])).items():
                reference = state["references"][method, setting, name]
                measured = gradients(model, batch, autocast=True)
                result.setdefault(name, {}).setdefault(setting, {})[method] = {
                    "loss": round(measured["loss"], 5), "loss_float64": round(reference["loss"], 5),
                    "groups": agreement(measured["gradients"], reference["gradients"])}
                log(f"{isa} {method} {setting} {name}: {result[name][setting][method]['groups']}")
        del model
        gc.collect()
    result["peak_rss_gib"] = peak_rss_gib()
    Path(out).write_text(json.dumps(result))


def peak_rss_gib() -> float:
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- the report
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--isas", nargs="+", choices=ISAS, help="default: every one this CPU offers")
    parser.add_argument("--batches", type=int, default=2, help="trainer batches of real rows per model")
    parser.add_argument("--batch_size", type=int, help=f"rows per batch (default: {BATCH_SIZES})")
    parser.add_argument("--bitune_at", default="paper_start",
                        help=f"where Bitune's gradients are taken: {' or '.join(BITUNE_STARTS)} (a fresh adapter), "
                        "or the folder of a trained Bitune adapter (then one model in --models)")
    parser.add_argument("--json")
    parser.add_argument("--worker", choices=["reference", "bf16"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--random_tokens", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--saved", help=argparse.SUPPRESS)
    parser.add_argument("--isa", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "reference":
        return reference_process(args.model, args.batches, args.batch_size, args.random_tokens, args.bitune_at,
                                 args.out)
    if args.worker == "bf16":
        return bf16_process(args.saved, args.isa, args.out)
    if args.batches < 1 or (args.batch_size is not None and args.batch_size < 1):
        parser.error(f"`--batches` and `--batch_size` must be at least 1, got {args.batches}, {args.batch_size}.")
    if problem := bitune_at_problem(args.bitune_at):
        parser.error(problem)
    if args.bitune_at not in BITUNE_STARTS:
        if len(args.models) != 1:
            parser.error(f"a trained adapter fits one base model: name it alone in `--models`, got {args.models}.")
    cpu = lscpu()
    offered = offered_isas(cpu["flags"])
    isas = args.isas or offered[::-1]  # the native kernels first: the figures that matter most arrive first
    missing = [isa for isa in isas if isa not in offered]
    if missing:
        parser.error(f"this CPU does not offer {missing} (it offers {offered}); leave them out of `--isas`.")
    report = {"cpu": {"lscpu_model_name": cpu["model_name"], "lscpu_flags": cpu["flags"], "isas_offered": offered,
                      "isas_absent": [isa for isa in ISAS if isa not in offered]},
              "settings": {"batches": args.batches, "batch_sizes": BATCH_SIZES, "lora_b_std": LORA_B_STD,
                           "bitune_at": args.bitune_at,
                           "perturbation": PERTURBATION, "threads": 1},
              "kernels": {isa: onednn_kernel(isa) for isa in isas}, "models": {}}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as work:
        for model_name in args.models:
            saved = f"{work}/{model_name}.pt"
            batch_size = args.batch_size or BATCH_SIZES[model_name]
            command = [sys.executable, __file__, "--worker", "reference", "--model", model_name, "--batches",
                       str(args.batches), "--batch_size", str(batch_size), "--bitune_at", args.bitune_at,
                       "--out", saved]
            command += ["--random_tokens"] if model_name == "smollm2" else []
            subprocess.run(command, env=env, check=True)
            import torch

            state = torch.load(saved, weights_only=False)
            entry = {"batch_size": batch_size, "inputs": state["shapes"],
                     "float64_perturbed": {f"{method}/{name}": value
                                           for (method, name), value in state["perturbed"].items()},
                     "float64_bf16_rounded_weights": {f"{method}/{name}": value
                                                      for (method, name), value in state["rounded"].items()},
                     "reference_peak_rss_gib": state["peak_rss_gib"], "isas": {}}
            del state
            for isa in isas:
                out = f"{work}/{model_name}-{isa}.json"
                subprocess.run([sys.executable, __file__, "--worker", "bf16", "--saved", saved, "--isa", isa,
                                "--out", out], env={**env, "ONEDNN_MAX_CPU_ISA": isa}, check=True)
                entry["isas"][isa] = json.loads(Path(out).read_text())
                report["models"][model_name] = entry
                if args.json:
                    write(report, args.json)
            report["models"][model_name] = entry
            if args.json:  # after each model, so that a long run leaves what it measured
                write(report, args.json)
    report["versions"] = {"python": platform.python_version(), "torch": __import__("torch").__version__}
    if args.json:
        write(report, args.json)
    print(json.dumps(summary(report), indent=1))


def write(report: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1) + "\n")


def summary(report: dict) -> dict:
    """The lowest cosine of each group over the real-row batches, and on random tokens, per model, ISA, setting."""
    table = {}
    for model_name, entry in report["models"].items():
        for isa, inputs in entry["isas"].items():
            for name, settings in inputs.items():
                if name == "peak_rss_gib":
                    continue
                kind = "random" if name == "random" else "rows"
                for setting, methods in settings.items():
                    for method, measured in methods.items():
                        for group, values in measured["groups"].items():
                            key = f"{model_name} {isa} {setting} {kind} {method}/{group}"
                            table[key] = min(table.get(key, 1.0), values["cosine"])
    return table


if __name__ == "__main__":
    main()
