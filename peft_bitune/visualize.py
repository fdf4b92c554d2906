"""
Pictures of what a Bitune adapter learned (paper, appendix A.12): the attention of the two prompt passes, the
per-layer mixing coefficients of their caches, and how those coefficients moved during training.

The tensor functions (`attention_maps`, `mixing_coefficients`) need only torch; the drawing functions need matplotlib,
installed with the `viz` extra (`pip install peft-bitune[viz]`). `import peft_bitune` never imports this module.

What the attention maps cover: exactly what the two prompt passes read, which is the instruction *minus its last token*
(prompt[:-1], steps 1-2 of `passes.py`). The last instruction token is never read by those passes: it goes through the
causal answer pass over the mixed cache. So a prompt of P tokens gives (P - 1) x (P - 1) maps, labelled with the first
P - 1 tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from peft import PeftModel
from peft.utils import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME
from torch import nn

from . import compat
from .callbacks import layer_log_key, mean_log_key
from .common import BIDIRECTIONAL, CAUSAL, WeightSet, format_rows, has_holes, is_bitune_type, text_config
from .config import BituneConfig
from .inputs import attention_mask_for, positions_for
from .lookup import require_bitune_tuner
from .mixing import BituneKVMixer
from .model import BituneModel
from .persistence import MIXER_CHECKPOINT_KEYS

if TYPE_CHECKING:
    from matplotlib.figure import Figure


# The axis label of every plot of the mixing coefficients.
_ALPHA_LABEL = "alpha (weight of the bidirectional cache)"


@dataclass
class AttentionMaps:
    """
    Attention probabilities of the two prompt passes of a Bitune model over the same tokens.

    Rows are the source (query) tokens, columns the attended (key) tokens; each row of a real token sums to one and
    gives nothing to padding. Rows of padding tokens are all zero. Tensors are float32, on the CPU.

    Attributes:
        causal (`torch.Tensor` of shape (batch_size, seq_len, seq_len)): the causal pass (causal weights, causal mask).
        bidirectional (`torch.Tensor` of shape (batch_size, seq_len, seq_len)): the second pass (bidirectional weights,
            and the mask of the adapter's `second_pass_attention`, bidirectional unless the causal ablation is set).
        input_ids (`torch.Tensor` of shape (batch_size, seq_len)): the tokens both passes read, prompt[:-1] per row.
        attention_mask (`torch.Tensor` of shape (batch_size, seq_len)): 1 on real tokens, 0 on padding.
        layer (`int`, *optional*): the layer shown, or `None` for the average over layers.
        head (`int`, *optional*): the query head shown, or `None` for the average over heads.
    """

    causal: torch.Tensor
    bidirectional: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    layer: int | None
    head: int | None


# ---------------------------------------------------------------------------------------------------- attention maps
@torch.no_grad()
def attention_maps(
    model: PeftModel | BituneModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    layer: int | None = None,
    head: int | None = None,
) -> AttentionMaps:
    """
    Attention of the causal and the bidirectional prompt pass of a Bitune model, as the model runs them.

    Each pass runs its own weight set and mask over prompt[:-1] of every row (the last prompt token is not part of
    the prompt passes), with the same position ids as in training and generation. Padding may be on either side;
    real tokens must be contiguous. Attention probabilities need the eager attention implementation: a model loaded
    with another one is switched to eager for the call and switched back afterwards. Dropout is off during the call.

    Args:
        model (`PeftModel` or `BituneModel`): a model with an active Bitune adapter.
        input_ids (`torch.Tensor` of shape (batch_size, seq_len) or (seq_len,)): the prompts (instructions).
        attention_mask (`torch.Tensor` of the same shape, *optional*): 1 on real tokens; defaults to all ones.
        layer (`int`, *optional*): a decoder layer (negative counts from the end); defaults to the average of all.
        head (`int`, *optional*): a query head (negative counts from the end); defaults to the average of all.

    Returns:
        `AttentionMaps` with maps of shape (batch_size, n, n), n = the longest prompt minus one.

    Example:

    ```py
    >>> batch = tokenizer(["Natalia sold clips to 48 of her friends."], return_tensors="pt")
    >>> maps = attention_maps(model, batch["input_ids"], batch["attention_mask"])  # doctest: +SKIP
    >>> # maps.causal and maps.bidirectional: (1, n - 1, n - 1) for a prompt of n tokens
    >>> plot_attention_maps(maps, tokenizer, path="attention.png")  # doctest: +SKIP
    ```
    """
    bitune = require_bitune_tuner(model, "to draw its attention maps")
    hf_model = bitune.model
    config = text_config(hf_model)
    layer = _checked_index("layer", layer, config.num_hidden_layers)
    head = _checked_index("head", head, config.num_attention_heads)
    prefix_ids, prefix_mask = _prompt_pass_tokens(input_ids, attention_mask)
    device = next(hf_model.parameters()).device
    prefix_ids, prefix_mask = prefix_ids.to(device), prefix_mask.to(device)
    position_ids = positions_for(prefix_mask)
    second_pass_is_causal = bitune.peft_config[bitune.active_adapter].second_pass_attention == CAUSAL

    maps = {}
    with _eager_attention(hf_model), _evaluation_mode(hf_model):
        for weight_set, is_causal in ((CAUSAL, True), (BIDIRECTIONAL, second_pass_is_causal)):
            maps[weight_set] = _pass_attention(
                bitune, weight_set, is_causal, prefix_ids, prefix_mask, position_ids, layer, head
            )
    return AttentionMaps(
        causal=maps[CAUSAL],
        bidirectional=maps[BIDIRECTIONAL],
        input_ids=prefix_ids.cpu(),
        attention_mask=prefix_mask.long().cpu(),
        layer=layer,
        head=head,
    )


def _pass_attention(
    bitune: BituneModel,
    weight_set: WeightSet,
    is_causal: bool,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    layer: int | None,
    head: int | None,
) -> torch.Tensor:
    """One prompt pass with `output_attentions`; returns its (batch, seq, seq) map, padding rows zeroed."""
    decoder = bitune.model.get_decoder()
    with bitune.weights(weight_set):
        output = decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            is_causal=is_causal,
            output_attentions=True,
        )
    attentions = output.attentions
    if not attentions or any(weights is None for weights in attentions):
        raise RuntimeError(
            f"{type(decoder).__name__} returned no attention probabilities although it runs eager attention; "
            "this architecture cannot be visualised."
        )
    stacked = torch.stack([weights.float() for weights in attentions])  # (layers, batch, heads, seq, seq)
    stacked = stacked[layer : layer + 1] if layer is not None else stacked
    stacked = stacked[:, :, head : head + 1] if head is not None else stacked
    averaged = stacked.mean(dim=(0, 2))  # (batch, seq, seq)
    # A padding query has nothing to attend to; what softmax returns for it is meaningless.
    return (averaged * attention_mask[:, :, None].to(averaged.dtype)).cpu()


def _prompt_pass_tokens(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """prompt[:-1] of every row: the last real token of each row is dropped, then all-padding edge columns."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(
            f"`input_ids` must be a tensor, got {type(input_ids).__name__}; tokenize with return_tensors='pt'."
        )
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
        attention_mask = attention_mask[None] if attention_mask is not None else None
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"`input_ids` must be of shape (batch_size, seq_len), got {tuple(input_ids.shape)}.")
    attention_mask = attention_mask_for(input_ids, attention_mask)
    valid = attention_mask.bool()
    seq_len = valid.shape[1]
    lengths = valid.sum(dim=1)
    if bool((lengths < 2).any()):
        rows = format_rows((lengths < 2).nonzero().flatten().tolist())
        raise ValueError(
            f"Prompt rows {rows} have fewer than 2 tokens. The prompt passes read every token of the prompt but the "
            "last, so a prompt needs at least 2 tokens to have an attention map."
        )
    if bool(has_holes(valid).any()):
        raise ValueError("Prompts have padding between real tokens; pad on one side only (left or right).")
    last = seq_len - 1 - valid.flip(1).int().argmax(dim=1)
    prefix_mask = valid.clone()
    prefix_mask[torch.arange(valid.shape[0], device=valid.device), last] = False
    used = prefix_mask.any(dim=0)
    start = int(used.int().argmax())
    stop = seq_len - int(used.flip(0).int().argmax())
    return input_ids[:, start:stop], prefix_mask[:, start:stop].long()


