"""
The attention of the two prompt passes of a Bitune model (paper, appendix A.12), captured as the passes run.

What the maps cover: exactly what the two prompt passes read, which is the instruction *minus its last token*
(prompt[:-1], steps 1-2 of `passes.py`). The last instruction token is never read by those passes: it goes through the
causal answer pass over the mixed cache. So a prompt of P tokens gives (P - 1) x (P - 1) maps, labelled with the first
P - 1 tokens. Each map comes from `BitunePasses.prompt_pass` itself (its weight set, its mask, its positions), run with
eager attention, the only implementation that returns probabilities. Drawing is in `plots.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from peft import PeftModel
from torch import nn

from .. import compat
from ..constants import BIDIRECTIONAL, CAUSAL, WeightSet
from ..tuner.caches import pass_cache
from ..tuner.checks import attention_mask_for, check_contiguous_rows, positions_for
from ..tuner.find_tuner import require_bitune_tuner
from ..tuner.model import BituneModel
from ..tuner.passes import BitunePasses
from ..utils.base_model import decoder_of, num_layers, text_config
from ..utils.messages import format_rows


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

    maps = {}
    with _eager_attention(hf_model), _evaluation_mode(hf_model):
        # Every layer's attention is needed: the passes must not end at the last layer's keys/values.
        passes = dataclasses.replace(bitune._passes(), stop_early=False)
        for weight_set in (CAUSAL, BIDIRECTIONAL):
            maps[weight_set] = _pass_attention(passes, weight_set, prefix_ids, prefix_mask, position_ids, layer, head)
    return AttentionMaps(
        causal=maps[CAUSAL],
        bidirectional=maps[BIDIRECTIONAL],
        input_ids=prefix_ids.cpu(),
        attention_mask=prefix_mask.long().cpu(),
        layer=layer,
        head=head,
    )


def _pass_attention(
    passes: BitunePasses,
    weight_set: WeightSet,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    layer: int | None,
    head: int | None,
) -> torch.Tensor:
    """One prompt pass, as training and generation run it, with `output_attentions`; returns its (batch, seq, seq)
    map, padding rows zeroed."""
    output = passes.prompt_pass(
        weight_set,
        pass_cache(num_layers(passes.model)),
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        output_attentions=True,
    )
    attentions = output.attentions
    if not attentions or any(weights is None for weights in attentions):
        raise RuntimeError(
            f"{type(decoder_of(passes.model)).__name__} returned no attention probabilities although it runs eager "
            "attention; this architecture cannot be visualised."
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
    lengths = check_contiguous_rows(valid)
    if bool((lengths < 2).any()):
        rows = format_rows((lengths < 2).nonzero().flatten().tolist())
        raise ValueError(
            f"Prompt rows {rows} have fewer than 2 tokens. The prompt passes read every token of the prompt but the "
            "last, so a prompt needs at least 2 tokens to have an attention map."
        )
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
