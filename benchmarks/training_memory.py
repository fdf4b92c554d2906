"""
Peak memory of one training step, LoRA against Bitune, each with its loss computed the way its trainer computes it.

    python benchmarks/training_memory.py --memory_cap_gib 10 --autocast \
        --json docs/results/training_memory_autocast.json  # as the trainer runs it with bf16=True (~50 min)
    python benchmarks/training_memory.py --memory_cap_gib 10 --json docs/results/training_memory.json  # all (~45 min)
    python benchmarks/training_memory.py --shapes smollm2-135m --dtype float32
    python benchmarks/training_memory.py --json docs/results/training_memory.json --resume  # go on after a stop
    python benchmarks/training_memory.py --memory_cap_gib 10 --json docs/results/training_memory.json \
        --remeasure bitune  # after a change to Bitune: its rows measured again, the others kept

The peak is the bytes allocated during one step (forward, loss, TRL's metrics, backward) above what was allocated
before it (`measure.peak_bytes_during`: the weights and the batch are not counted). With `--autocast` the forward, the
loss and the metrics run under `torch.autocast(bfloat16)` and the backward after it, as transformers' `Trainer` runs
a step with `bf16=True` (`BituneSFTConfig`'s default, and what TRL runs on a GPU); CPU autocast stands in for CUDA's.
The weights are bf16 either way, but PEFT keeps the adapters (and Bitune its mixing scalars) in float32: without
autocast their products run in float32, under it in bf16. Methods:

- `lora`: TRL's `SFTTrainer` (1.16): `model(**batch, fused_lm_head=True)` through its fused LM head
  (`trl.trainer.utils.add_fused_lm_head`), which projects through the LM head in tiles and returns per-token
  log-probabilities; the loss is their negated sum over the supervised tokens, then TRL's metrics (entropy, token
  accuracy) from the head's `entropy` and `is_top1`, without gradient.
- `lora_full_logits`: `model(**batch).loss`, transformers' own loss, with logits at every position (a plain
  `Trainer`, or TRL before the fused head). Skipped where those logits alone would pass `--memory_cap_gib`.
- `bitune`: `BituneSFTTrainer`, whose loss is `SFTTrainer.compute_loss` itself: the same call, loss and metrics as
  `lora`. The Bitune forward answers it from its answer passes (`peft_bitune/tuner/fused_head.py`).

TRL's head as a GPU runs it (`fused_head_as_on_cuda`). On a CPU, TRL 1.16's head scores every position it is handed
and folds each vocabulary tile in torch, with float32 temporaries of the tile's size (about 1 GiB at 3,000 positions
and a 262k vocabulary): a figure that kept them would charge both methods for memory no GPU allocates, and pull
Bitune's ratio to LoRA towards 1. On CUDA (`trl/kernels/chunked_logprob.py`, `trl/trainer/utils.py`) the head
(1) scores the supervised positions only (`hidden_states[mask]`), (2) folds each tile in a Triton kernel that keeps
its statistics in registers and writes them, and the tile's gradient, in place, and (3) accumulates the gradient
products into float32 with `addmm(..., out_dtype=float32, out=...)`, without float32 copies of the tile. So on a CPU
the measurement runs TRL's own head with those three as on CUDA: `_use_triton` true for the position selection, and
the folds and the float32 accumulation left out (they allocate nothing on CUDA; their values are not needed to count
memory). Every buffer the head allocates itself (its bf16 tile of up to 4,096 positions × the vocabulary chunk, the
per-position statistics, the float32 gradient of the hidden states, the gathered positions) is then allocated as on
CUDA. On a GPU (`--device cuda`, `benchmarks/gpu_check.py`) nothing is modelled: the real kernel runs.

Each shape gives `bitune_over_lora` with and without checkpointing, and `bitune_excess_over_lora`: Bitune's peak
minus LoRA's, in all and per decoder layer where extrapolated. With checkpointing it is next to what Bitune must keep
beyond LoRA: `second_pass_inputs`, each decoder layer's input to the second prompt pass, which checkpointing keeps to
recompute the layer from (`second_pass_inputs_bytes`; LoRA's one pass over P + A positions matches Bitune's causal
prompt pass and answer pass). Nothing else is held across layers: a checkpointed step runs the prompt passes' layers
without autograd and differentiates them layer by layer inside the answer pass's backward
(`peft_bitune/tuner/layer_inputs.py`). `activation_floor_ratio` is the least
a layer's activations cost when every pass keeps its own: the positions Bitune's three passes run (P - 1 twice,
A + 1) over LoRA's P + A.

Shapes too deep for the machine are built at full width with `--layers` decoder layers (2 and 3 by default) and
extrapolated linearly to their full depth: every decoder layer adds the same activations, so the peak is
`peak(2) + (L - 2) * (peak(3) - peak(2))` (not from 1 layer: there the peak comes at another moment of the step).
The matrix products' arithmetic is skipped (`--arithmetic skip`, the default): their outputs are allocated at their
real shape and dtype and left zero, so every allocation is the real one while the step takes seconds instead of many
minutes on a CPU; `tests/test_gpu_check.py` checks that it gives exactly the peak of the full arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from unittest import mock

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


def trainer_autocast(device: torch.device, autocast: bool):
    """What transformers' `Trainer` runs `compute_loss` under: bf16 autocast with `bf16=True`, nothing otherwise (the
    backward runs after it, outside)."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if autocast else nullcontext()