def _checked_index(name: str, index: int | None, size: int) -> int | None:
    if index is None:
        return None
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"`{name}` must be an int or None, got {type(index).__name__}.")
    if not -size <= index < size:
        raise ValueError(f"`{name}` must be in [{-size}, {size - 1}] for this model, got {index}.")
    return index % size


@contextmanager
def _eager_attention(model: nn.Module) -> Iterator[None]:
    """Run `model` with eager attention (the only one that returns probabilities), then restore its implementation."""
    previous = compat.attention_implementation(model)
    if previous == "eager":
        yield
        return
    how_to_load = (
        f"Load the model with `attn_implementation='eager'` to draw attention maps (it uses {previous!r})."
    )
    if not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"{type(model).__name__} cannot switch its attention implementation. {how_to_load}")
    try:
        model.set_attn_implementation("eager")
        if compat.attention_implementation(model) != "eager":
            raise ValueError(f"{type(model).__name__} could not switch to eager attention. {how_to_load}")
        yield
    finally:
        model.set_attn_implementation(previous)


@contextmanager
def _evaluation_mode(model: nn.Module) -> Iterator[None]:
    """Turn dropout off for the call; every module gets back its own training flag."""
    modes = [(module, module.training) for module in model.modules()]
    try:
        model.eval()
        yield
    finally:
        for module, training in modes:
            module.training = training


