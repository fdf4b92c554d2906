"""Tiny random model configs of every supported architecture, and the (architecture, attention implementation)
pairs the tests run; conftest.py builds its fixtures from them, and tests import them from here."""

from __future__ import annotations

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def model_configs() -> dict:
    """Each architecture's tiny config, by name (new objects at every call)."""
    from transformers import (
        DeepseekV3Config,
        Gemma2Config,
        Gemma3TextConfig,
        GemmaConfig,
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
        SmolLM3Config,
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
        # Mixtures of experts, with few experts: the router picks 2 of 4 for each token.
        "qwen3_moe": Qwen3MoeConfig(
            num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            mlp_only_layers=[1], **COMMON  # one sparse layer, one dense
        ),
        "mixtral": MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **COMMON),
        # Attention sinks (a learned logit per head in every softmax), a sliding and a full layer, YaRN positions.
        "gpt_oss": GptOssConfig(
            num_key_value_heads=2, head_dim=8, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
            num_local_experts=4, num_experts_per_tok=2,
            rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                                 rope_theta=150000.0, beta_fast=32.0, beta_slow=1.0, truncate=False),
            **COMMON,
        ),
        # Multi-head latent attention (queries and keys/values through low-rank projections; the cache holds the
        # compressed keys/values and the rotary part of the keys), a dense first layer and a mixture of experts after.
        "deepseek_v3": DeepseekV3Config(
            num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
            v_head_dim=8, first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
            moe_intermediate_size=32, n_group=1, topk_group=1, **COMMON
        ),
        # No position embedding (NoPE) on the second layer, rotary positions on the first.
        "smollm3": SmolLM3Config(num_key_value_heads=2, no_rope_layers=[1, 0], **COMMON),
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


# ----------------------------------------------------------------------------------- families Bitune refuses
TEXT = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LAYERS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256)


def causal_only_configs() -> dict:
    """Tiny configs of the families on which `is_causal=False` leaves the bidirectional pass causal, by name, each
    with the attention implementation that does (`checks.check_bidirectional_attention` refuses them)."""
    from transformers import (
        BloomConfig,
        FalconConfig,
        GPTNeoConfig,
        Llama4TextConfig,
        MptConfig,
        NemotronConfig,
        StableLmConfig,
    )

    return {
        "bloom": (BloomConfig(hidden_size=32, n_layer=2, n_head=4, **TEXT), "eager"),
        "mpt": (MptConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=256, **TEXT), "eager"),
        "falcon": (FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **TEXT), "sdpa"),
        "gpt_neo": (GPTNeoConfig(hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global"], 2]],
                                 max_position_embeddings=256, **TEXT), "eager"),
        # Chunked attention: chunks of 4 tokens, so that a prompt crosses them.
        "llama4_text": (Llama4TextConfig(num_key_value_heads=2, head_dim=8, intermediate_size_mlp=64,
                                         num_local_experts=2, attention_chunk_size=4, **LAYERS, **TEXT), "sdpa"),
        "stablelm": (StableLmConfig(num_key_value_heads=2, **LAYERS, **TEXT), "sdpa"),
        "nemotron": (NemotronConfig(num_key_value_heads=2, head_dim=8, **LAYERS, **TEXT), "sdpa"),
    }


def eager_only_configs() -> dict:
    """The families of `causal_only_configs` whose eager attention does read `is_causal=False` (accepted then)."""
    return {name: config for name, (config, _) in causal_only_configs().items() if name in ("stablelm", "nemotron")}


def unsupported_configs() -> dict:
    """Tiny configs of families that fail at their first forward under Bitune, refused at `get_peft_model`: recurrent
    models with caches of their own, ModernBERT-decoder, whose `get_decoder()` is its output projection, and
    GPT-NeoX-Japanese, whose layers are not transformers' `GradientCheckpointingLayer`s (its bidirectional pass would
    also run causally)."""
    from transformers import GPTNeoXJapaneseConfig, ModernBertDecoderConfig, RwkvConfig, xLSTMConfig

    return {
        "xlstm": xLSTMConfig(hidden_size=32, num_hidden_layers=2, num_heads=4, **TEXT),
        "rwkv": RwkvConfig(hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64,
                           context_length=64, **TEXT),
        "modernbert_decoder": ModernBertDecoderConfig(cls_token_id=3, sep_token_id=4, local_attention=6,
                                                      global_attn_every_n_layers=2, **LAYERS, **TEXT),
        "gpt_neox_japanese": GPTNeoXJapaneseConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                   intermediate_multiple_size=2, max_position_embeddings=256, **TEXT),
    }
