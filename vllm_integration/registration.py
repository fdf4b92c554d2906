"""Registers the Bitune model classes with vLLM: the `vllm.general_plugins` entry point calls `register`."""

from __future__ import annotations

from .options import ARCHITECTURES


def register() -> None:
    """Make vLLM's `ModelRegistry` know each Bitune class by name (imported lazily, when an engine builds one).
    Safe to call more than once: vLLM's plugins may load in several processes."""
    from vllm import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    for name in ARCHITECTURES.values():
        if name not in known:
            ModelRegistry.register_model(name, f"vllm_integration.models:{name}")