def step_function(model: torch.nn.Module, method: str, batch: dict[str, torch.Tensor],
                  autocast: bool = False) -> Callable[[], None]:
    """One training step of `method` on `batch`, its loss computed as its trainer computes it (under bf16 autocast
    with `autocast`, as `Trainer` does with `bf16=True`)."""
    device = batch["input_ids"].device

    def sft() -> None:  # trl.SFTTrainer.compute_loss, default "nll" loss, and its metrics; then Trainer's backward
        with trainer_autocast(device, autocast):
            outputs = model(**batch, use_cache=False, fused_lm_head=True)
            loss = (-outputs.log_probs).sum() / outputs.label_mask.sum().clamp(min=1)
            with torch.no_grad():
                num_valid = outputs.label_mask.sum()
                _metrics = (outputs.entropy.detach().sum() / num_valid, outputs.is_top1.sum() / num_valid)
            del outputs  # the Trainer keeps the loss only
        loss.backward()

    def lora_full_logits() -> None:  # transformers.Trainer.compute_loss
        with trainer_autocast(device, autocast):
            loss = model(**batch, use_cache=False).loss
        loss.backward()

    # LoRA through TRL's `SFTTrainer`, Bitune through `BituneSFTTrainer`, whose loss is `SFTTrainer.compute_loss`
    # itself: the Bitune forward answers the fused-head call from its answer passes (peft_bitune/tuner/fused_head.py).
    steps = {"lora": sft, "lora_full_logits": lora_full_logits, "bitune": sft}

    def step() -> None:
        model.zero_grad(set_to_none=True)
        steps[method]()
        model.zero_grad(set_to_none=True)

    return step


@contextmanager
def fused_head_as_on_cuda(device: torch.device) -> Iterator[None]:
    """On a CPU, TRL's fused head allocating what it allocates on CUDA (see the module's docstring): the supervised
    positions only, and no torch temporaries for the Triton folds or the float32 accumulation, which are left out
    (the values are meaningless then: for measuring memory only). On CUDA, the real head."""
    if device.type == "cuda":
        yield
        return
    from trl.kernels import chunked_logprob
    from trl.trainer import utils as trl_utils

    def in_registers(*args, **kwargs) -> None:
        """A Triton fold: reads the tile and writes its statistics (or the tile's gradient) in place."""

    def accumulate_into_float32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """`torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)` on CUDA: nothing allocated."""

    with ExitStack() as patches:
        patches.enter_context(mock.patch.object(trl_utils, "_use_triton", lambda device: True))
        patches.enter_context(mock.patch.object(chunked_logprob, "_forward_tile", in_registers))
        patches.enter_context(mock.patch.object(chunked_logprob, "_backward_tile", in_registers))
        patches.enter_context(mock.patch.object(chunked_logprob, "_addmm_fp32", accumulate_into_float32))
        yield


