"""
Peak memory of one training step, LoRA against Bitune, each with its loss computed the way its trainer computes it.

    python benchmarks/training_memory.py --memory_cap_gib 10 --json docs/results/training_memory.json  # all (~45 min)
    python benchmarks/training_memory.py --shapes smollm2-135m --dtype float32
    python benchmarks/training_memory.py --json docs/results/training_memory.json --resume  # go on after a stop
    python benchmarks/training_memory.py --memory_cap_gib 10 --json docs/results/training_memory.json \
        --remeasure bitune  # after a change to Bitune: its rows measured again, the others kept

The peak is the bytes allocated during one step (forward, loss, TRL's metrics, backward) above what was allocated
before it (`measure.peak_bytes_during`: the weights and the batch are not counted). Methods:

- `lora`: TRL's `SFTTrainer` (1.16): `model(**batch, fused_lm_head=True)` through its fused LM head
  (`trl.trainer.utils.add_fused_lm_head`), which projects through the LM head in tiles and returns per-token
  log-probabilities; the loss is their negated sum over the supervised tokens, then TRL's metrics (entropy, token
  accuracy) from the head's `entropy` and `is_top1`, without gradient. With Triton (CUDA) the head scores the
  supervised positions only and folds each tile in its kernel; on a CPU it scores every position and folds each tile
  in torch, with float32 temporaries of the tile's size.
- `lora_full_logits`: `model(**batch).loss`, transformers' own loss, with logits at every position (a plain
  `Trainer`, or TRL before the fused head). Skipped where those logits alone would pass `--memory_cap_gib`.
- `bitune`: `BituneSFTTrainer`, whose loss is `SFTTrainer.compute_loss` itself: the same call, loss and metrics as
  `lora`. The Bitune forward answers it from its answer passes (`peft_bitune/tuner/fused_head.py`), handing TRL's head
  each answer chunk (x_m and the answer, A + 1 positions a row) instead of whole rows (P + A - 1); no logits are built.

The report's `lora_fused_head` and `bitune_fused_head` give TRL's head alone at each method's positions on the device
measured: on a CPU it is most of each step's peak with checkpointing, and scores three times as many positions for
LoRA as for Bitune at P=512, A=256, while on a GPU both score the A answer positions of each row. So each shape also
gives `bitune_excess_over_lora`: Bitune's peak minus LoRA's, in all, with each method's head taken out of its peak,
Bitune's peak over LoRA's with LoRA's head at Bitune's positions (`same_head_ratio`, closer to what a GPU shows), and
per decoder layer where extrapolated, next to its floor `prompt_caches`: the keys
and values both prompt passes record, which the mix keeps for the backward pass (`prompt_caches_bytes`). With
checkpointing, next to that floor plus `second_pass_inputs` as well: the input of each decoder layer to the second
prompt pass, which checkpointing keeps to recompute the layer from (`second_pass_inputs_bytes`).

Shapes too deep for the machine are built at full width with `--layers` decoder layers (1 and 2 by default) and
extrapolated linearly to their full depth: every decoder layer adds the same activations, so the peak is
`peak(1) + (L - 1) * (peak(2) - peak(1))`. The matrix products' arithmetic is skipped (`--arithmetic skip`, the
default): their outputs are allocated at their real shape and dtype and left zero, so every allocation is the real
one while the step takes seconds instead of many minutes on a CPU; `tests/test_gpu_check.py` checks that it
gives exactly the peak of the full arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from peft import get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from measure import SkipMatmulArithmetic, peak_bytes_during  # noqa: E402
from models import REAL_SHAPES, TINY_SHAPES, RealShape, lora_config, random_base, training_batch  # noqa: E402
from peft_bitune import BituneConfig, compat  # noqa: E402

METHODS = ("lora", "lora_full_logits", "bitune")
FUSED_HEAD_METHODS = ("lora", "bitune")  # trained through TRL's fused LM head
# The per-token fields TRL's SFTTrainer asks its fused head for: the loss's (log_probs) and its metrics'.
SFT_FIELDS = ("log_probs", "entropy", "is_top1")
GIB = 2**30
MIB = 2**20
# The shapes measured in full, and those measured at a few layers and extrapolated to their full depth.
FULL_DEPTH = ("smollm2-135m", "gemma-3-270m")
EXTRAPOLATED = ("llama-3-8b", "gemma-7b")


def prepared_model(base: torch.nn.Module, method: str, checkpointing: bool) -> torch.nn.Module:
    """Wrap `base` (consumed) for `method`, in training mode, with non-reentrant checkpointing if asked."""
    if method in FUSED_HEAD_METHODS:
        from trl.trainer.utils import add_fused_lm_head  # TRL is only needed for these methods

        add_fused_lm_head(base, outputs=SFT_FIELDS)  # what SFTTrainer adds, before PEFT wraps the model
    config = BituneConfig(adapter_config=lora_config()) if method == "bitune" else lora_config()
    model = get_peft_model(base, config)
    if checkpointing:
        compat.enable_checkpointing(model.base_model.model, use_reentrant=False)
    return model.train()


def step_function(model: torch.nn.Module, method: str, batch: dict[str, torch.Tensor]) -> Callable[[], None]:
    """One training step of `method` on `batch`, its loss computed as its trainer computes it."""

    def sft() -> None:  # trl.SFTTrainer.compute_loss, default "nll" loss, and its metrics; then Trainer's backward
        outputs = model(**batch, use_cache=False, fused_lm_head=True)
        loss = (-outputs.log_probs).sum() / outputs.label_mask.sum().clamp(min=1)
        with torch.no_grad():
            num_valid = outputs.label_mask.sum()
            _metrics = (outputs.entropy.detach().sum() / num_valid, outputs.is_top1.sum() / num_valid)
        del outputs  # the Trainer keeps the loss only
        loss.backward()

    def lora_full_logits() -> None:  # transformers.Trainer.compute_loss
        model(**batch, use_cache=False).loss.backward()

    # LoRA through TRL's `SFTTrainer`, Bitune through `BituneSFTTrainer`, whose loss is `SFTTrainer.compute_loss`
    # itself: the Bitune forward answers the fused-head call from its answer passes (peft_bitune/tuner/fused_head.py).
    steps = {"lora": sft, "lora_full_logits": lora_full_logits, "bitune": sft}

    def step() -> None:
        model.zero_grad(set_to_none=True)
        steps[method]()
        model.zero_grad(set_to_none=True)

    return step


def fused_head_bytes(config, batch_shape: tuple[int, int, int], device: torch.device, dtype: torch.dtype,
                     skip_arithmetic: bool, method: str = "lora") -> tuple[int, int]:
    """TRL's fused LM head alone (forward and backward of `trl.kernels.ChunkedLogProbFunction`, with the fields
    SFTTrainer asks for) at the positions `method` gives it: its peak bytes on `device` and the positions it scores.
    Why: off Triton devices (a CPU) TRL scores every position it is handed and folds each vocabulary tile with float32
    temporaries in torch, which dominates a step on a CPU; with Triton (CUDA) it scores the answer positions only and
    folds in the kernel. LoRA hands it whole rows (P + A - 1 positions each), Bitune its answer chunks (x_m and the
    answer, A + 1 positions each), so on a CPU LoRA's head scores three times Bitune's positions at P=512, A=256; on
    a GPU both score the A answer positions of each row."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction, _use_triton
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    batch_size, prompt, answer = batch_shape
    text_config = config.get_text_config()
    scored = {"lora": prompt + answer - 1, "bitune": answer + 1}[method]
    positions = batch_size * (answer if _use_triton(device) else scored)
    hidden = torch.zeros(positions, text_config.hidden_size, device=device, dtype=dtype, requires_grad=True)
    weight = torch.zeros(text_config.vocab_size, text_config.hidden_size, device=device, dtype=dtype)
    targets = torch.zeros(positions, dtype=torch.long, device=device)

    def head() -> None:
        log_probs = ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE,
                                                 None, 1.0, SFT_FIELDS)[0]
        (-log_probs).sum().backward()
        hidden.grad = None

    measured = (lambda: SkipMatmulArithmetic.around(head)) if skip_arithmetic else head
    return peak_bytes_during(measured, device), positions


