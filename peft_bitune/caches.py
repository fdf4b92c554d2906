"""Key/value caches of the passes, the in-place mix of two generation caches, and the conversation cache.

Each pass reads the keys/values built so far and may record its own. Two properties matter, and transformers'
`DynamicCache` has neither:

- reading leaves the cache as it was: the two prompt passes of one instruction must both see the same past, and the
  mix of what they recorded is what gets appended;
- recording is idempotent: under gradient checkpointing a decoder layer is re-run during backward, and a re-run must
  overwrite what the first run wrote instead of appending it a second time.

Both are one layer class, `PassCacheLayer`: an optional fixed prefix, plus an optional record of the last chunk.
In training it holds every position and is never a sliding-window layer; sliding-window models still get their
window, because transformers builds the sliding mask from the config over absolute positions. Over a generation cache
it mirrors each layer (window and offset) instead.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from .mixing import BituneKVMixer, mix_key_values


class PassCacheLayer(CacheLayerMixin):
    """
    One decoder layer's cache for one training pass.

    Tensors are `[batch_size, num_kv_heads, seq_len, head_dim]`.

    Args:
        prefix_keys, prefix_values (`torch.Tensor`, *optional*): keys/values every query of the pass may attend to
            before its own chunk (the mixed prompt cache in the answer pass). `None` for no prefix.
        record (`bool`): whether `update` keeps the chunk it is given (the prompt passes do, the answer pass does not).
        offset (`int`): positions seen before the prefix (a sliding-window layer of a generation cache keeps only its
            window); the mask is built over absolute positions.
        is_sliding (`bool`): mirrors the layer it reads from, so transformers sizes each mask type from a layer of
            that type.
    """

    is_compileable = False

    def __init__(
        self,
        prefix_keys: torch.Tensor | None = None,
        prefix_values: torch.Tensor | None = None,
        record: bool = False,
        offset: int = 0,
        is_sliding: bool = False,
    ) -> None:
        super().__init__()
        self.offset = offset
        self.is_sliding = is_sliding
        self.prefix_keys = prefix_keys
        self.prefix_values = prefix_values
        self.record = record
        self.keys = prefix_keys
        self.values = prefix_values
        self.recorded_keys: torch.Tensor | None = None
        self.recorded_values: torch.Tensor | None = None
        self.is_initialized = prefix_keys is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.record:
            # Overwrite, never append: a checkpointing re-run must leave the same state behind.
            self.recorded_keys, self.recorded_values = key_states, value_states
        if self.prefix_keys is None:
            return key_states, value_states
        keys = torch.cat([self.prefix_keys, key_states], dim=-2)
        values = torch.cat([self.prefix_values, value_states], dim=-2)
        return keys, values

    def _prefix_length(self) -> int:
        return 0 if self.prefix_keys is None else self.prefix_keys.shape[-2]

    def get_seq_length(self) -> int:
        # What a query of this pass sees before its own chunk; the recorded chunk is output, not past.
        return self.offset + self._prefix_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._prefix_length() + query_length, self.offset

    def get_max_length(self) -> int:
        return -1


def pass_cache(
    num_layers: int,
    keys: list[torch.Tensor] | None = None,
    values: list[torch.Tensor] | None = None,
    record: bool = False,
) -> Cache:
    """A cache for one training pass: optional fixed per-layer prefix keys/values, optionally recording the pass."""
    if keys is None:
        return Cache(layers=[PassCacheLayer(record=record) for _ in range(num_layers)])
    return Cache(layers=[PassCacheLayer(k, v, record=record) for k, v in zip(keys, values)])


def reading_pass_cache(cache: DynamicCache) -> Cache:
    """A recording pass cache over a generation cache: the pass attends to everything `cache` holds (each layer's
    window, for sliding layers) and records its own keys/values, leaving `cache` untouched."""
    layers = []
    for layer in cache.layers:
        held = layer.keys.shape[-2]
        layers.append(PassCacheLayer(layer.keys, layer.values, record=True, offset=layer.get_seq_length() - held,
                                     is_sliding=getattr(layer, "is_sliding", False)))
    return Cache(layers=layers)


class BituneCache(DynamicCache):
    """
    The generation cache of a Bitune conversation.

    It is a transformers `DynamicCache` and remembers how many input columns of the conversation it stands for
    (`conversation_length`, the width of the last `generate` output), so that the next turn knows where the previous
    answer ends and the new instruction begins.
    """

    def __init__(self, *args, owner: torch.nn.Module | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.conversation_length = 0
        self._owner = weakref.ref(owner) if owner is not None else None

    def belongs_to(self, model: torch.nn.Module) -> bool:
        """Whether this cache was made by `model` (the keys of another model would fit its shapes by accident)."""
        return self._owner is not None and self._owner() is model


def recorded_key_values(cache: Cache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The keys and values a prompt pass recorded, one tensor per layer."""
    layers = cache.layers
    if any(layer.recorded_keys is None for layer in layers):
        missing = [i for i, layer in enumerate(layers) if layer.recorded_keys is None]
        raise RuntimeError(
            f"The prompt pass stored no keys/values for layers {missing}: this model does not write its KV cache "
            "through `past_key_values.update`, which Bitune needs."
        )
    return [layer.recorded_keys for layer in layers], [layer.recorded_values for layer in layers]


def mix_recorded(causal: Cache, bidirectional: Cache, mixer: BituneKVMixer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Mix two recorded prompt passes layer by layer; returns the mixed keys and values."""
    key_alpha, value_alpha = mixer.coefficients()
    causal_keys, causal_values = recorded_key_values(causal)
    bidirectional_keys, bidirectional_values = recorded_key_values(bidirectional)
    keys = [mix_key_values(c, b, key_alpha[i]) for i, (c, b) in enumerate(zip(causal_keys, bidirectional_keys))]
    values = [mix_key_values(c, b, value_alpha[i]) for i, (c, b) in enumerate(zip(causal_values, bidirectional_values))]
    return keys, values


def mix_into_dynamic_cache(causal: DynamicCache, bidirectional: DynamicCache, mixer: BituneKVMixer) -> DynamicCache:
    """
    Mix the bidirectional cache into the causal one, in place, and return the causal cache.

    Mixing in place keeps each layer's own bookkeeping (a sliding-window layer's running length), which a cache
    rebuilt from tensors would lose.
    """
    if len(causal.layers) != len(bidirectional.layers):
        raise RuntimeError("The two prompt passes produced caches with different numbers of layers.")
    key_alpha, value_alpha = mixer.coefficients()
    for i, (causal_layer, bidirectional_layer) in enumerate(zip(causal.layers, bidirectional.layers)):
        if causal_layer.keys is None or bidirectional_layer.keys is None:
            raise RuntimeError(f"Layer {i} of the prompt cache holds no keys/values; Bitune cannot mix it.")
        causal_layer.keys = mix_key_values(causal_layer.keys, bidirectional_layer.keys, key_alpha[i])
        causal_layer.values = mix_key_values(causal_layer.values, bidirectional_layer.values, value_alpha[i])
    return causal