# ---------------------------------------------------------------------------------------------------- mixing
def mixing_coefficients(
    source: PeftModel | BituneModel | str | os.PathLike, adapter_name: str | None = None
) -> dict[str, torch.Tensor]:
    """
    The learned mixing coefficients alpha (weight of the bidirectional cache) per layer, for keys and values.

    Args:
        source (`PeftModel`, `BituneModel` or a directory): a Bitune model, or a directory written by its
            `save_pretrained` (read without loading any model: `adapter_config.json` and `adapter_model.safetensors`).
        adapter_name (`str`, *optional*): for a model, which Bitune adapter (defaults to the active one); for a
            directory, the sub-folder PEFT saves a non-default adapter in (defaults to the directory itself).

    Returns:
        `{"keys": alphas, "values": alphas}`, each a float32 CPU tensor of shape (num_layers,).
    """
    if isinstance(source, (str, os.PathLike)):
        return _saved_mixing_coefficients(source, adapter_name)
    bitune = require_bitune_tuner(source, "to read its mixing coefficients")
    coefficients = bitune.get_mixing_coefficients(adapter_name)
    return {kind: alpha.cpu() for kind, alpha in coefficients.items()}


def _saved_mixing_coefficients(directory: str | os.PathLike, adapter_name: str | None) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    path = os.path.join(directory, adapter_name) if adapter_name not in (None, "default") else os.fspath(directory)
    config_path, weights_path = os.path.join(path, CONFIG_NAME), os.path.join(path, SAFETENSORS_WEIGHTS_NAME)
    for required in (config_path, weights_path):
        if not os.path.isfile(required):
            raise FileNotFoundError(
                f"{required} does not exist; pass a directory written by a Bitune model's `save_pretrained` (with "
                f"`safe_serialization=True`, the default), or a loaded model."
            )
    with open(config_path, encoding="utf-8") as file:
        config_data = json.load(file)
    if not is_bitune_type(config_data.get("peft_type")):
        raise ValueError(f"{config_path} describes a {config_data.get('peft_type')!r} adapter, not a Bitune one.")
    config = BituneConfig.from_pretrained(path)
    weights = {}
    with safe_open(weights_path, framework="pt") as file:
        for kind, suffix in MIXER_CHECKPOINT_KEYS.items():
            keys = [key for key in file.keys() if key == suffix or key.endswith("." + suffix)]
            if len(keys) != 1:
                raise ValueError(
                    f"Expected one tensor ending in {suffix!r} in {weights_path}, found {keys or 'none'}: this is not "
                    "a checkpoint of this version of peft-bitune."
                )
            weights[kind] = file.get_tensor(keys[0])
    mixer = BituneKVMixer(weights["keys"].numel(), config.mix_init, config.mix_scale)
    mixer.load_state_dict({"key_weights": weights["keys"], "value_weights": weights["values"]})
    key_alpha, value_alpha = mixer.coefficients()
    return {"keys": key_alpha.detach(), "values": value_alpha.detach()}


