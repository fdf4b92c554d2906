"""`load_llm`: a `vllm.LLM` that serves a Bitune adapter, with the engine options Bitune needs."""

from __future__ import annotations

import os
from typing import Any

import vllm

from .adapter import check_inner_method, read_config
from .options import bitune_architecture, check_chat, engine_kwargs, guarded_chat_template
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
    base = engine_kwargs_.pop("model", None) or config.base_model_name_or_path
    if not base:
        raise ValueError(f"The adapter config in {folder!r} names no base model: pass `model=` (the base model).")
    base_config = AutoConfig.from_pretrained(base)
    text_config = base_config.get_text_config()
    architecture = bitune_architecture(base_config.architectures)
    kwargs = engine_kwargs(folder, architecture, getattr(text_config, "max_position_embeddings", None),
                           engine_kwargs_)
    check_inner_method(config)
    register()
    return BituneLLM(model=base, bitune_multi_turn=config.multi_turn, **kwargs)


def server_arguments(adapter: str, chat_template: str | None = None, **engine_kwargs_: Any) -> list[str]:
    """
    The arguments of vLLM's OpenAI-compatible server (`vllm serve` / `python -m vllm.entrypoints.openai.api_server`)
    that serve `adapter` as `load_llm(adapter, **engine_kwargs_)` does: the same options, checked the same way. For an
    `alternating` adapter the chat template (the file `chat_template`, else the base tokenizer's) is written to a
    temporary file with a guard that refuses a chat of several user turns (`options.guarded_chat_template`).
    """
    import hashlib
    import json
    import tempfile

    from transformers import AutoConfig, AutoTokenizer

    folder = adapter_folder(adapter)
    config = read_config(folder)
    check_inner_method(config)
    base = engine_kwargs_.pop("model", None) or config.base_model_name_or_path
    base_config = AutoConfig.from_pretrained(base)
    kwargs = engine_kwargs(folder, bitune_architecture(base_config.architectures),
                           getattr(base_config.get_text_config(), "max_position_embeddings", None), engine_kwargs_)
    arguments = ["--model", base]
    template = None
    if chat_template is not None:
        with open(chat_template, encoding="utf-8") as file:
            template = file.read()
    elif not kwargs.get("skip_tokenizer_init"):
        template = getattr(AutoTokenizer.from_pretrained(base), "chat_template", None)
    if template is not None and config.multi_turn == "alternating":
        template = guarded_chat_template(template)
        digest = hashlib.sha256(template.encode()).hexdigest()[:16]
        path = os.path.join(tempfile.gettempdir(), f"bitune-{digest}.jinja")
        with open(path, "w", encoding="utf-8") as file:
            file.write(template)
        chat_template = path
    if chat_template is not None:
        arguments += ["--chat-template", chat_template]
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            arguments.append(flag if value else "--no-" + name.replace("_", "-"))
        else:
            arguments += [flag, json.dumps(value, separators=(",", ":")) if isinstance(value, dict) else str(value)]
    return arguments