def fused_head_bytes(config, batch_shape: tuple[int, int, int], device: torch.device, dtype: torch.dtype,
                     skip_arithmetic: bool, autocast: bool = False) -> tuple[int, int]:
    """TRL's fused LM head alone, as on CUDA (`fused_head_as_on_cuda`): forward and backward of
    `trl.kernels.ChunkedLogProbFunction`, with the fields SFTTrainer asks for, at the A answer positions of every row
    (the supervised positions, the only ones a GPU scores, for LoRA and Bitune alike); its peak bytes on `device` and
    the positions it scores."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    batch_size, _, answer = batch_shape
    text_config = config.get_text_config()
    positions = batch_size * answer
    hidden = torch.zeros(positions, text_config.hidden_size, device=device, dtype=dtype, requires_grad=True)
    weight = torch.zeros(text_config.vocab_size, text_config.hidden_size, device=device, dtype=dtype)
    targets = torch.zeros(positions, dtype=torch.long, device=device)

    def head() -> None:
        with trainer_autocast(device, autocast):
            log_probs = ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE,
                                                     None, 1.0, SFT_FIELDS)[0]
        (-log_probs).sum().backward()
        hidden.grad = None

    measured = (lambda: SkipMatmulArithmetic.around(head)) if skip_arithmetic else head
    with fused_head_as_on_cuda(device):
        return peak_bytes_during(measured, device), positions


def second_pass_inputs_bytes(config, batch_shape: tuple[int, int, int], dtype: torch.dtype) -> int:
    """What checkpointing a second pass over the prompt keeps beyond LoRA's one pass: each decoder layer's input to
    the bidirectional prompt pass, to recompute the layer from (LoRA's one pass over P + A positions matches Bitune's
    causal prompt pass and answer pass): layers x batch x (P - 1) x hidden size x bytes."""
    text_config = config.get_text_config()
    batch_size, prompt, _ = batch_shape
    return (text_config.num_hidden_layers * batch_size * (prompt - 1) * text_config.hidden_size
            * torch.finfo(dtype).bits // 8)


def activation_floor_ratio(batch_shape: tuple[int, int, int]) -> float:
    """The floor of Bitune's activations over LoRA's when every pass keeps its own layer inputs: Bitune's passes run
    P - 1, P - 1 and A + 1 positions a row, LoRA's one pass P + A."""
    _, prompt, answer = batch_shape
    return (2 * (prompt - 1) + answer + 1) / (prompt + answer)


def excess_over_lora(result: dict, settings: tuple[str, ...] = ("_checkpointing", "")) -> dict:
    """Bitune's peak minus LoRA's per setting, in all and per decoder layer where extrapolated (the difference of
    their per-layer slopes); with checkpointing, next to its floor: the second prompt pass's checkpointed layer inputs
    (`second_pass_inputs_bytes`)."""
    peaks, per_layer = result["peak_bytes"], result.get("per_layer_bytes", {})
    floor = result["second_pass_inputs"]
    excess = {}
    for setting in settings:
        bitune, lora = f"bitune{setting}", f"lora{setting}"
        if bitune not in peaks or lora not in peaks:
            continue
        cell = {"bytes": peaks[bitune] - peaks[lora]}
        if setting == "_checkpointing":
            cell["floor_bytes"] = floor["bytes"]
        if bitune in per_layer and lora in per_layer:
            cell["per_layer_bytes"] = per_layer[bitune] - per_layer[lora]
            if setting == "_checkpointing":
                cell["floor_per_layer_bytes"] = floor["per_layer_bytes"]
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
                   device: torch.device, dtype: torch.dtype, skip_arithmetic: bool, autocast: bool = False) -> int:
    """Peak bytes of one step of `method` on a fresh random model of `config` (built, measured, freed)."""
    model = prepared_model(base_model(config, device, dtype, initialise=not skip_arithmetic), method, checkpointing)
    batch = training_batch(*batch_shape, config.get_text_config().vocab_size, device)
    step = step_function(model, method, batch, autocast)
    measured = (lambda: SkipMatmulArithmetic.around(step)) if skip_arithmetic else step
    with fused_head_as_on_cuda(device) if method in FUSED_HEAD_METHODS else nullcontext():
        measured()  # warm-up: lazily made buffers (rotary tables, LoRA's dropout identity) are not the step's own
        return peak_bytes_during(measured, device)


