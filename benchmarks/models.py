"""The two models every benchmark compares, built from one random base, and the batches they are fed.

Bitune and plain LoRA get identical copies of the same base model and the same LoRA hyper-parameters (rank 8 on every
linear layer), so a ratio of their timings measures Bitune's own cost and nothing else.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, Gemma3TextConfig, GemmaConfig, LlamaConfig, PretrainedConfig

import peft_bitune  # noqa: F401  (registers the BITUNE peft type)
from peft_bitune import BituneConfig

LORA_RANK = 8
FIRST_TOKEN_ID = 3  # random tokens avoid pad (0), bos (1) and eos (2)


@dataclass(frozen=True)
class ModelSize:
    """A random Llama shape. `small` is sized so that the quick run fits in a few minutes on 2 CPU cores."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    intermediate_size: int | None = None  # default: about 8/3 of the hidden size, a multiple of 64
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size or self.hidden_size * 8 // 3 // 64 * 64,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=2048,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
        )


MODEL_SIZES = {
    # For the smoke test only: every figure it gives is dominated by Python overhead.
    "tiny": ModelSize(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=512),
    # The CPU default.
    "small": ModelSize(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=4096),
    # The shape of SmolLM2-135M-Instruct (docs/smollm2.md): 30 thin layers, grouped-query attention 9/3, a 49k
    # vocabulary with tied embeddings. Random weights: timings do not depend on what the weights are.
    "smollm2": ModelSize(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, intermediate_size=1536, tie_word_embeddings=True, rope_theta=100000.0),
    # The GPU default: a ~1B-parameter Llama shape, where matrix products dominate as in real use.
    "medium": ModelSize(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        vocab_size=32000),
}


@dataclass(frozen=True)
class RealShape:
    """
    A published model's shape (from its config on the Hub), built with random weights: timings and memory depend on
    the shape, not on the weights, and nothing is downloaded. `config(num_layers)` keeps the full width and cuts the
    depth, for shapes too big for the machine at hand.
    """

    name: str
    num_hidden_layers: int
    make: Callable[[int], PretrainedConfig]

    def config(self, num_layers: int | None = None) -> PretrainedConfig:
        layers = self.num_hidden_layers if num_layers is None else num_layers
        if not 1 <= layers <= self.num_hidden_layers:
            raise ValueError(f"{self.name} has {self.num_hidden_layers} layers; asked for {layers}.")
        return self.make(layers)


def _gemma(hidden: int, intermediate: int, heads: int, kv_heads: int) -> Callable[[int], PretrainedConfig]:
    """Gemma (1): 256-wide heads, a 256,000-token vocabulary, tied embeddings."""
    return lambda layers: GemmaConfig(
        vocab_size=256000, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=256, max_position_embeddings=8192,
        pad_token_id=0, bos_token_id=2, eos_token_id=1, tie_word_embeddings=True,
    )


REAL_SHAPES = {
    shape.name: shape
    for shape in (
        RealShape("smollm2-135m", 30,
                  lambda layers: replace(MODEL_SIZES["smollm2"], num_hidden_layers=layers).llama_config()),
        # Gemma-3-270M: 4 heads and 1 key-value head of 256, five sliding-window layers (512) to one global layer.
        RealShape("gemma-3-270m", 18, lambda layers: Gemma3TextConfig(
            vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
            query_pre_attn_scalar=256, max_position_embeddings=32768, pad_token_id=0, bos_token_id=2, eos_token_id=1,
            tie_word_embeddings=True,
        )),
        RealShape("gemma-2b", 18, _gemma(hidden=2048, intermediate=16384, heads=8, kv_heads=1)),
        RealShape("gemma-7b", 28, _gemma(hidden=3072, intermediate=24576, heads=16, kv_heads=16)),
        RealShape("llama-3-8b", 32, lambda layers: LlamaConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        )),
    )
}