@dataclass
class MixingHistory:
    """
    The mixing coefficients over training, as `BituneMixingCallback` logged them.

    Attributes:
        steps (`list[int]`): the optimizer step of each log that holds every layer's alphas.
        keys (`torch.Tensor` of shape (len(steps), num_layers)): alpha of the keys per layer at those steps.
        values (`torch.Tensor` of shape (len(steps), num_layers)): alpha of the values per layer at those steps.
        mean_steps (`list[int]`): the step of each log that holds the means (every training log).
        mean_keys (`torch.Tensor` of shape (len(mean_steps),)): mean alpha of the keys over layers.
        mean_values (`torch.Tensor` of shape (len(mean_steps),)): mean alpha of the values over layers.
    """

    steps: list[int]
    keys: torch.Tensor
    values: torch.Tensor
    mean_steps: list[int]
    mean_keys: torch.Tensor
    mean_values: torch.Tensor


def mixing_history(log_history: Sequence[dict[str, Any]] | str | os.PathLike) -> MixingHistory:
    """
    Read the mixing coefficients a Bitune training run logged (`BituneMixingCallback`, which `BituneSFTTrainer` uses).

    Args:
        log_history (`list[dict]`, or a path): `trainer.state.log_history`, or a `trainer_state.json` (or the
            checkpoint folder holding it) that the Trainer saved.

    Returns:
        A `MixingHistory`.
    """
    logs = _log_history(log_history)
    num_layers = 0
    while any(layer_log_key("keys", num_layers) in log for log in logs):
        num_layers += 1
    per_layer = [log for log in logs if layer_log_key("keys", 0) in log]
    means = [log for log in logs if mean_log_key("keys") in log]
    if not means:
        raise ValueError(
            "The log history holds no mixing coefficients (`bitune/...` keys): train with `BituneSFTTrainer`, or add "
            "`peft_bitune.BituneMixingCallback()` to the Trainer's callbacks."
        )

    def table(kind: str) -> torch.Tensor:
        rows = [[log[layer_log_key(kind, layer)] for layer in range(num_layers)] for log in per_layer]
        return torch.tensor(rows, dtype=torch.float32).reshape(len(per_layer), num_layers)

    return MixingHistory(
        steps=[int(log["step"]) for log in per_layer],
        keys=table("keys"),
        values=table("values"),
        mean_steps=[int(log["step"]) for log in means],
        mean_keys=torch.tensor([log[mean_log_key("keys")] for log in means], dtype=torch.float32),
        mean_values=torch.tensor([log[mean_log_key("values")] for log in means], dtype=torch.float32),
    )


def _log_history(source: Sequence[dict[str, Any]] | str | os.PathLike) -> list[dict[str, Any]]:
    if not isinstance(source, (str, os.PathLike)):
        return list(source)
    path = os.path.join(source, "trainer_state.json") if os.path.isdir(source) else os.fspath(source)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} does not exist; pass `trainer.state.log_history`, a `trainer_state.json`, or a checkpoint folder "
            "that holds one."
        )
    with open(path, encoding="utf-8") as file:
        state = json.load(file)
    if "log_history" not in state:
        raise ValueError(f"{path} has no `log_history`: it is not a `trainer_state.json` written by a Trainer.")
    return state["log_history"]


