"""
Batches whose rows use different adapters (PEFT's `adapter_names`, one adapter name per row), run as one batch.

As PEFT's LoRA does it: every pass of the batch hands each tuner layer the per-row names of that pass's weight sets
(`"{name}__causal"`, `"{name}__bidirectional"`, or `"__base__"`: no adapter), and the inner method applies each row's
weights to its own rows (LoRA's `adapter_names`, `_mixed_batch_forward`). Each row's prompt caches are mixed with its
own adapter's coefficients; a `"__base__"` row mixes nothing (alpha 0), so its cache is exactly the causal pass of the
base weights. A mixed batch is then one forward, one prefill and one `generate` loop.

Where one batch cannot express a difference, the smallest part runs apart: the bidirectional prompt pass of rows whose
adapters read it with another mask (`second_pass_attention`) is a call of its own (`BitunePasses.prompt_pass`), a
forward over adapters with different `multi_turn` settings runs once per setting (`forward_per_setting`), and a layer
of an inner method without a per-row mechanism runs once more for each adapter's rows (`RowRouting`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from .. import compat
from ..constants import BIDIRECTIONAL, CAUSAL, IGNORE_INDEX, WeightSet

# PEFT's name for the rows of a mixed batch that run without any adapter.
BASE_ADAPTER = "__base__"

# The `adapter_names` PEFT's hook (`BituneModel._enable_peft_forward_hooks`) was given, with the tuner it was given to,
# for the call it wraps: `PeftModel.forward` and `generate` drop them before calling the tuner.
_NAMES_OF_CALL: ContextVar[tuple[Any, Any] | None] = ContextVar("bitune_adapter_names", default=None)


@contextmanager
def names_of_call(tuner: Any, adapter_names: Any) -> Iterator[None]:
    """Within the block, `adapter_names` are the names of `tuner`'s call (read by `call_names`)."""
    token = _NAMES_OF_CALL.set((tuner, adapter_names))
    try:
        yield
    finally:
        _NAMES_OF_CALL.reset(token)


def call_names(tuner: Any, given: Any) -> Any:
    """The names of a call: given as an argument, or else handed to `tuner` by PEFT's hook around the call."""
    held = _NAMES_OF_CALL.get()
    if given is None and held is not None and held[0] is tuner:
        return held[1]
    return given


def check_adapter_names(
    adapter_names: Any, batch_size: int, known: Sequence[str], training: bool, per_prompt: int = 1
) -> list[str]:
    """Refuse bad `adapter_names` before any work, as LoRA does; returns one name per row. With `per_prompt` output
    rows per prompt (`num_return_sequences`), one name per output row is taken too (LoRA's form without beams) when
    the rows of each prompt name one adapter, since a prompt is read once."""
    if isinstance(adapter_names, str) or not isinstance(adapter_names, (list, tuple)):
        raise TypeError(
            f"`adapter_names` must be a list with one adapter name per row, got {type(adapter_names).__name__}."
        )
    if training:
        raise ValueError(
            "Cannot pass `adapter_names` when the model is in training mode (PEFT's LoRA refuses it too): call "
            "`model.eval()` first; to train several adapters, train each one with `set_adapter`."
        )
    names = [str(name) for name in adapter_names]
    if per_prompt > 1 and len(names) == batch_size * per_prompt:
        blocks = [names[i : i + per_prompt] for i in range(0, len(names), per_prompt)]
        if any(len(set(block)) > 1 for block in blocks):
            raise ValueError(
                "`adapter_names` names different adapters for the return sequences of one prompt, which is read once: "
                "repeat the prompt in `input_ids` instead, one row per adapter."
            )
        names = [block[0] for block in blocks]
    if len(names) != batch_size:
        per_output = f" (or {batch_size * per_prompt}, one per returned sequence)" if per_prompt > 1 else ""
        raise ValueError(
            f"`adapter_names` has {len(names)} names for a batch of {batch_size} rows: give one adapter name per row "
            f"(per prompt in `generate`, also with `num_beams`{per_output})."
        )
    unknown = sorted(set(names) - {*known, BASE_ADAPTER})
    if unknown:
        raise ValueError(
            f"`adapter_names` names adapters {unknown} that this model does not have: {sorted(known)} (or "
            f"{BASE_ADAPTER!r} for the base model)."
        )
    return names