def measure_shape(shape: RealShape, layer_counts: list[int] | None, batch_shape: tuple[int, int, int],
                  device: torch.device, dtype: torch.dtype, skip_arithmetic: bool, memory_cap_gib: float,
                  methods: tuple[str, ...] = METHODS, log: Callable[[str], None] = print,
                  autocast: bool = False) -> dict:
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
                                               dtype, skip_arithmetic, autocast)
                log(f"{shape.name} {key} at {layers} layers: {peaks[layers] / GIB:.3f} GiB")
            result["measured_peak_bytes"][key] = {str(layers): peak for layers, peak in peaks.items()}
            if len(counts) == 1:
                result["peak_bytes"][key] = peaks[counts[0]]
            else:
                (low, peak_low), (high, peak_high) = sorted(peaks.items())[:1] + sorted(peaks.items())[-1:]
                per_layer = (peak_high - peak_low) / (high - low)
                result.setdefault("per_layer_bytes", {})[key] = per_layer
                result["peak_bytes"][key] = round(peak_low + (shape.num_hidden_layers - low) * per_layer)
    if any(method in methods for method in FUSED_HEAD_METHODS):
        head_bytes, positions = fused_head_bytes(shape.config(counts[0]), batch_shape, device, dtype, skip_arithmetic,
                                                 autocast)
        result["fused_head"] = {"peak_bytes": head_bytes, "positions": positions}
        log(f"{shape.name} TRL's fused head alone at its {positions} positions: {head_bytes / GIB:.3f} GiB")
    return with_comparisons(result, shape, batch_shape, dtype)


def with_comparisons(result: dict, shape: RealShape, batch_shape: tuple[int, int, int], dtype: torch.dtype) -> dict:
    """`result` with what is derived from its peaks: Bitune over LoRA, the floors, Bitune's excess over LoRA."""
    peaks = result["peak_bytes"]
    result["bitune_over_lora"] = {
        setting: peaks[f"bitune{setting}"] / peaks[f"lora{setting}"] for setting in ("", "_checkpointing")
        if f"lora{setting}" in peaks and f"bitune{setting}" in peaks
    }
    result["activation_floor_ratio"] = activation_floor_ratio(batch_shape)
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
    if "fused_head" in remeasured:
        merged["fused_head"] = remeasured["fused_head"]
    return merged


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shapes = {**REAL_SHAPES, **TINY_SHAPES}
    parser.add_argument("--shapes", nargs="+", choices=sorted(shapes),
                        help=f"default: {' '.join([*FULL_DEPTH, *EXTRAPOLATED])} (with --remeasure: the report's)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    # Not 1: with one layer the step's peak comes at another moment (in TRL's head) than with more, and the
    # difference of 1 and 2 layers is not a layer's share.
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 3],
                        help="layer counts for the extrapolated shapes (default 2 3)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--answer", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--autocast", action="store_true",
                        help="run the forward, the loss and the metrics under bf16 autocast, as Trainer does with "
                             "bf16=True (BituneSFTConfig's default); without it, the dtypes as loaded")
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
                     "layers": args.layers, "autocast": args.autocast},
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "peft": peft.__version__, "python": sys.version.split()[0], "machine": platform.machine()},
        "shapes": {},
    }
    if args.remeasure:
        return remeasure(args, report, device, dtype, batch_shape)
    if args.resume:
        report["shapes"] = earlier_shapes(with_autocast_setting(json.loads(args.json.read_text())), report,
                                          [s.name for s in args.shapes])
    for shape in args.shapes:
        if shape.name in report["shapes"]:
            print(f"{shape.name}: kept from {args.json}")
            continue
        layer_counts = sorted(set(args.layers)) if shape.name in EXTRAPOLATED else None
        report["shapes"][shape.name] = measure_shape(shape, layer_counts, batch_shape, device, dtype,
                                                     args.arithmetic == "skip", args.memory_cap_gib,
                                                     tuple(args.methods), autocast=args.autocast)
        if args.json:  # after each shape, so that a long run keeps what it has measured
            args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    return report


def remeasure(args: argparse.Namespace, report: dict, device: torch.device, dtype: torch.dtype,
              batch_shape: tuple[int, int, int]) -> dict:
    """`--remeasure`: the report in `--json`, its `--remeasure` methods measured again on each of its shapes (those of
    `--shapes` only, where given), the report written back after each shape."""
    earlier = with_autocast_setting(json.loads(args.json.read_text()))
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
                            args.memory_cap_gib, methods, autocast=args.autocast)
        earlier["shapes"][name] = with_comparisons(merge_remeasured(result, {**new, "methods": methods}),
                                                   shapes[name], batch_shape, dtype)
        args.json.write_text(json.dumps(earlier, indent=2) + "\n")
    print(table(earlier))
    return earlier