# ---------------------------------------------------------------------------------------------------- drawing
def plot_attention_maps(
    maps: AttentionMaps,
    tokenizer: Any | None = None,
    row: int = 0,
    path: str | os.PathLike | None = None,
    title: str | None = None,
    shared_scale: bool = True,
) -> Figure:
    """
    Draw the causal and the bidirectional map of one prompt side by side (paper, appendix A.12).

    Source tokens run down the vertical axis, attended tokens along the horizontal one; darker means more attention.
    By default both panels share one colour scale (one colour bar), on a square-root scale from 0 to the largest value
    of either map: the causal map's first row is always 1, and on a linear scale it would wash out everything else.
    With `shared_scale=False`, each panel gets its own linear scale from 0 to its own largest value, and its colour
    bar says so. Padding is left out.

    Args:
        maps (`AttentionMaps`): the result of `attention_maps`.
        tokenizer (*optional*): labels the axes with its tokens; token ids are shown without it.
        row (`int`, defaults to 0): which prompt of the batch to draw.
        path (`str` or `os.PathLike`, *optional*): also save the figure there (PNG unless the suffix says otherwise).
        title (`str`, *optional*): a title above both panels.
        shared_scale (`bool`, defaults to `True`): one square-root colour scale for both panels, or one linear scale
            per panel.

    Returns:
        The matplotlib `Figure`.
    """
    batch_size = maps.input_ids.shape[0]
    if not -batch_size <= row < batch_size:
        raise ValueError(f"`row` must be in [{-batch_size}, {batch_size - 1}] for these maps, got {row}.")
    _check_output_path(path)
    figure_class = _figure_class()
    from matplotlib.colors import Normalize, PowerNorm

    real = maps.attention_mask[row].bool()
    labels = _token_labels(maps.input_ids[row][real].tolist(), tokenizer)
    panels = {
        "Causal pass (causal weights)": maps.causal[row][real][:, real],
        "Bidirectional pass (bidirectional weights)": maps.bidirectional[row][real][:, real],
    }
    side = min(max(3.0, 0.2 * len(labels) + 1.5), 12.0)
    figure = figure_class(figsize=(2 * side + 1.5, side + 1.0), layout="constrained")
    axes = figure.subplots(1, 2)
    largest = max(float(panel.max()) for panel in panels.values()) or 1.0
    fontsize = 8 if len(labels) <= 40 else 6
    for ax, (name, panel) in zip(axes, panels.items()):
        if shared_scale:
            norm = PowerNorm(gamma=0.5, vmin=0.0, vmax=largest)
        else:
            norm = Normalize(vmin=0.0, vmax=float(panel.max()) or 1.0)
        image = ax.imshow(panel.numpy(), cmap="Greys", norm=norm, interpolation="nearest")
        ax.set_title(name)
        ticks = range(len(labels))
        ax.set_xticks(ticks, labels, rotation=90, fontsize=fontsize)
        ax.set_yticks(ticks, labels, fontsize=fontsize)
        ax.set_xlabel("attended token")
        ax.set_ylabel("source token")
        if not shared_scale:
            label = f"attention (this panel's own scale, 0 to {norm.vmax:.2f})"
            figure.colorbar(image, ax=ax, shrink=0.8, label=label)
    if shared_scale:
        figure.colorbar(image, ax=list(axes), shrink=0.8, label="attention (one scale for both panels, square root)")
    scope = f"layer {maps.layer}" if maps.layer is not None else "average over layers"
    scope += f", head {maps.head}" if maps.head is not None else ", average over heads"
    figure.suptitle(f"{title}\n{scope}" if title else scope)
    _save(figure, path)
    return figure


def plot_mixing_coefficients(
    source: PeftModel | BituneModel | str | os.PathLike | dict[str, torch.Tensor],
    adapter_name: str | None = None,
    path: str | os.PathLike | None = None,
    title: str | None = None,
) -> Figure:
    """
    Plot the learned mixing coefficients per layer, keys and values in one plot.

    alpha is the weight of the bidirectional cache: 0 keeps only the causal pass, 1 only the bidirectional pass.

    Args:
        source: a Bitune model, a directory written by its `save_pretrained`, or the dict `mixing_coefficients`
            returns.
        adapter_name (`str`, *optional*): see `mixing_coefficients`.
        path (`str` or `os.PathLike`, *optional*): also save the figure there (PNG unless the suffix says otherwise).
        title (`str`, *optional*): the plot's title.

    Returns:
        The matplotlib `Figure`.
    """
    _check_output_path(path)
    if isinstance(source, dict):
        if set(source) != {"keys", "values"}:
            raise ValueError(f"A dict of coefficients must have the keys 'keys' and 'values', got {sorted(source)}.")
        coefficients = source
    else:
        coefficients = mixing_coefficients(source, adapter_name)
    figure_class = _figure_class()
    num_layers = coefficients["keys"].numel()
    figure = figure_class(figsize=(max(5.0, 0.25 * num_layers + 3.0), 3.6), layout="constrained")
    ax = figure.subplots()
    layers = range(num_layers)
    for kind, marker in (("keys", "o"), ("values", "s")):
        ax.plot(layers, coefficients[kind].float().cpu().numpy(), marker=marker, label=kind)
    ax.axhline(0.5, color="grey", linewidth=0.8, linestyle="--", label="0.5 (equal mix)")
    ax.set_ylim(0.0, 1.0)
    ax.set_xticks(layers if num_layers <= 40 else range(0, num_layers, 4))
    ax.set_xlabel("layer")
    ax.set_ylabel(_ALPHA_LABEL)
    ax.legend()
    ax.set_title(title or "Bitune mixing coefficients")
    _save(figure, path)
    return figure


