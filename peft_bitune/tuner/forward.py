"""The Bitune training forward: its arguments sorted and checked, then the passes of `passes.py`. Mixed into
`BituneModel`.

With the adapters disabled the base model runs alone, and a forward that continues a cache runs causally with the
causal weights, like a decoding step of `generate`; every other forward is a training forward over instructions and
answers, whose arguments are checked before any compute (`checks.py`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .. import compat
from ..utils.model_config import max_positions, num_layers
from .checks import check_continuation_arguments, training_sequence
from .fused_head import check_fused_call, ensure_fused_head, fused_output
from .layout import ConversationLayout
from .mixing import BituneKVMixer
from .passes import BitunePasses, answer_loss
from .routing import LayerRouter
from .sharding import check_sharding


class ForwardHost(Protocol):
    """What `BituneForwardMixin` uses of the tuner it is mixed into (`BituneModel`), and all that it may use (a test
    reads the mixin's source and checks it)."""

    model: nn.Module
    peft_config: dict[str, Any]
    active_adapter: str
    mixer: BituneKVMixer
    _router: LayerRouter

    def _passes(self) -> BitunePasses: ...

    def _adapters_disabled(self) -> bool: ...


class BituneForwardMixin:
    """`forward` of `BituneModel`; what it uses of it is declared by `ForwardHost`."""

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        prompt_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        fused_lm_head: bool = False,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | Any:
        """
        The Bitune training forward.

        Args:
            input_ids (`torch.LongTensor` of shape (batch_size, seq_len)): instruction then answer, padded left or
                right.
            attention_mask (`torch.Tensor` of shape (batch_size, seq_len), *optional*): 1 on real tokens.
            inputs_embeds (`torch.FloatTensor` of shape (batch_size, seq_len, hidden_size), *optional*): instead of
                ids.
            labels (`torch.LongTensor` of shape (batch_size, seq_len), *optional*): targets aligned with the input,
                -100 where there is no loss. Without `prompt_mask`, the instruction is the unsupervised tokens before
                the first supervised one.
            prompt_mask (`torch.Tensor` of shape (batch_size, seq_len), *optional*): 1 on instruction tokens. When
                given, labels on instruction tokens are not used: the loss is on answer tokens only.
            cache (`Cache`, *optional*): continue decoding from a cache (e.g. from `prefill`); the input is then run
                causally with the causal weights, exactly like a decoding step of `generate`. `past_key_values`, its
                name before transformers 5.24, is accepted too.
            num_items_in_batch (`int`, *optional*): the number of supervised tokens the loss is averaged over (passed
                by `Trainer` under gradient accumulation); defaults to this batch's count.
            fused_lm_head (`bool`, *optional*): TRL's fused-head call (`fused_head.py`): return per-token
                log-probabilities of the labels instead of logits, scoring the answer positions only, in tiles. Rows
                whose labels mark no answer token then score nothing, as with TRL's own head.
            shift_labels (`torch.Tensor`, *optional*): refused (labels pre-shifted for context parallelism).
            kwargs: other arguments of the model's forward. The three passes cover different parts of each row, so
                none is handed on: `position_ids` are accepted when they are the ordinary positions every pass uses
                anyway (0, 1, ... over each row's real tokens), `logits_to_keep` when 0; anything else (e.g. packed
                `position_ids`, `cache_position`, `token_type_ids`) is refused by name before any compute.

        Returns:
            `CausalLMOutputWithPast` whose `logits` (batch_size, seq_len, vocab) are aligned with the input. Positions
            before the last instruction token hold zeros: their logits are never used, and the LM head over a long
            prompt with a large vocabulary is not free. With `fused_lm_head=True`, TRL's `FusedCausalLMOutput`, its
            per-token fields (batch_size, seq_len - 1).
        """
        kwargs[compat.NEW_CACHE_NAME] = cache
        cache = compat.pop_cache(kwargs)  # `cache`, or its old name `past_key_values`
        disabled = self._adapters_disabled()
        if fused_lm_head:
            check_fused_call(labels, shift_labels, cache)
            ensure_fused_head(self.model)
            if disabled:  # the base model alone: its own fused head
                return self.model(
                    input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, labels=labels,
                    num_items_in_batch=num_items_in_batch, fused_lm_head=True, **kwargs,
                )
        elif shift_labels is not None:
            kwargs["shift_labels"] = shift_labels  # refused by name below, as any argument the passes cannot take
        if cache is not None and not disabled:
            check_continuation_arguments(labels, prompt_mask)
        if disabled or cache is not None:
            # The base model alone, or a causal continuation of the cache with the causal weights (routed between
            # passes).
            return self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                inputs_embeds=inputs_embeds,
                labels=labels,
                **compat.with_cache(self.model, cache),
                **kwargs,
            )
        sequence = training_sequence(input_ids, inputs_embeds, attention_mask, kwargs, max_positions(self.model))
        layout = ConversationLayout.from_inputs(
            sequence.shape,
            attention_mask,
            labels,
            prompt_mask,
            device=sequence.device,
            mode=self.peft_config[self.active_adapter].multi_turn,
            read_rows_without_answer=fused_lm_head,
        )
        check_sharding(self._router.index.decoder_layer_paths, num_layers(self.model), self.mixer)
        with self._router.checkpointing_keeps_caches():
            answer_outputs = self._passes().run_layout(layout, sequence, fused_head=fused_lm_head)
        if fused_lm_head:
            return fused_output(layout, answer_outputs, sequence.shape[:2], num_items_in_batch)
        answer_logits = [output.logits for output in answer_outputs]
        loss = None
        if labels is not None:
            loss = answer_loss(answer_logits, [turn.answer.labels for turn in layout.turns], num_items_in_batch)
        logits = layout.scatter_answers(answer_logits, sequence.shape[0], sequence.shape[1])
        return CausalLMOutputWithPast(loss=loss, logits=logits)
