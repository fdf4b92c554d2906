"""
Where in a training step does bf16 rounding move Bitune's gradient? Op by op and layer by layer, in float64.

Every operation runs in float64, exact to 16 digits, except at the sites a row names: there the tensors are rounded to
bf16 as autocast rounds them, the inputs, weights and output of a matrix product (`F.linear`: the base layers, LoRA's
A and B, the LM head) or of the attention (`F.scaled_dot_product_attention`), and the gradients flowing back through
those tensors (the gradient of a bf16 tensor is bf16). Everything autocast keeps in float32 (embeddings, norms, the
rotary embedding, the residual stream, Bitune's mix and loss) stays exact here. Per row, the gradient of each group
of trainable weights is compared with the exact float64 one (cosine, norm ratio), on the batch and at the point that
`bf16_gradients.py` measures (`--bitune_at`, `--batch_size`).

The first row rounds every site: it is autocast's rounding without its accumulation order, so it says whether this
emulation reproduces the measured bf16 gradients before the other rows locate the sensitivity, one kind of operation
in every layer, then every kind in one block of layers.

    python benchmarks/bf16_sensitivity.py --with_lora --detail_layers 0 1 2 3 4 --proportion_layer 0 \
        --exact_lower_layers 1 5 15 --json docs/results/bf16_sensitivity_smollm2.json

`--detail_layers 0 1 2 3 4` adds a row per base projection and per layer within those layers. `--proportion_layer 0`
asks whether the gradient moves in proportion to the rounding error: layer 0 with bf16's error scaled by 1/8, 1/4,
1/2, 1 and -1, then rounded to the finer float16 and float32. `--exact_lower_layers 1 5 15` rounds every site but
those of the lowest 1, 5, 15 layers: what keeping them in float32 would give back. The float64 step with its rounded
copies of weights and activations needs about 15 GiB on SmolLM2 with 8 rows (the command above: 12 minutes, one core).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bf16_gradients  # noqa: E402  (a script folder, not a package)

KINDS = ("base linears", "LoRA linears", "attention", "LM head")


@dataclass(frozen=True)
class Rounding:
    """What a rounded site does to a float64 tensor: adds `scale` times its error of rounding to `dtype`. Scale 1 is
    the rounding itself (as autocast rounds); other scales ask whether the gradient moves in proportion to the
    error."""

    dtype: torch.dtype = torch.bfloat16
    scale: float = 1.0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        in_dtype = tensor.to(self.dtype).to(tensor.dtype)
        return in_dtype if self.scale == 1 else tensor + self.scale * (in_dtype - tensor)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def name(self) -> str:
        return f"rounded to {self.dtype_name}" if self.scale == 1 else f"{self.dtype_name} error x {self.scale:g}"


class _Rounded(torch.autograd.Function):
    """x rounded as `rounding` says, kept in its dtype; the gradient flowing back through it rounded the same way."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, rounding: Rounding) -> torch.Tensor:
        ctx.rounding = rounding
        return rounding(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.rounding(grad), None


def rounded(tensor, rounding: Rounding = Rounding()):
    is_float = isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
    return _Rounded.apply(tensor, rounding) if is_float else tensor


@dataclass(frozen=True)
class Sites:
    """Which operations are rounded: those of `kinds`, in the decoder layers `layers` (None: every layer; the LM head,
    in no layer, whenever its kind is named), and of the base linears only the `projections` named (None:
    all of them; e.g. "down_proj"), each as `rounding` says (bf16, as autocast rounds, by default)."""

    name: str
    kinds: tuple[str, ...]
    layers: tuple[int, ...] | None = None
    projections: tuple[str, ...] | None = None
    rounding: Rounding = Rounding()

    def rounds(self, kind: str, projection: str | None, layer: int | None) -> bool:
        if kind not in self.kinds:
            return False
        if kind == "base linears" and self.projections is not None and projection not in self.projections:
            return False
        return self.layers is None or kind == "LM head" or (layer is not None and layer in self.layers)


class RoundAtSites(TorchFunctionMode):
    """Rounds `F.linear` and the attention where `sites` says, knowing the calling module from forward hooks."""

    def __init__(self, model: nn.Module, sites: Sites) -> None:
        super().__init__()
        self.sites, self.layer, self.linears, self.hooks = sites, None, [], []
        self.rounded_calls = Counter()  # per kind: what was rounded, so that a row shows it reached its sites
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                kind = "LoRA linears" if ".lora_" in name else "base linears"
                kind = "LM head" if name.endswith("lm_head") else kind
                parts = name.split(".")
                site = (kind, parts[-2] if parts[-1] == "base_layer" else parts[-1])  # e.g. ("base linears", "q_proj")
                self.hooks.append(module.register_forward_pre_hook(lambda *_, site=site: self._enter_linear(site)))
                self.hooks.append(module.register_forward_hook(lambda *_: self._leave_linear()))
            elif type(module).__name__.endswith("DecoderLayer"):
                index = int(name.rsplit(".", 1)[1])
                self.hooks.append(module.register_forward_pre_hook(lambda *_, index=index: self._enter_layer(index)))
                self.hooks.append(module.register_forward_hook(lambda *_: self._enter_layer(None)))

    # The hooks return None: a forward hook's return value would replace the module's output.
    def _enter_linear(self, site: tuple[str, str]) -> None:
        self.linears.append(site)

    def _leave_linear(self) -> None:
        self.linears.pop()

    def _enter_layer(self, layer: int | None) -> None:
        self.layer = layer

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and self.linears and self.sites.rounds(*self.linears[-1], self.layer):
            rounding = self.sites.rounding
            args = [rounded(arg, rounding) for arg in args]  # input, weight and (if given) bias
            kwargs = {key: rounded(value, rounding) for key, value in kwargs.items()}
            self.rounded_calls[self.linears[-1][0]] += 1
            return rounded(func(*args, **kwargs), rounding)
        if func is F.scaled_dot_product_attention and self.sites.rounds("attention", None, self.layer):
            query, key, value, *rest = args
            rounding = self.sites.rounding
            self.rounded_calls["attention"] += 1
            query, key, value = (rounded(tensor, rounding) for tensor in (query, key, value))
            return rounded(func(query, key, value, *rest, **kwargs), rounding)
        return func(*args, **kwargs)


ERROR_SCALES = (0.125, 0.25, 0.5, 1.0, -1.0)


def site_rows(num_layers: int, block: int, detail_layers: tuple[int, ...] = (),
              projections: tuple[str, ...] = (), proportion_layer: int | None = None,
              exact_lower_layers: tuple[int, ...] = ()) -> list[Sites]:
    """Every site; each kind in every layer; every kind in each block of layers; then, within `detail_layers`, each
    of `projections` (base linears) alone and each of those layers alone; then every kind in `proportion_layer` with
    bf16's error scaled by each of ERROR_SCALES, and rounded to float16 and to float32 (finer roundings); then, for
    each n of `exact_lower_layers`, every site but those of the lowest n layers (a float32 island there: a fix's
    candidate)."""
    rows = [Sites("every site (autocast's rounding)", KINDS)]
    rows += [Sites(kind, (kind,)) for kind in KINDS]
    for start in range(0, num_layers, block):
        layers = tuple(range(start, min(start + block, num_layers)))
        rows.append(Sites(f"layers {layers[0]}-{layers[-1]}, every kind", KINDS[:3], layers))
    if detail_layers:
        span = f"layers {min(detail_layers)}-{max(detail_layers)}"
        rows += [Sites(f"{span}, {projection}", ("base linears",), detail_layers, (projection,))
                 for projection in projections]
        rows += [Sites(f"layer {layer}, every kind", KINDS[:3], (layer,)) for layer in detail_layers]
    if proportion_layer is not None:
        roundings = [Rounding(torch.bfloat16, scale) for scale in ERROR_SCALES]
        roundings += [Rounding(torch.float16), Rounding(torch.float32)]
        rows += [Sites(f"layer {proportion_layer}, every kind, {rounding.name}", KINDS[:3], (proportion_layer,),
                       rounding=rounding) for rounding in roundings]
    rows += [Sites(f"every site but layers 0-{lowest - 1} (kept exact)", KINDS, tuple(range(lowest, num_layers)))
             for lowest in exact_lower_layers]
    return rows


def base_projections(model: nn.Module) -> tuple[str, ...]:
    """The names of the projections in a decoder layer (q_proj, ..., down_proj), in order."""
    names = dict.fromkeys(name.split(".")[-2] for name, module in model.named_modules()
                          if isinstance(module, nn.Linear) and name.endswith(".base_layer"))
    return tuple(names)


def gradients_at(model: nn.Module, batch: dict, sites: Sites | None) -> dict:
    """`bf16_gradients.gradients` in the model's dtype, rounded at `sites` (exact with None), with the count of
    rounded calls per kind."""
    if sites is None:
        return {**bf16_gradients.gradients(model, batch, autocast=False), "rounded_calls": {}}
    with RoundAtSites(model, sites) as mode:
        measured = bf16_gradients.gradients(model, batch, autocast=False)
    return {**measured, "rounded_calls": dict(mode.rounded_calls)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=list(bf16_gradients.MODELS))
    parser.add_argument("--bitune_at", default="paper_start",
                        help=f"{' or '.join(bf16_gradients.BITUNE_STARTS)}, or a trained Bitune adapter's folder")
    parser.add_argument("--batch_size", type=int, help=f"rows (default: {bf16_gradients.BATCH_SIZES})")
    parser.add_argument("--block", type=int, default=5, help="decoder layers per layer-block row")
    parser.add_argument("--detail_layers", nargs="+", type=int, default=[],
                        help="also round each base projection alone, and each layer alone, within these layers")
    parser.add_argument("--proportion_layer", type=int,
                        help="also round every kind in this layer with bf16's error scaled (x1/8 ... x-1) and rounded "
                             "to float16 and float32: does the gradient move in proportion to the error?")
    parser.add_argument("--exact_lower_layers", nargs="+", type=int, default=[],
                        help="also round every site but those of the lowest n layers, for each n given (a float32 "
                             "island there, as a fix would keep)")
    parser.add_argument("--with_lora", action="store_true", help="also LoRA's every-site row (its control)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if problem := bf16_gradients.bitune_at_problem(args.bitune_at):
        parser.error(problem)
    if args.block < 1 or (args.batch_size is not None and args.batch_size < 1):
        parser.error(f"`--block` and `--batch_size` must be at least 1, got {args.block}, {args.batch_size}.")
    if args.json and not Path(args.json).parent.is_dir():
        parser.error(f"`--json`'s folder {Path(args.json).parent} does not exist.")
    torch.set_num_threads(1)
    folder = bf16_gradients.paper_tasks_module().base_folder(args.model)
    layers = AutoConfig.from_pretrained(folder).get_text_config().num_hidden_layers
    if not set(args.detail_layers) <= set(range(layers)):
        parser.error(f"`--detail_layers` must be layers of the model, 0 to {layers - 1}, got {args.detail_layers}.")
    if not set(args.exact_lower_layers) <= set(range(1, layers)):
        parser.error(f"`--exact_lower_layers` must be layer counts from 1 to {layers - 1}, "
                     f"got {args.exact_lower_layers}.")
    if args.proportion_layer is not None and args.proportion_layer not in range(layers):
        parser.error(f"`--proportion_layer` must be a layer of the model, 0 to {layers - 1}, "
                     f"got {args.proportion_layer}.")
    batch_size = args.batch_size or bf16_gradients.BATCH_SIZES[args.model]
    batch = bf16_gradients.trainer_batches(folder, 1, batch_size)[0]
    report = {"model": args.model, "bitune_at": args.bitune_at, "batch_size": batch_size,
              "batch": {"length": int(batch["input_ids"].shape[1]), "real_tokens": int(batch["attention_mask"].sum()),
                        "answer_tokens": int((batch["labels"] != -100).sum())},
              "cpu": bf16_gradients.lscpu()["model_name"], "threads": 1,
              "versions": {"python": platform.python_version(), "torch": torch.__version__}, "rows": []}
    for method in ("bitune", "lora") if args.with_lora else ("bitune",):
        model = bf16_gradients.build(folder, method, args.bitune_at)
        bf16_gradients.to_precision(model, torch.float64)
        exact = gradients_at(model, batch, None)
        report.setdefault("float64_loss", {})[method] = round(exact["loss"], 6)
        rows = site_rows(layers, args.block, tuple(args.detail_layers), base_projections(model), args.proportion_layer,
                         tuple(args.exact_lower_layers))
        for sites in rows if method == "bitune" else rows[:1]:
            started = time.time()
            measured = gradients_at(model, batch, sites)
            row = {"method": method, "sites": sites.name, "kinds": list(sites.kinds),
                   "layers": list(sites.layers) if sites.layers else "all",
                   "rounding": {"dtype": sites.rounding.dtype_name, "scale": sites.rounding.scale},
                   "loss": round(measured["loss"], 6),
                   "groups": bf16_gradients.agreement(measured["gradients"], exact["gradients"]),
                   "rounded_calls": measured["rounded_calls"],
                   "seconds": round(time.time() - started, 1)}
            report["rows"].append(row)
            cosines = ", ".join(f"{group} {value['cosine']:.4f}" for group, value in row["groups"].items())
            print(f"{method:6} {sites.name:46} {cosines}", flush=True)
            if args.json:  # after each row, so that a stopped run keeps what it measured
                Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