# Stand-ins of the same architectures for smoke runs on a CPU (every figure they give is Python overhead).
TINY_SHAPES = {
    shape.name: shape
    for shape in (
        RealShape("tiny-gemma", 2, lambda layers: GemmaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=1, head_dim=16, pad_token_id=0, bos_token_id=2, eos_token_id=1)),
        RealShape("tiny-llama", 2,
                  lambda layers: replace(MODEL_SIZES["tiny"], num_hidden_layers=layers).llama_config()),
    )
}


@dataclass
class ModelPair:
    """Plain LoRA and Bitune over identical copies of one base model."""

    lora: PeftModel
    bitune: PeftModel
    size: ModelSize | PretrainedConfig  # anything with a `vocab_size`
    device: torch.device
    dtype: torch.dtype

    def both(self) -> dict[str, PeftModel]:
        return {"lora": self.lora, "bitune": self.bitune}


def lora_config() -> LoraConfig:
    return LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules="all-linear")


def build_pair(size: ModelSize | PretrainedConfig, device: torch.device, dtype: torch.dtype,
               attn_implementation: str, seed: int = 0) -> ModelPair:
    """Build one random base model and wrap two copies of it: one in LoRA, one in Bitune with the same LoRA config.
    `size` is a random Llama shape or any causal-LM config (e.g. a `RealShape`'s)."""
    base = random_base(size, device, dtype, attn_implementation, seed)
    lora = get_peft_model(copy.deepcopy(base), lora_config())
    bitune = get_peft_model(base, BituneConfig(adapter_config=lora_config()))
    return ModelPair(lora=lora.to(device), bitune=bitune.to(device), size=size, device=device, dtype=dtype)


def random_base(size: ModelSize | PretrainedConfig, device: torch.device, dtype: torch.dtype,
                attn_implementation: str, seed: int = 0) -> torch.nn.Module:
    """A base model with random weights, initialised on `device` directly (a multi-billion-parameter model is
    initialised in seconds on a GPU, in minutes on its host's CPU)."""
    config = size.llama_config() if isinstance(size, ModelSize) else size
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)


def training_batch(batch_size: int, prompt_length: int, answer_length: int, vocab_size: int,
                   device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of `prompt_length` instruction tokens then `answer_length` answer tokens, no padding; loss on answers."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(FIRST_TOKEN_ID, vocab_size, (batch_size, prompt_length + answer_length),
                              generator=generator)
    labels = input_ids.clone()
    labels[:, :prompt_length] = -100
    batch = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels)
    return {name: tensor.to(device) for name, tensor in batch.items()}


def ragged_rows(count: int, prompt_range: tuple[int, int], answer_range: tuple[int, int], vocab_size: int,
                seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    """`count` rows (tokens, prompt length) with prompt and answer lengths drawn uniformly from the ranges."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        prompt_length = int(torch.randint(prompt_range[0], prompt_range[1] + 1, (), generator=generator))
        answer_length = int(torch.randint(answer_range[0], answer_range[1] + 1, (), generator=generator))
        tokens = torch.randint(FIRST_TOKEN_ID, vocab_size, (prompt_length + answer_length,), generator=generator)
        rows.append((tokens, prompt_length))
    return rows


def collate_right_padded(rows: list[tuple[torch.Tensor, int]], device: torch.device) -> dict[str, torch.Tensor]:
    """Right-pad rows the way TRL's collator does: pad id 0, attention mask 0 and labels -100 on padding."""
    width = max(len(tokens) for tokens, _ in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for i, (tokens, prompt_length) in enumerate(rows):
        input_ids[i, : len(tokens)] = tokens
        attention_mask[i, : len(tokens)] = 1
        labels[i, prompt_length : len(tokens)] = tokens[prompt_length:]
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    return {name: tensor.to(device) for name, tensor in batch.items()}


def prompt_batch(batch_size: int, prompt_length: int, vocab_size: int, device: torch.device,
                 seed: int = 0) -> dict[str, torch.Tensor]:
    """Prompts of equal length (no padding) for generation."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(FIRST_TOKEN_ID, vocab_size, (batch_size, prompt_length), generator=generator)
    return dict(input_ids=input_ids.to(device), attention_mask=torch.ones_like(input_ids).to(device))