def with_autocast_setting(earlier: dict) -> dict:
    """An earlier report, its settings saying whether it ran under autocast (reports from before `--autocast` did
    not)."""
    earlier.get("settings", {}).setdefault("autocast", False)
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
    """Peak GiB per shape and method, with and without checkpointing; then Bitune's excess over LoRA, with
    checkpointing next to its floor (the second prompt pass's layer inputs)."""
    columns = [f"{m}{c}" for c in ("_checkpointing", "") for m in METHODS]
    lines = ["shape            " + " ".join(f"{c:>29}" for c in columns)]
    for name, shape in report["shapes"].items():
        cells = [f"{shape['peak_bytes'][c] / GIB:29.2f}" if c in shape["peak_bytes"] else f"{'-':>29}"
                 for c in columns]
        lines.append(f"{name:16} " + " ".join(cells))
    for name, shape in report["shapes"].items():
        for setting, cell in shape.get("bitune_excess_over_lora", {}).items():
            line = (f"{name} {'with' if setting else 'without'} checkpointing: Bitune / LoRA "
                    f"{shape['bitune_over_lora'][setting]:.2f} (floor {shape['activation_floor_ratio']:.2f}), "
                    f"Bitune - LoRA {cell['bytes'] / GIB:.2f} GiB")
            if "floor_bytes" in cell:
                line += f" against a floor of {cell['floor_bytes'] / GIB:.2f} (the second pass's inputs)"
            if "per_layer_bytes" in cell:
                line += f", {cell['per_layer_bytes'] / MIB:.1f} MiB per layer"
                if "floor_per_layer_bytes" in cell:
                    line += f" against {cell['floor_per_layer_bytes'] / MIB:.1f}"
            lines.append(line)
    return "\n".join(lines)


def depth_words(shape: dict) -> str:
    return (f"{', '.join(map(str, shape['measured_layers']))} of {shape['num_hidden_layers']}, extrapolated"
            if shape["extrapolated"] else f"all {shape['num_hidden_layers']}")


def markdown(report: dict) -> str:
    """docs/training.md's table: peak GiB per shape, with and without checkpointing, Bitune over LoRA (TRL) next to
    the positions Bitune's three passes run over LoRA's one (`activation_floor_ratio`), and TRL's fused head alone
    (as on CUDA)."""
    lines = ["| Model (decoder layers measured) | checkpointing | LoRA, TRL's loss | LoRA, transformers' loss "
             "| Bitune, TRL's loss | Bitune / LoRA (TRL) | positions, three passes / one | TRL's head alone |",
             "| --- | --- |" + " ---: |" * 6]
    for name, shape in report["shapes"].items():
        head = shape.get("fused_head")
        for setting, words in (("_checkpointing", "yes"), ("", "no")):
            cells = [f"{shape['peak_bytes'][key] / GIB:.2f}" if key in shape["peak_bytes"] else "over the cap"
                     for key in (f"{method}{setting}" for method in METHODS)]
            ratio = shape["bitune_over_lora"].get(setting)
            cells += [f"{ratio:.2f}" if ratio is not None else "-", f"{shape['activation_floor_ratio']:.2f}",
                      f"{head['peak_bytes'] / GIB:.3f}" if head else "-"]
            lines.append(f"| {name} ({depth_words(shape)}) | {words} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def excess_markdown(report: dict) -> str:
    """docs/training.md's second table: Bitune's peak minus LoRA's, in all and per decoder layer, with checkpointing
    next to its floor, the second prompt pass's checkpointed layer inputs (`second_pass_inputs_bytes`)."""
    lines = ["| Model (decoder layers measured) | checkpointing | Bitune - LoRA, GiB "
             "| floor: second pass's inputs, GiB | Bitune - LoRA per layer, MiB "
             "| floor per layer, MiB |",
             "| --- | --- |" + " ---: |" * 4]
    for name, shape in report["shapes"].items():
        for setting, words in (("_checkpointing", "yes"), ("", "no")):
            cell = shape.get("bitune_excess_over_lora", {}).get(setting)
            if cell is None:
                continue
            cells = [f"{cell['bytes'] / GIB:.2f}",
                     f"{cell['floor_bytes'] / GIB:.2f}" if "floor_bytes" in cell else "-",
                     f"{cell['per_layer_bytes'] / MIB:.1f}" if "per_layer_bytes" in cell else "-",
                     f"{cell['floor_per_layer_bytes'] / MIB:.1f}" if "floor_per_layer_bytes" in cell else "-"]
            lines.append(f"| {name} ({depth_words(shape)}) | {words} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