def prompt_caches_bytes(config, batch_shape: tuple[int, int, int], dtype: torch.dtype) -> int:
    """The floor of Bitune's extra memory: the keys and values both prompt passes record (x_1..x_{P-1} of every row,
    every layer, in the model's dtype), which the mix keeps for the backward pass (`mixing._MixInFloat32` saves both
    caches in their own dtype): layers x 2 passes x (keys + values) x batch x kv_heads x (P - 1) x head_dim x bytes."""
    text_config = config.get_text_config()
    kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    batch_size, prompt, _ = batch_shape
    return (text_config.num_hidden_layers * 2 * 2 * batch_size * kv_heads * (prompt - 1) * head_dim
            * torch.finfo(dtype).bits // 8)


def second_pass_inputs_bytes(config, batch_shape: tuple[int, int, int], dtype: torch.dtype) -> int:
    """What checkpointing a second pass over the prompt keeps beyond LoRA's one pass: each decoder layer's input to
    the bidirectional prompt pass, to recompute the layer from (LoRA's one pass over P + A positions matches Bitune's
    causal prompt pass and answer pass): layers x batch x (P - 1) x hidden size x bytes."""
    text_config = config.get_text_config()
    batch_size, prompt, _ = batch_shape
    return (text_config.num_hidden_layers * batch_size * (prompt - 1) * text_config.hidden_size
            * torch.finfo(dtype).bits // 8)


def excess_over_lora(result: dict, settings: tuple[str, ...] = ("_checkpointing", "")) -> dict:
    """Bitune's peak minus LoRA's per setting, next to the floor (`prompt_caches_bytes`) and, with checkpointing, the
    floor plus the second prompt pass's checkpointed inputs (`second_pass_inputs_bytes`): in all, per decoder layer
    where extrapolated (the difference of their per-layer slopes), and with each method's fused head (measured alone,
    `*_fused_head`) taken out of its peak, which is what differs most between a CPU and a GPU."""
    peaks, per_layer = result["peak_bytes"], result.get("per_layer_bytes", {})
    floor, second_pass = result["prompt_caches"], result["second_pass_inputs"]
    excess = {}
    for setting in settings:
        bitune, lora = f"bitune{setting}", f"lora{setting}"
        if bitune not in peaks or lora not in peaks:
            continue
        cell = {"bytes": peaks[bitune] - peaks[lora], "floor_bytes": floor["bytes"]}
        if setting == "_checkpointing":
            cell["checkpointed_floor_bytes"] = floor["bytes"] + second_pass["bytes"]
        if "bitune_fused_head" in result and "lora_fused_head" in result:
            heads = result["bitune_fused_head"]["peak_bytes"] - result["lora_fused_head"]["peak_bytes"]
            cell["without_heads_bytes"] = cell["bytes"] - heads
            cell["without_heads_ratio"] = ((peaks[bitune] - result["bitune_fused_head"]["peak_bytes"])
                                           / (peaks[lora] - result["lora_fused_head"]["peak_bytes"]))
            # Over LoRA's peak with its head scoring Bitune's positions instead of whole rows, as on a GPU, where
            # TRL's Triton head scores the supervised positions only (A a row; Bitune's head scores A + 1). It
            # takes LoRA's peak to be where its head runs, as it is with checkpointing here (the head is most of it).
            cell["same_head_ratio"] = peaks[bitune] / (peaks[lora] + heads)
        if bitune in per_layer and lora in per_layer:
            cell["per_layer_bytes"] = per_layer[bitune] - per_layer[lora]
            cell["floor_per_layer_bytes"] = floor["per_layer_bytes"]
            if setting == "_checkpointing":
                cell["checkpointed_floor_per_layer_bytes"] = floor["per_layer_bytes"] + second_pass["per_layer_bytes"]
        excess[setting] = cell
    return excess


def full_logits_bytes(config, batch_size: int, length: int, dtype: torch.dtype) -> int:
    """What transformers' loss holds at once over every position: the logits, their float32 copy, the float32
    log-softmax and its gradient."""
    vocab = config.get_text_config().vocab_size
    return batch_size * length * vocab * (torch.finfo(dtype).bits // 8 + 3 * 4)


def base_model(config, device: torch.device, dtype: torch.dtype, initialise: bool) -> torch.nn.Module:
    """A random base model, or, when the arithmetic is skipped anyway, one whose weights are allocated but never
    initialised (drawing billions of random numbers takes minutes on a CPU, and memory does not depend on them)."""
    if initialise:
        return random_base(config, device, dtype, "sdpa")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.to_empty(device=device)
    with torch.no_grad():  # zeros, not whatever the memory held (denormal garbage makes element-wise ops crawl)
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.zero_()
    return model


def measure_method(config, method: str, checkpointing: bool, batch_shape: tuple[int, int, int],
                   device: torch.device, dtype: torch.dtype, skip_arithmetic: bool) -> int:
    """Peak bytes of one step of `method` on a fresh random model of `config` (built, measured, freed)."""
    model = prepared_model(base_model(config, device, dtype, initialise=not skip_arithmetic), method, checkpointing)
    batch = training_batch(*batch_shape, config.get_text_config().vocab_size, device)
    step = step_function(model, method, batch)
    measured = (lambda: SkipMatmulArithmetic.around(step)) if skip_arithmetic else step
    measured()  # warm-up: lazily made buffers (rotary tables, LoRA's dropout identity) are not the step's own
    return peak_bytes_during(measured, device)


def measure_shape(shape: RealShape, layer_counts: list[int] | None, batch_shape: tuple[int, int, int],
                  device: torch.device, dtype: torch.dtype, skip_arithmetic: bool, memory_cap_gib: float,
                  methods: tuple[str, ...] = METHODS, log: Callable[[str], None] = print) -> dict:
    """Every method with and without checkpointing on `shape`: peaks in bytes, in full or extrapolated per layer."""
    batch_size, prompt, answer = batch_shape
    counts = layer_counts or [shape.num_hidden_layers]
    result = {"num_hidden_layers": shape.num_hidden_layers, "measured_layers": counts,
              "extrapolated": counts != [shape.num_hidden_layers], "peak_bytes": {}, "measured_peak_bytes": {},
              "skipped": {}}
    for checkpointing in (True, False):
        for method in methods:
            key = f"{method}{'_checkpointing' if checkpointing else ''}"
            if method == "lora_full_logits":
                needed = full_logits_bytes(shape.config(counts[0]), batch_size, prompt + answer, dtype)
                if needed > memory_cap_gib * GIB:
                    result["skipped"][key] = (f"its logits over every position alone take {needed / GIB:.1f} GiB, "
                                              f"over --memory_cap_gib {memory_cap_gib}")
                    continue
            peaks = {}
            for layers in counts:
                peaks[layers] = measure_method(shape.config(layers), method, checkpointing, batch_shape, device,
                                               dtype, skip_arithmetic)
                log(f"{shape.name} {key} at {layers} layers: {peaks[layers] / GIB:.3f} GiB")
            result["measured_peak_bytes"][key] = {str(layers): peak for layers, peak in peaks.items()}
            if len(counts) == 1:
                result["peak_bytes"][key] = peaks[counts[0]]
            else:
                (low, peak_low), (high, peak_high) = sorted(peaks.items())[:1] + sorted(peaks.items())[-1:]
                per_layer = (peak_high - peak_low) / (high - low)
                result.setdefault("per_layer_bytes", {})[key] = per_layer
                result["peak_bytes"][key] = round(peak_low + (shape.num_hidden_layers - low) * per_layer)
    for method in FUSED_HEAD_METHODS:
        if method in methods:
            head_bytes, positions = fused_head_bytes(shape.config(counts[0]), batch_shape, device, dtype,
                                                     skip_arithmetic, method)
            result[f"{method}_fused_head"] = {"peak_bytes": head_bytes, "positions": positions}
            log(f"{shape.name} TRL's fused head alone at {method}'s {positions} positions: {head_bytes / GIB:.3f} GiB")
    return with_comparisons(result, shape, batch_shape, dtype)


def with_comparisons(result: dict, shape: RealShape, batch_shape: tuple[int, int, int], dtype: torch.dtype) -> dict:
    """`result` with what is derived from its peaks: Bitune over LoRA, the floors, Bitune's excess over LoRA."""
    peaks = result["peak_bytes"]
    result["bitune_over_lora"] = {
        setting: peaks[f"bitune{setting}"] / peaks[f"lora{setting}"] for setting in ("", "_checkpointing")
        if f"lora{setting}" in peaks and f"bitune{setting}" in peaks
    }
    result["prompt_caches"] = {"bytes": prompt_caches_bytes(shape.config(), batch_shape, dtype),
                               "per_layer_bytes": prompt_caches_bytes(shape.config(1), batch_shape, dtype)}
    result["second_pass_inputs"] = {"bytes": second_pass_inputs_bytes(shape.config(), batch_shape, dtype),
                                    "per_layer_bytes": second_pass_inputs_bytes(shape.config(1), batch_shape, dtype)}
    result["bitune_excess_over_lora"] = excess_over_lora(result)
    return result


def merge_remeasured(earlier: dict, remeasured: dict) -> dict:
    """An earlier shape's result with the methods of `remeasured` (a result of some methods only) replaced by their
    new figures; the other methods' are kept as they were measured."""
    merged = json.loads(json.dumps(earlier))
    for field in ("peak_bytes", "measured_peak_bytes", "per_layer_bytes", "skipped"):
        kept = {key: value for key, value in merged.get(field, {}).items()
                if not any(key in (method, f"{method}_checkpointing") for method in remeasured["methods"])}
        merged[field] = {**kept, **remeasured.get(field, {})}
    for method in FUSED_HEAD_METHODS:
        if method in remeasured["methods"]:
            merged[f"{method}_fused_head"] = remeasured[f"{method}_fused_head"]
    return merged


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shapes = {**REAL_SHAPES, **TINY_SHAPES}
    parser.add_argument("--shapes", nargs="+", choices=sorted(shapes),
                        help=f"default: {' '.join([*FULL_DEPTH, *EXTRAPOLATED])} (with --remeasure: the report's)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2],
                        help="layer counts for the extrapolated shapes (default 1 2)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--answer", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--arithmetic", default="skip", choices=["skip", "run"],
                        help="skip the matrix products' arithmetic (same allocations, see above) or run it")
    parser.add_argument("--memory_cap_gib", type=float, default=3.0,
                        help="skip `lora_full_logits` where its logits alone would take more than this")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--resume", action="store_true",
                        help="keep the shapes --json already holds (measured with the same settings) and measure only "
                             "the others: a run stopped part-way (killed, out of memory) goes on in a fresh process")
    parser.add_argument("--remeasure", nargs="+", choices=METHODS, metavar="METHOD",
                        help="measure these methods again on the shapes of the report --json holds (measured with "
                             "the same settings; all, or those of --shapes), keeping the other methods' figures: "
                             "after a change to one method's code, only its rows change (recorded in the report's "
                             "`remeasured`)")
    args = parser.parse_args(argv)
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json: the folder {args.json.parent} does not exist; create it or write elsewhere.")
    if args.resume and (args.json is None or not args.json.is_file()):
        parser.error("--resume keeps the shapes of an earlier report: give that report's file as --json.")
    if args.remeasure and (args.json is None or not args.json.is_file()):
        parser.error("--remeasure updates an earlier report: give that report's file as --json.")
    if args.remeasure and args.resume:
        parser.error("--remeasure and --resume cannot be combined: finish the report with --resume first.")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was asked for, but this torch build sees no CUDA device.")
    if len(set(args.layers)) < 2 or min(args.layers) < 1:
        parser.error(f"--layers needs two different layer counts of at least 1 to extrapolate, got {args.layers}.")
    if min(args.batch, args.prompt, args.answer) < 1 or args.prompt < 2:
        parser.error("--batch and --answer must be at least 1 and --prompt at least 2 (Bitune mixes P - 1 tokens).")
    args.shapes_given = args.shapes is not None
    args.shapes = [shapes[name] for name in (args.shapes or [*FULL_DEPTH, *EXTRAPOLATED])]
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)  # several threads per process on a shared CPU wait at every barrier (benchmarks/README)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    batch_shape = (args.batch, args.prompt, args.answer)
    report = {
        "settings": {"batch_size": args.batch, "prompt_length": args.prompt, "answer_length": args.answer,
                     "dtype": args.dtype, "device": args.device, "arithmetic": args.arithmetic,
                     "lora_rank": lora_config().r, "methods": args.methods, "attn_implementation": "sdpa",
                     "layers": args.layers},
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "peft": peft.__version__, "python": sys.version.split()[0], "machine": platform.machine()},
        "shapes": {},
    }
    if args.remeasure:
        return remeasure(args, report, device, dtype, batch_shape)
    if args.resume:
        report["shapes"] = earlier_shapes(json.loads(args.json.read_text()), report, [s.name for s in args.shapes])
    for shape in args.shapes:
        if shape.name in report["shapes"]:
            print(f"{shape.name}: kept from {args.json}")
            continue
        layer_counts = sorted(set(args.layers)) if shape.name in EXTRAPOLATED else None
        report["shapes"][shape.name] = measure_shape(shape, layer_counts, batch_shape, device, dtype,
                                                     args.arithmetic == "skip", args.memory_cap_gib,
                                                     tuple(args.methods))
        if args.json:  # after each shape, so that a long run keeps what it has measured
            args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    return report


