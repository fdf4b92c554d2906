"""The vLLM model classes of Bitune: vLLM's own causal LM of each supported family, with Bitune's prefill.

Each class is vLLM's class with `BituneMixin` in front: the base weights load as vLLM loads them, then the adapter
named by the config's `bitune_adapter` (set through `hf_overrides`, see `engine.py`) is read, each decoder layer's
`Attention` is wrapped in a `BituneAttention` and each adapted projection gets a `LoraHook`. A step with fresh prompts
runs the bidirectional prompt pass first, then the ordinary forward (see `passes.py`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from peft_bitune.tuner.mixing import BituneKVMixer

from .adapter import BituneAdapter, read_adapter
from .options import ADAPTER_FIELD, check_engine_config
from .passes import BituneAttention, LoraHook, PromptRows, StepState, fresh_prompts


class BituneMixin:
    """Bitune's prefill on top of a vLLM causal LM class (put it first among the bases)."""

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs) -> None:
        check_engine_config(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self.bitune_adapter_path = getattr(vllm_config.model_config.hf_config, ADAPTER_FIELD)
        self.bitune_state = StepState()
        self.bitune_attention: list[BituneAttention] = []
        for index, layer in enumerate(self.model.layers):
            self.bitune_attention.append(self._wrap_attention(layer, index))

    def _wrap_attention(self, decoder_layer: nn.Module, index: int) -> BituneAttention:
        """Put a `BituneAttention` in place of the layer's vLLM `Attention` (in this model only)."""
        found = [(parent, name, child) for parent in decoder_layer.modules()
                 for name, child in parent.named_children() if isinstance(child, Attention)]
        if len(found) != 1:
            raise ValueError(f"Decoder layer {index} has {len(found)} attention layers; the Bitune plugin needs one.")
        parent, name, attention = found[0]
        if attention.kv_sharing_target_layer_name is not None or attention.has_sink:
            raise ValueError(
                f"Decoder layer {index} shares another layer's cache or has attention sinks, which the Bitune plugin "
                "does not compute: serve this model with `bitune-serve`."
            )
        wrapper = BituneAttention(attention, index, self.bitune_state, (torch.tensor(0.0), torch.tensor(0.0)), True)
        setattr(parent, name, wrapper)
        return wrapper

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        self._load_bitune_adapter(read_adapter(self.bitune_adapter_path))
        return loaded

    def _load_bitune_adapter(self, adapter: BituneAdapter) -> None:
        """The mixing coefficients into each layer's attention, and a LoRA hook on each adapted projection."""
        num_layers = len(self.bitune_attention)
        if adapter.key_weights.numel() != num_layers:
            raise ValueError(
                f"The adapter has mixing scalars for {adapter.key_weights.numel()} layers, but the base model has "
                f"{num_layers}: it was trained on another base model."
            )
        mixer = BituneKVMixer(num_layers, 0.0, adapter.mix_scale, adapter.mixed_layers)
        mixer.key_weights.data.copy_(adapter.key_weights)
        mixer.value_weights.data.copy_(adapter.value_weights)
        device = next(self.parameters()).device
        with torch.no_grad():
            key_alpha, value_alpha = mixer.coefficients()
        for layer, attention in enumerate(self.bitune_attention):
            attention.alphas = (key_alpha[layer].to(device), value_alpha[layer].to(device))
            attention.bidirectional_mask = adapter.second_pass_attention == "bidirectional"
        modules = dict(self.named_modules())
        hooks: dict[str, list] = {}
        for path, pairs in adapter.lora.items():
            target, start, end = self._fused_slice(modules, path)
            moved = {name: type(pair)(pair.a.to(device), pair.b.to(device), pair.scaling)
                     for name, pair in pairs.items()}
            hooks.setdefault(target, []).append((start, end, moved))
        for target, slices in hooks.items():
            modules[target].register_forward_hook(LoraHook(self.bitune_state, slices))

    def _fused_slice(self, modules: dict[str, nn.Module], path: str) -> tuple[str, int, int]:
        """Where the transformers module `path` (e.g. `model.layers.0.self_attn.q_proj`) sits in this vLLM model:
        the vLLM module and the slice of its output features (a fused `qkv_proj`/`gate_up_proj` holds several)."""
        parent, name = path.rsplit(".", 1)
        if path in modules:
            module = modules[path]
            return path, 0, module.weight.shape[0]
        for fused, parts in self.packed_modules_mapping.items():
            target = f"{parent}.{fused}"
            if name in parts and target in modules:
                sizes = modules[target].output_sizes
                start = sum(sizes[: parts.index(name)])
                return target, start, start + sizes[parts.index(name)]
        raise ValueError(f"The adapter adapts {path!r}, which this vLLM model does not have: another base model?")

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        prompts = _step_prompts()
        if not prompts:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        if input_ids is None:
            raise ValueError("The Bitune plugin reads prompts as token ids; prompt embeddings are not supported.")
        rows = torch.cat([torch.arange(p.step_start, p.step_start + p.length, device=input_ids.device)
                          for p in prompts])
        with self.bitune_state.running("bidirectional", prompts):
            self.model(input_ids=input_ids[rows], positions=positions[rows], intermediate_tensors=None)
        with self.bitune_state.running("causal", prompts):
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)


def _step_prompts() -> list[PromptRows]:
    """The fresh prompts of the running step, from the forward context's attention metadata (none outside a step, or
    in vLLM's warm-up runs without metadata)."""
    if not is_forward_context_available():
        return []
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):
        metadata = metadata[0]
    if not metadata:
        return []
    layer_metadata = next(iter(metadata.values()))
    return fresh_prompts(layer_metadata.query_start_loc.tolist(), layer_metadata.seq_lens.tolist())


class BituneLlamaForCausalLM(BituneMixin, LlamaForCausalLM):
    """Llama (and SmolLM2) with Bitune's prefill."""


class BituneMistralForCausalLM(BituneMixin, MistralForCausalLM):
    """Mistral with Bitune's prefill."""


class BituneQwen2ForCausalLM(BituneMixin, Qwen2ForCausalLM):
    """Qwen2 with Bitune's prefill."""


class BituneQwen3ForCausalLM(BituneMixin, Qwen3ForCausalLM):
    """Qwen3 with Bitune's prefill."""


class BituneGemma3ForCausalLM(BituneMixin, Gemma3ForCausalLM):
    """Gemma 3 (text) with Bitune's prefill, sliding-window layers included."""

