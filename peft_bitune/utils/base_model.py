"""What peft-bitune reads of a base model: its config's text part, its number of layers, how many positions a
sequence may take, the width of a token's keys (or values), and its decoder stack."""

from __future__ import annotations

from typing import Any


def text_config(model: Any) -> Any:
    """The text part of a model's config (the config itself for a text-only model)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def max_positions(model: Any) -> int | None:
    """
    How many positions a sequence (prompt, training row, conversation, prompt plus generated tokens) may take: the
    config's `max_position_embeddings`, or `None` (no limit) where the model declares it can go further or says
    nothing.

    Two kinds of config declare it: rope scaling (a `rope_type` other than "default", on any layer type), where
    `max_position_embeddings` no longer states the usable length reliably (it is the scaled length in some configs, the
    original one in others, e.g. a YaRN factor added to Qwen2.5), and sliding-window attention on every layer, where
    each layer attends to its window only, however long the sequence.
    """
    config = text_config(model)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None or has_rope_scaling(config) or slides_on_every_layer(config):
        return None
    return limit


def has_rope_scaling(config: Any) -> bool:
    """Whether the config scales its rotary position embeddings (`rope_parameters`, `rope_scaling` before
    transformers 5; one dict, or one per layer type)."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    per_type = parameters.values() if all(isinstance(value, dict) for value in parameters.values()) else [parameters]
    return any(
        (entry.get("rope_type") or entry.get("type") or "default") != "default" for entry in per_type if entry
    )


def sliding_window_layers(config: Any) -> list[bool]:
    """Which layers attend within a sliding window, as transformers' own generation cache sees them."""
    from transformers import DynamicCache

    return list(DynamicCache(config=config).is_sliding)


def slides_on_every_layer(config: Any) -> bool:
    """Whether every layer attends within a sliding window."""
    sliding = sliding_window_layers(config)
    return bool(sliding) and all(sliding)


def has_sliding_window_layers(config: Any) -> bool:
    """Whether any layer attends within a sliding window."""
    return any(sliding_window_layers(config))


def num_layers(model: Any) -> int:
    """The number of decoder layers, which is the number of key/value cache layers."""
    return text_config(model).num_hidden_layers


def decoder_of(model: Any) -> Any:
    """The decoder stack under the LM head (e.g. `LlamaModel` inside `LlamaForCausalLM`)."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