def remeasure(args: argparse.Namespace, report: dict, device: torch.device, dtype: torch.dtype,
              batch_shape: tuple[int, int, int]) -> dict:
    """`--remeasure`: the report in `--json`, its `--remeasure` methods measured again on each of its shapes (those of
    `--shapes` only, where given), the report written back after each shape."""
    earlier = json.loads(args.json.read_text())
    if earlier.get("settings") != report["settings"]:
        raise SystemExit(f"--remeasure: the report was measured with other settings ({earlier.get('settings')}) "
                         f"than these ({report['settings']}); give the same options it was measured with.")
    shapes = {**REAL_SHAPES, **TINY_SHAPES}
    methods = tuple(method for method in METHODS if method in args.remeasure)
    asked = [shape.name for shape in args.shapes] if args.shapes_given else list(earlier["shapes"])
    missing = [name for name in asked if name not in earlier["shapes"]]
    if missing:
        raise SystemExit(f"--remeasure: the report holds no {', '.join(missing)}; measure new shapes with --resume.")
    earlier["remeasured"] = {"methods": list(methods), "environment": report["environment"]}
    for name, result in earlier["shapes"].items():
        if name not in asked:
            continue
        layer_counts = result["measured_layers"] if result["extrapolated"] else None
        new = measure_shape(shapes[name], layer_counts, batch_shape, device, dtype, args.arithmetic == "skip",
                            args.memory_cap_gib, methods)
        earlier["shapes"][name] = with_comparisons(merge_remeasured(result, {**new, "methods": methods}),
                                                   shapes[name], batch_shape, dtype)
        args.json.write_text(json.dumps(earlier, indent=2) + "\n")
    print(table(earlier))
    return earlier