class RowRouting:
    """
    Runs every tuner layer with each row's inner adapter of the pass that runs, for as long as a pass is routed.

    A layer with a per-row mechanism (LoRA's, `compat.routes_rows`) is handed the names as PEFT's own hook hands them
    (`adapter_names`). Any other layer (IA3, LoHa, ..., DoRA) is run again for each adapter's rows, routed to that
    adapter alone, and its output rows replaced: the one fallback of an inner method without a per-row mechanism, at
    the cost of running such a layer once more. A layer that sees more rows than names (the rows repeated for beams
    or return sequences) takes each name as many times, in transformers' order.
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = layers
        self.names: list[str] | None = None
        self._apart = False  # within a layer run again for some rows

    @contextmanager
    def routed(self, names: list[str]) -> Iterator[None]:
        """Within the block, every layer runs each row with `names[row]`; the hooks are there for the outermost
        block only."""
        previous, self.names = self.names, names
        handles = [] if previous is not None else [
            layer.register_forward_pre_hook(self._hand_names, with_kwargs=True) if compat.routes_rows(layer)
            else layer.register_forward_hook(self._run_rows_apart, with_kwargs=True) for layer in self.layers
        ]
        try:
            yield
        finally:
            self.names = previous
            for handle in handles:
                handle.remove()

    def _names_for(self, rows: int) -> list[str]:
        repeat = rows // len(self.names)
        return self.names if repeat == 1 else [name for name in self.names for _ in range(repeat)]

    def _hand_names(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs["adapter_names"] = self._names_for(len(args[0]))
        return args, kwargs

    def _run_rows_apart(self, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        if self._apart:
            return output
        names, previous = self._names_for(len(args[0])), compat.routed_adapters(module)
        self._apart = True
        try:
            for name in dict.fromkeys(names):
                rows = [i for i, n in enumerate(names) if n == name]
                compat.route_layers([module], [] if name == BASE_ADAPTER else [name])
                output[rows] = module(args[0][rows], *args[1:], **kwargs)
        finally:
            compat.route_layers([module], previous)
            self._apart = False
        return output


@dataclass(frozen=True)
class RowAdapters:
    """
    What each row of a mixed-adapter batch runs with, pass by pass.

    Args:
        names (`tuple[str, ...]`): each row's Bitune adapter, or `"__base__"`.
        inner (`dict[WeightSet, list[str]]`): each row's inner adapter of each pass (`"__base__"` for none).
        key_alpha, value_alpha (`torch.Tensor` of shape (num_layers, rows, 1, 1, 1)): each row's mixing coefficients
            (0 for `"__base__"` rows and for the layers its adapter does not mix), float32.
        mixed (`list[bool]`): per layer, whether any row mixes it.
        configs (`dict[str, BituneConfig]`): the named adapters' settings.
        routing (`RowRouting`): the hooks that hand the names to the layers.
    """

    names: tuple[str, ...]
    inner: dict[WeightSet, list[str]]
    key_alpha: torch.Tensor
    value_alpha: torch.Tensor
    mixed: list[bool]
    configs: dict[str, Any]
    routing: RowRouting

    @property
    def has_base_rows(self) -> bool:
        return BASE_ADAPTER in self.names

    @property
    def all_base(self) -> bool:
        return set(self.names) == {BASE_ADAPTER}

    def routed(self, weight_set: WeightSet, decoder_layer: nn.Module | None = None) -> Any:
        """Run the model with each row's weight set `weight_set` (the routing of `BituneModel.weights`)."""
        return self.routing.routed(self.inner[weight_set])

    def coefficients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each layer's per-row alphas, (num_layers, rows, 1, 1, 1), as `BituneKVMixer.coefficients` gives one's."""
        return self.key_alpha, self.value_alpha

    def select(self, rows: torch.Tensor) -> RowAdapters:
        """The same for rows `rows` of the batch (a history-mode turn runs on the rows that have it)."""
        picked = rows.tolist()
        return replace(
            self,
            names=tuple(self.names[i] for i in picked),
            inner={ws: [names[i] for i in picked] for ws, names in self.inner.items()},
            key_alpha=self.key_alpha[:, rows.to(self.key_alpha.device)],
            value_alpha=self.value_alpha[:, rows.to(self.value_alpha.device)],
        )

    def rows_by(self, setting: str) -> dict[Any, torch.Tensor]:
        """The rows of each value of the adapters' `setting` (a `BituneConfig` field), in order of first row;
        `"__base__"` rows, which no setting concerns, go with the first."""
        values = [getattr(self.configs[name], setting) if name != BASE_ADAPTER else None for name in self.names]
        first = next((value for value in values if value is not None), None)
        values = [first if value is None else value for value in values]
        return {value: torch.tensor([i for i, v in enumerate(values) if v == value])
                for value in dict.fromkeys(values)}


def row_adapters(
    tuner: Any, adapter_names: Any, batch_size: int | None, per_prompt: int = 1, fused_lm_head: bool = False
) -> RowAdapters | None:
    """What each row of a call of `tuner` (a `BituneModel`) runs with, checked before any work; `None` for an
    ordinary call. The names come as an argument or from PEFT's hook (`call_names`). With the adapters disabled every
    row runs the base model, as in PEFT."""
    adapter_names = call_names(tuner, adapter_names)
    if adapter_names is None or tuner._adapters_disabled():
        return None
    if fused_lm_head:
        raise ValueError("`adapter_names` cannot be combined with `fused_lm_head=True` (TRL's training head): run "
                         "each adapter's rows in a batch of their own, after `set_adapter`.")
    if batch_size is None:
        raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
    names = check_adapter_names(adapter_names, batch_size, list(tuner.peft_config), tuner.training, per_prompt)
    configs = {name: tuner.peft_config[name] for name in dict.fromkeys(names) if name != BASE_ADAPTER}
    routing = RowRouting(tuner._router.index.tuner_layers)
    mixers = {name: tuner.bitune_mixers[name] for name in configs}
    num_layers = len(tuner.bitune_mixers[tuner.active_adapter].mixed)
    device = next(iter(mixers.values())).key_weights.device if mixers else torch.device("cpu")
    zeros = torch.zeros(num_layers, dtype=torch.float32, device=device)
    alphas = [mixers[name].coefficients() if name in mixers else (zeros, zeros) for name in names]
    key_alpha, value_alpha = (torch.stack([a[i].to(device) for a in alphas], dim=1)[:, :, None, None, None]
                              for i in (0, 1))
    inner = {name: tuner._inner_names(name) for name in configs}
    return RowAdapters(
        names=tuple(names),
        inner={ws: [inner[n][ws] if n in inner else BASE_ADAPTER for n in names] for ws in (CAUSAL, BIDIRECTIONAL)},
        key_alpha=key_alpha,
        value_alpha=value_alpha,
        mixed=[any(mixer.mixed[layer] for mixer in mixers.values()) for layer in range(num_layers)],
        configs=configs,
        routing=routing,
    )


def multi_turn_of(rows: RowAdapters | None, active: str) -> tuple[str, dict[str, torch.Tensor] | None]:
    """How a forward lays out conversations (`multi_turn`): the setting of the active adapter, or of the rows'
    adapters; with the rows of each setting where they differ (`forward_per_setting`)."""
    if rows is None:
        return active, None
    parts = rows.rows_by("multi_turn")
    return (next(iter(parts)) or active), (parts if len(parts) > 1 else None)  # `None`: only "__base__" rows


def forward_per_setting(
    forward: Callable[..., Any], parts: dict[Any, torch.Tensor], rows: RowAdapters, inputs: Any,
    arguments: dict[str, Any], num_items_in_batch: Any,
) -> Any:
    """The one fallback of a mixed-adapter forward: adapters that lay a conversation out differently (`multi_turn`)
    run one `forward` per setting over their rows (`parts`); the logits go back in row order and the losses, each
    divided by the supervised tokens of the whole batch (counted in the checked `inputs`), add up."""
    if inputs.labels is not None and num_items_in_batch is None:
        num_items_in_batch = (inputs.labels != IGNORE_INDEX).sum()
    logits, loss = None, None
    for subset in parts.values():
        output = forward(**{name: value[subset.to(value.device)] if isinstance(value, torch.Tensor) else value
                            for name, value in arguments.items()},
                         adapter_names=[rows.names[i] for i in subset], num_items_in_batch=num_items_in_batch)
        if logits is None:
            logits = output.logits.new_zeros((len(rows.names), *output.logits.shape[1:]))
        logits[subset.to(logits.device)] = output.logits
        loss = output.loss if loss is None else loss + output.loss
    return CausalLMOutputWithPast(loss=loss, logits=logits)


def refuse_base_rows_over_bitune_cache(rows: RowAdapters | None, bitune_cache: bool) -> None:
    """`"__base__"` rows run the base model, which continues a Bitune cache no more than inside `disable_adapter()`."""
    if rows is not None and rows.has_base_rows and bitune_cache:
        raise ValueError(
            f"{BASE_ADAPTER!r} rows run the base model, which cannot continue a Bitune cache (the mixed keys/values "
            "of Bitune adapters), as inside `disable_adapter()`: continue those rows without `adapter_names` inside "
            "`disable_adapter()`, with a cache of the base model's own."
        )


def refuse_packed_rows(rows: RowAdapters | None) -> None:
    """A packed batch's passes are one row over all its examples, and PEFT's `adapter_names` route whole rows."""
    if rows is not None:
        raise ValueError(
            "`adapter_names` names an adapter per row, and a packed batch (`position_ids` restarting within a row) "
            "runs all its examples as one row in each pass: give `adapter_names` with padded batches, or pack the "
            "examples of each adapter into batches of their own."
        )


def base_rows_read_once(inputs: Any, rows: RowAdapters | None) -> Any:
    """Checked training inputs (`checks.TrainingInputs`) in which each `"__base__"` row is one instruction token and
    then an answer: read once, causally, as the base model reads it, with logits at every position. Its labels keep
    supervising exactly what they did."""
    if rows is None or not rows.has_base_rows:
        return inputs
    base = torch.tensor([name == BASE_ADAPTER for name in rows.names], device=inputs.valid.device)
    after_first = torch.arange(inputs.valid.shape[1], device=base.device)[None, :] > inputs.row_starts[:, None]
    return replace(inputs, is_answer=torch.where(base[:, None], inputs.valid & after_first, inputs.is_answer))
