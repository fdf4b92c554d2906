"""Tiny random model configs of every supported architecture, and the (architecture, attention implementation)
pairs the tests run; conftest.py builds its fixtures from them, and tests import them from here."""

from __future__ import annotations

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def model_configs() -> dict:
    """Each architecture's tiny config, by name (new objects at every call)."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GemmaConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    # Sliding windows are small (6) so that the test prompts cross them.
    return {
        "llama": LlamaConfig(num_key_value_heads=2, **COMMON),
        "mistral": MistralConfig(num_key_value_heads=2, sliding_window=6, **COMMON),
        "qwen2": Qwen2Config(num_key_value_heads=2, **COMMON),
        "qwen3": Qwen3Config(num_key_value_heads=2, head_dim=8, **COMMON),
        "gemma": GemmaConfig(num_key_value_heads=2, head_dim=8, **COMMON),
        "gemma2": Gemma2Config(num_key_value_heads=2, head_dim=8, sliding_window=6, **COMMON),
        "gemma3": Gemma3TextConfig(
            num_key_value_heads=2, head_dim=8, sliding_window=6,
            layer_types=["sliding_attention", "full_attention"], **COMMON
        ),
        "phi3": Phi3Config(num_key_value_heads=2, **COMMON),
    }


ARCHITECTURES = list(model_configs())


def _supports_sdpa(config) -> bool:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(config)]._supports_sdpa


# Every (architecture, attention implementation) pair the architecture supports.
ATTENTION_CASES = [
    (arch, impl) for arch, config in model_configs().items() for impl in ("eager", "sdpa")
    if impl == "eager" or _supports_sdpa(config)
]