def earlier_shapes(earlier: dict, report: dict, names: list[str]) -> dict:
    """The shapes an earlier report measured, in the order of `names`, if it was measured with the same settings (a
    resumed report must be one measurement); refuses one that was not."""
    if earlier.get("settings") != report["settings"]:
        raise SystemExit(f"--resume: the report was measured with other settings ({earlier.get('settings')}) than "
                         f"these ({report['settings']}); measure into a new --json file instead.")
    unknown = sorted(set(earlier["shapes"]) - set(names))
    if unknown:
        raise SystemExit(f"--resume: the report holds shapes not asked for now ({', '.join(unknown)}); add them to "
                         "--shapes so that the report keeps them.")
    return {name: earlier["shapes"][name] for name in names if name in earlier["shapes"]}


def table(report: dict) -> str:
    """Peak GiB per shape and method, with and without checkpointing; then Bitune's excess over LoRA next to the
    floor, the prompt passes' caches (and with checkpointing, next to the floor plus the second pass's inputs)."""
    columns = [f"{m}{c}" for c in ("_checkpointing", "") for m in METHODS]
    lines = ["shape            " + " ".join(f"{c:>29}" for c in columns)]
    for name, shape in report["shapes"].items():
        cells = [f"{shape['peak_bytes'][c] / GIB:29.2f}" if c in shape["peak_bytes"] else f"{'-':>29}"
                 for c in columns]
        lines.append(f"{name:16} " + " ".join(cells))
    for name, shape in report["shapes"].items():
        for setting, cell in shape.get("bitune_excess_over_lora", {}).items():
            line = (f"{name} {'with' if setting else 'without'} checkpointing: Bitune - LoRA "
                    f"{cell['bytes'] / GIB:.2f} GiB")
            if "without_heads_bytes" in cell:
                line += (f" ({cell['without_heads_bytes'] / GIB:.2f} GiB with each fused head taken out; "
                         f"Bitune / LoRA {cell['same_head_ratio']:.2f} with LoRA's head at Bitune's positions)")
            if "per_layer_bytes" in cell:
                line += (f", {cell['per_layer_bytes'] / MIB:.1f} MiB per layer against a floor of "
                         f"{cell['floor_per_layer_bytes'] / MIB:.1f}")
                if "checkpointed_floor_per_layer_bytes" in cell:
                    line += f" ({cell['checkpointed_floor_per_layer_bytes'] / MIB:.1f} with the second pass's inputs)"
            line += f"; floor (the prompt passes' caches) {cell['floor_bytes'] / GIB:.2f} GiB"
            if "checkpointed_floor_bytes" in cell:
                line += f", {cell['checkpointed_floor_bytes'] / GIB:.2f} GiB with the second pass's inputs"
            lines.append(line)
    return "\n".join(lines)


