"""
Tiny random models of every supported architecture, saved and loaded back through transformers' real loading code.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch
from transformers import AutoModelForCausalLM

import peft_bitune  # noqa: F401  (registers the BITUNE peft type)

# The test models are tiny: one thread avoids thread hand-off costs that dominate at this size (and oversubscription).
torch.set_num_threads(1)

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def _configs():
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


ARCHITECTURES = list(_configs())


def _supports_sdpa(config) -> bool:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(config)]._supports_sdpa


# Every (architecture, attention implementation) pair the architecture supports.
ATTENTION_CASES = [
    (arch, impl) for arch, config in _configs().items() for impl in ("eager", "sdpa")
    if impl == "eager" or _supports_sdpa(config)
]


def why_bitsandbytes_cannot_run() -> str | None:
    """Why bitsandbytes' 4-bit layers cannot run on this machine's CPU (not installed, or failing), or None if they
    can: the quantized-base tests skip with this reason, and only then. CI installs bitsandbytes and sets
    BITUNE_REQUIRE_BITSANDBYTES, so that a missing install fails there instead."""
    try:
        import bitsandbytes
    except ImportError as error:
        if os.environ.get("BITUNE_REQUIRE_BITSANDBYTES"):
            pytest.fail(f"BITUNE_REQUIRE_BITSANDBYTES is set but bitsandbytes is not installed ({error}): "
                        "pip install -e '.[qlora]'")
        return f"bitsandbytes is not installed ({error}); `pip install -e '.[dev]'` (or '.[qlora]') installs it"
    try:
        layer = bitsandbytes.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32)
        layer.weight = bitsandbytes.nn.Params4bit(torch.randn(64, 64), requires_grad=False, quant_type="nf4")
        layer.to("cpu")(torch.randn(2, 64))
    except Exception as error:  # any failure means the same here: no 4-bit layers on this CPU
        return f"bitsandbytes {bitsandbytes.__version__} cannot run a 4-bit layer on this CPU: {error!r}"
    return None


@pytest.fixture(scope="session")
def saved_models(tmp_path_factory) -> dict[str, str]:
    """Each architecture's tiny random model, written once with `save_pretrained`."""
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for name, config in _configs().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        path = root / name
        model.save_pretrained(path)
        paths[name] = str(path)
    return paths


@pytest.fixture(scope="session")
def load_base(saved_models):
    """`load_base(arch, attn_implementation="eager", dtype=torch.float32)` -> a fresh base model."""

    def load(arch: str, attn_implementation: str = "eager", dtype: torch.dtype = torch.float32):
        model = AutoModelForCausalLM.from_pretrained(
            saved_models[arch], attn_implementation=attn_implementation, dtype=dtype
        )
        return model.eval()

    return load
