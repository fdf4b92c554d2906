"""`load_llm`: a `vllm.LLM` that serves a Bitune adapter, with the engine options Bitune needs."""

from __future__ import annotations

import os
from typing import Any

import vllm

from .adapter import read_config
from .options import bitune_architecture, check_chat, engine_kwargs
from .registration import register


class BituneLLM(vllm.LLM):
    """vLLM's `LLM` for a Bitune adapter: `chat` refuses what the adapter cannot read exactly (see `check_chat`)."""

    def __init__(self, *args, bitune_multi_turn: str, **kwargs) -> None:
        self.bitune_multi_turn = bitune_multi_turn
        super().__init__(*args, **kwargs)

    def chat(self, messages, *args, **kwargs):
        check_chat(messages, self.bitune_multi_turn)
        return super().chat(messages, *args, **kwargs)


def adapter_folder(adapter: str) -> str:
    """A local folder of the adapter: `adapter` itself, or its Hub snapshot (from the cache with HF_HUB_OFFLINE=1)."""
    if os.path.isdir(adapter):
        return os.path.abspath(adapter)
    from huggingface_hub import snapshot_download

    return snapshot_download(adapter)


def load_llm(adapter: str, **engine_kwargs_: Any) -> BituneLLM:
    """
    A `vllm.LLM` serving the Bitune adapter `adapter` (a folder or a Hub id) on the base model its config names, as
    `AutoPeftModelForCausalLM` reads it. Engine keyword arguments pass through to `vllm.LLM`; the ones Bitune needs
    (no prefix caching, no chunked prefill, a step budget of the longest prompt, eager mode) are set, and a conflicting
    one is refused before the engine starts.
    """
    from transformers import AutoConfig

    folder = adapter_folder(adapter)
    config = read_config(folder)
    base = engine_kwargs_.pop("model", None) or config.get("base_model_name_or_path")
    if not base:
        raise ValueError(f"The adapter config in {folder!r} names no base model: pass `model=` (the base model).")
    base_config = AutoConfig.from_pretrained(base)
    text_config = base_config.get_text_config()
    architecture = bitune_architecture(base_config.architectures)
    kwargs = engine_kwargs(folder, architecture, getattr(text_config, "max_position_embeddings", None),
                           engine_kwargs_)
    from .adapter import check_inner_method

    check_inner_method(config)
    register()
    return BituneLLM(model=base, bitune_multi_turn=config.get("multi_turn", "alternating"), **kwargs)