def plot_mixing_history(
    source: Sequence[dict[str, Any]] | str | os.PathLike | MixingHistory,
    path: str | os.PathLike | None = None,
    title: str | None = None,
) -> Figure:
    """
    Plot the mixing coefficients over training: one line per layer for keys and for values (from the per-layer logs),
    and the mean over layers (from every training log) as a thick dashed line.

    Args:
        source: `trainer.state.log_history`, a `trainer_state.json` or a checkpoint folder, or a `MixingHistory`.
        path (`str` or `os.PathLike`, *optional*): also save the figure there (PNG unless the suffix says otherwise).
        title (`str`, *optional*): the figure's title.

    Returns:
        The matplotlib `Figure`.
    """
    _check_output_path(path)
    history = source if isinstance(source, MixingHistory) else mixing_history(source)
    figure_class = _figure_class()
    figure = figure_class(figsize=(10.0, 3.8), layout="constrained")
    axes = figure.subplots(1, 2, sharey=True)
    num_layers = history.keys.shape[1]
    colours = _layer_colours(num_layers)
    for ax, kind, per_layer, mean in (
        (axes[0], "keys", history.keys, history.mean_keys),
        (axes[1], "values", history.values, history.mean_values),
    ):
        for layer in range(num_layers):
            ax.plot(history.steps, per_layer[:, layer].numpy(), color=colours[layer], linewidth=1.0, marker=".",
                    label=f"layer {layer}" if num_layers <= 12 else None)
        ax.plot(history.mean_steps, mean.numpy(), color="black", linewidth=2.0, linestyle="--", label="mean")
        ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
        ax.set_ylim(0.0, 1.0)
        ax.set_xlabel("optimizer step")
        ax.set_title(kind)
    axes[0].set_ylabel(_ALPHA_LABEL)
    if num_layers > 12:  # one colour bar instead of a long legend
        import matplotlib as mpl

        mappable = mpl.cm.ScalarMappable(norm=mpl.colors.Normalize(0, num_layers - 1), cmap="viridis")
        figure.colorbar(mappable, ax=axes, label="layer")
        axes[1].legend(handles=axes[1].get_lines()[-2:-1], fontsize=8)
    else:
        axes[1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    figure.suptitle(title or "Bitune mixing coefficients during training")
    _save(figure, path)
    return figure


def _layer_colours(num_layers: int) -> list[Any]:
    import matplotlib as mpl

    cmap = mpl.colormaps["viridis"]
    return [cmap(layer / max(num_layers - 1, 1)) for layer in range(num_layers)]


def plot_prompt_attention(
    model: PeftModel | BituneModel,
    tokenizer: Any,
    prompt: str,
    layer: int | None = None,
    head: int | None = None,
    path: str | os.PathLike | None = None,
) -> Figure:
    """Tokenize one prompt (as `generate` would see it) and draw its attention maps; see `attention_maps`."""
    _check_output_path(path)
    batch = tokenizer(prompt, return_tensors="pt")
    maps = attention_maps(model, batch["input_ids"], batch.get("attention_mask"), layer=layer, head=head)
    return plot_attention_maps(maps, tokenizer=tokenizer, path=path)


def _token_labels(token_ids: Sequence[int], tokenizer: Any | None) -> list[str]:
    if tokenizer is None:
        return [str(token_id) for token_id in token_ids]
    labels = []
    for token_id in token_ids:
        text = tokenizer.decode([token_id])
        # Whitespace-only tokens would be invisible on an axis.
        labels.append(repr(text)[1:-1] if text.strip() else repr(text))
    return labels


def _figure_class() -> type[Figure]:
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "Drawing needs matplotlib: install it with `pip install peft-bitune[viz]`."
        ) from error
    return Figure


def _check_output_path(path: str | os.PathLike | None) -> None:
    if path is None:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"Cannot save the figure to {os.fspath(path)}: the directory {directory} does not exist."
        )


def _save(figure: Figure, path: str | os.PathLike | None) -> None:
    if path is not None:
        figure.savefig(path, dpi=150)
