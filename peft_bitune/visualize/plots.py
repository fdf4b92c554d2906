"""The drawings of `peft_bitune.visualize`: attention maps of the two prompt passes, the per-layer mixing
coefficients, and their history during training. They need matplotlib (the `viz` extra), imported when a drawing
is made."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from peft import PeftModel

from ..tuner.model import BituneModel
from .attention_capture import AttentionMaps, attention_maps
from .mixing_records import MixingHistory, mixing_coefficients, mixing_history

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# The axis label of every plot of the mixing coefficients.
_ALPHA_LABEL = "alpha (weight of the bidirectional cache)"


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