def depth_words(shape: dict) -> str:
    return (f"{', '.join(map(str, shape['measured_layers']))} of {shape['num_hidden_layers']}, extrapolated"
            if shape["extrapolated"] else f"all {shape['num_hidden_layers']}")


def markdown(report: dict) -> str:
    """docs/training.md's table: peak GiB per shape, with and without checkpointing, Bitune over LoRA (TRL), and TRL's
    fused head alone on the device measured, at LoRA's and at Bitune's positions."""
    lines = ["| Model (decoder layers measured) | checkpointing | LoRA, TRL's loss | LoRA, transformers' loss "
             "| Bitune, TRL's loss | Bitune / LoRA (TRL) | TRL's head alone, LoRA / Bitune |",
             "| --- | --- |" + " ---: |" * 5]
    for name, shape in report["shapes"].items():
        heads = [shape.get(f"{method}_fused_head") for method in FUSED_HEAD_METHODS]
        for setting, words in (("_checkpointing", "yes"), ("", "no")):
            cells = [f"{shape['peak_bytes'][key] / GIB:.2f}" if key in shape["peak_bytes"] else "over the cap"
                     for key in (f"{method}{setting}" for method in METHODS)]
            ratio = shape["bitune_over_lora"].get(setting)
            cells += [f"{ratio:.2f}" if ratio is not None else "-",
                      " / ".join(f"{head['peak_bytes'] / GIB:.2f}" if head else "-" for head in heads)]
            lines.append(f"| {name} ({depth_words(shape)}) | {words} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def excess_markdown(report: dict) -> str:
    """docs/training.md's second table: Bitune's peak minus LoRA's next to its floor, the keys and values of both
    prompt passes (`prompt_caches_bytes`), and with checkpointing the floor plus the second prompt pass's
    checkpointed inputs (`second_pass_inputs_bytes`), in all and per decoder layer."""
    lines = ["| Model (decoder layers measured) | checkpointing | Bitune - LoRA, GiB | the same, heads taken out "
             "| Bitune / LoRA, heads taken out | Bitune / LoRA, same head | floor: prompt caches, GiB "
             "| floor + second pass's inputs, GiB "
             "| Bitune - LoRA per layer, MiB | floor per layer, MiB | floor + second pass's inputs per layer, MiB |",
             "| --- | --- |" + " ---: |" * 9]
    for name, shape in report["shapes"].items():
        for setting, words in (("_checkpointing", "yes"), ("", "no")):
            cell = shape.get("bitune_excess_over_lora", {}).get(setting)
            if cell is None:
                continue
            cells = [f"{cell['bytes'] / GIB:.2f}",
                     f"{cell['without_heads_bytes'] / GIB:.2f}" if "without_heads_bytes" in cell else "-",
                     f"{cell['without_heads_ratio']:.2f}" if "without_heads_ratio" in cell else "-",
                     f"{cell['same_head_ratio']:.2f}" if "same_head_ratio" in cell else "-",
                     f"{cell['floor_bytes'] / GIB:.2f}",
                     f"{cell['checkpointed_floor_bytes'] / GIB:.2f}" if "checkpointed_floor_bytes" in cell else "-",
                     f"{cell['per_layer_bytes'] / MIB:.1f}" if "per_layer_bytes" in cell else "-",
                     f"{cell['floor_per_layer_bytes'] / MIB:.1f}" if "per_layer_bytes" in cell else "-",
                     f"{cell['checkpointed_floor_per_layer_bytes'] / MIB:.1f}"
                     if "checkpointed_floor_per_layer_bytes" in cell else "-"]
            lines.append(f"| {name} ({depth_words(shape)}) | {words} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
