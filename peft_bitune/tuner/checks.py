"""
What Bitune is given, checked once, where it enters, before any compute: the base model (before an adapter's weights
are created), a training forward's arguments, and the prompts of `prefill` and `generate`.

The checks return what they learned as a value (`TrainingInputs`, `Prompts`) that the rest of the method takes as
checked: nothing downstream checks or re-derives it. A continued conversation is checked by its cache
(`BituneCache.checked_continuation`), which knows what it holds. Each rule has one function and one message here, and
each message says what is wrong and how to fix it.

The passes cover different parts of each row, so some arguments of a transformers forward cannot be handed on, and
Bitune's prompts and rows have shapes a plain causal LM does not require (left-padded prompts, one contiguous run of
real tokens per row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from .. import compat
from ..constants import BIDIRECTIONAL, IGNORE_INDEX
from ..utils.base_model import decoder_of, text_config
from ..utils.messages import format_rows
from .packing import PackedExamples, read_packed_examples


# ------------------------------------------------------------------------------------------------ one rule each
def check_token_ids(input_ids: Any) -> None:
    """`input_ids` is a non-empty (batch_size, seq_len) tensor."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or 0 in input_ids.shape:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(
            f"`input_ids` must be a non-empty (batch_size, seq_len) tensor, got {shape}: give at least one prompt of "
            "at least one token."
        )


def check_same_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    """A per-token tensor (`attention_mask`, `labels`, `prompt_mask`) has the input's (batch_size, seq_len) shape."""
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(
            f"`{name}` has shape {tuple(tensor.shape)} but the input has shape {tuple(shape)}; give one value per "
            "input token."
        )


def attention_mask_for(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The given attention mask, checked against `input_ids`, or all ones when none is given."""
    if attention_mask is None:
        return torch.ones_like(input_ids)
    check_same_shape("attention_mask", attention_mask, input_ids.shape)
    return attention_mask


def has_holes(attention_mask: Any) -> Any:
    """
    Which rows of a (batch, seq) attention mask have a hole, as a (batch,) boolean tensor. A hole is padding between
    two real tokens of a row; padding before a row's first real token or after its last one is not a hole, and an
    all-padding row has none. Bitune's passes need each row's real tokens as one contiguous run.
    """
    valid = attention_mask.bool()
    first = valid.int().argmax(dim=1)
    last = valid.shape[1] - 1 - valid.flip(1).int().argmax(dim=1)
    return valid.any(dim=1) & (last - first + 1 != valid.sum(dim=1))


def check_rows(bad: torch.Tensor, message: str) -> None:
    """Raise `message` (with `{rows}` in it) naming the `bad` rows of a (batch,) boolean tensor, if there are any."""
    if bool(bad.any()):
        raise ValueError(message.format(rows=format_rows(bad.nonzero().flatten().tolist())))


EMPTY_ROWS = "Rows {rows} are empty (`attention_mask` all 0): every row needs at least one token."


def check_contiguous_rows(valid: torch.Tensor) -> torch.Tensor:
    """Every row has real tokens, as one contiguous run; returns each row's number of real tokens."""
    lengths = valid.sum(dim=1)
    check_rows(lengths == 0, EMPTY_ROWS)
    check_rows(
        has_holes(valid),
        "Rows {rows} have padding between real tokens: Bitune reads each row's real tokens as one run, so pad on "
        "one side only.",
    )
    return lengths


def check_fits_positions(longest: int, position_limit: int | None, what: str) -> None:
    """Refuse `what` ("A row", "A prompt", "The conversation") of `longest` tokens if the model has fewer positions:
    nothing is truncated silently."""
    if position_limit is not None and longest > position_limit:
        raise ValueError(
            f"{what} has {longest} tokens, more than the model's {position_limit} positions; shorten it (nothing is "
            "truncated silently)."
        )


def positions_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Ordinary position ids, as transformers' `generate` computes them: real tokens counted from 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# ------------------------------------------------------------------------------------------ prefill and generate
@dataclass(frozen=True)
class Prompts:
    """
    Prompts checked where they enter `prefill` or `generate` (`check_prompts`, or a cache's `checked_continuation`).

    Args:
        input_ids (`torch.LongTensor` of shape (batch_size, seq_len)): the prompts (or the conversation so far and the
            new instructions), left-padded.
        attention_mask (`torch.Tensor` of shape (batch_size, seq_len)): 1 on real tokens.
        inputs_embeds (`torch.Tensor` of shape (batch_size, seq_len, hidden_size), *optional*): the embeddings of
            every `input_ids` position, read by the passes instead of the ids.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    inputs_embeds: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    def tokens(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """Columns `start:end`, as a pass reads them: the embeddings where given, else the token ids."""
        if self.inputs_embeds is not None:
            return {"inputs_embeds": self.inputs_embeds[:, start:end]}
        return {"input_ids": self.input_ids[:, start:end]}


def check_embeddings(inputs_embeds: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor | None:
    """`inputs_embeds` given with `input_ids` must embed every one of its positions (transformers' `generate` then
    reads the embeddings and only reports the ids), so that every pass can read them."""
    if inputs_embeds is not None and (inputs_embeds.dim() != 3 or inputs_embeds.shape[:2] != input_ids.shape):
        raise ValueError(
            f"`inputs_embeds` has shape {tuple(inputs_embeds.shape)} but `input_ids` has {tuple(input_ids.shape)}: "
            "give the embedding of every `input_ids` position, (batch_size, seq_len, hidden_size), or only "
            "`input_ids`."
        )
    return inputs_embeds


def check_ends_with_real_tokens(attention_mask: torch.Tensor) -> None:
    """Every row ends with a real token: Bitune generation continues each row from its last column."""
    check_rows(
        ~attention_mask[:, -1].bool(),
        "Rows {rows} are right-padded. Bitune generation continues every prompt from its last token, so prompts "
        "(and a conversation's new instructions) must be left-padded: set `tokenizer.padding_side = 'left'`.",
    )


def check_prompts(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_limit: int | None,
    inputs_embeds: torch.Tensor | None = None,
    sliding_window: bool = False,
) -> Prompts:
    """Refuse empty, right-padded or over-long prompts before any compute (`input_ids` itself was checked by
    `check_token_ids` where it entered). Padding between real tokens is read as transformers reads it, as tokens no
    position counts and no token sees, except by a model with `sliding_window` layers (`check_holes_fit_windows`)."""
    attention_mask = attention_mask_for(input_ids, attention_mask)
    valid = attention_mask.bool()
    check_rows(~valid.any(dim=1), EMPTY_ROWS)
    check_holes_fit_windows(valid, sliding_window)
    check_ends_with_real_tokens(valid)
    check_fits_positions(int(valid.sum(dim=1).max()), position_limit, "A prompt")
    return Prompts(input_ids, attention_mask, check_embeddings(inputs_embeds, input_ids))


def check_holes_fit_windows(attention_mask: torch.Tensor, sliding_window: bool) -> None:
    """Refuse padding between real tokens of a row on a model with sliding-window layers: their window is counted in
    cache columns, so a hole would let a token see one real token fewer than the same row without it."""
    if sliding_window and bool(has_holes(attention_mask).any()):
        raise ValueError(
            "This model has sliding-window layers, whose window is counted in cache columns, and rows have padding "
            "between real tokens (an `attention_mask` with a 0 between 1s, or conversation turns of different "
            "lengths). Pad each prompt on the left only, or continue such conversations one row at a time, or pad "
            "the new instructions to equal lengths."
        )


def check_generation_fits(
    position_limit: int | None, generation_config: Any, max_length_is_set: bool, attention_mask: torch.Tensor
) -> None:
    """
    Refuse, before the prefill, a generation that can run past the model's positions: the longest row's real tokens
    plus the tokens it may generate. Without `max_new_tokens` or any `max_length` set, transformers generates at most
    20 tokens and stops at the model's positions by itself; nothing to check then.
    """
    if position_limit is None:
        return
    width = attention_mask.shape[1]
    if generation_config.max_new_tokens is not None:
        new_tokens, setting = generation_config.max_new_tokens, f"max_new_tokens={generation_config.max_new_tokens}"
    elif max_length_is_set:
        new_tokens, setting = generation_config.max_length - width, f"max_length={generation_config.max_length}"
    else:
        return
    longest = int(attention_mask.sum(dim=1).max())
    if longest + new_tokens > position_limit:
        raise ValueError(
            f"The longest input has {longest} tokens and `{setting}` lets it grow to {longest + new_tokens}, past the "
            f"model's {position_limit} positions (`max_position_embeddings`); nothing would stop it there. Set "
            f"`max_new_tokens` to at most {position_limit - longest}, or shorten the input."
        )


# ------------------------------------------------------------------------------------------- the training forward
@dataclass(frozen=True)
class TrainingInputs:
    """
    A training forward's inputs, checked where they enter (`check_training_inputs`).

    Args:
        sequence (`torch.Tensor`): `input_ids` (batch, seq) or `inputs_embeds` (batch, seq, hidden).
        valid (`torch.BoolTensor` of shape (batch, seq)): the real tokens, one contiguous run per row.
        row_starts, row_lengths (`torch.LongTensor` of shape (batch,)): where each row's real tokens start, and how
            many there are.
        is_answer (`torch.BoolTensor` of shape (batch, seq)): the answer tokens, by `prompt_mask` or else by `labels`.
        boundary (`str`): which of the two gave `is_answer`, for messages.
        labels (`torch.LongTensor` of shape (batch, seq), *optional*): the labels, -100 off the answers.
        packed (`PackedExamples`, *optional*): where each example of a packed batch is (`packing.py`); `None` for
            ordinary rows, one example each.
    """

    sequence: torch.Tensor
    valid: torch.Tensor
    row_starts: torch.Tensor
    row_lengths: torch.Tensor
    is_answer: torch.Tensor
    boundary: str
    labels: torch.Tensor | None
    packed: PackedExamples | None = None


def check_training_inputs(
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    prompt_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
    position_limit: int | None,
) -> TrainingInputs:
    """
    Refuse, before any compute, what a Bitune training forward cannot run as asked, and return what it runs. `kwargs`
    are the forward's other arguments: the switches of the usual output (`return_dict`, `use_cache`) are dropped from
    it, the rest are checked by `check_training_arguments`.
    """
    for unsupported in ("output_attentions", "output_hidden_states"):
        if kwargs.pop(unsupported, None):
            raise NotImplementedError(
                f"`{unsupported}=True` is not supported by the Bitune forward, whose three passes have different "
                "lengths; see `peft_bitune.visualize` for attention maps."
            )
    kwargs.pop("return_dict", None)
    kwargs.pop("use_cache", None)
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
    sequence = input_ids if input_ids is not None else inputs_embeds
    shape = tuple(sequence.shape[:2])
    if 0 in shape:
        raise ValueError(
            f"The batch is empty (input of shape {tuple(sequence.shape)}): give at least one row of at least one "
            "token."
        )
    for name, tensor in (("attention_mask", attention_mask), ("labels", labels), ("prompt_mask", prompt_mask)):
        if tensor is not None:
            check_same_shape(name, tensor, shape)
    if labels is None and prompt_mask is None:
        raise ValueError(
            "Bitune needs the instruction/answer boundary of every row: pass `labels` (instruction tokens are the "
            "unsupervised ones, labels == -100, before each supervised answer) or a `prompt_mask` (1 on instruction "
            "tokens). TRL's own DPOTrainer and KTOTrainer call their `ref_model` with neither, so a Bitune adapter "
            "cannot be one: train with `trl_integration.BituneDPOTrainer` (or `BituneKTOTrainer`) and "
            "`ref_model=None`, whose reference is an exact copy of the policy."
        )
    device = sequence.device
    valid = torch.ones(shape, dtype=torch.bool, device=device)
    if attention_mask is not None:
        valid = attention_mask.to(device).bool()
    lengths = check_contiguous_rows(valid)
    packed = read_packed_examples(kwargs, valid)
    check_training_arguments(kwargs)
    if position_limit is not None and valid.shape[1] > position_limit:  # only then can a row (or example) be too long
        longest, what = (lengths, "A row") if packed is None else (packed.lengths, "A packed example")
        check_fits_positions(int(longest.max()), position_limit, what)
    if prompt_mask is not None:
        is_answer, boundary = valid & ~prompt_mask.to(device).bool(), "`prompt_mask`"
    else:
        is_answer, boundary = valid & (labels.to(device) != IGNORE_INDEX), "`labels`"
    check_rows(
        (is_answer == valid).all(dim=1) & valid.any(dim=1),
        "Rows {rows} are supervised at every token (by " + boundary + "): the whole row is an answer, and no "
        "instruction is left for Bitune to read. TRL's `SFTTrainer` supervises whole rows for plain-text (`text`) "
        "data and with `completion_only_loss=False`: use prompt-completion rows (`completion_only_loss` left at None "
        "or True) or conversations with `assistant_only_loss=True`; `BituneSFTTrainer` checks the data before "
        "training.",
    )
    if labels is not None:
        labels = labels.to(device).masked_fill(~is_answer, IGNORE_INDEX)
    return TrainingInputs(
        sequence=sequence,
        valid=valid,
        row_starts=valid.int().argmax(dim=1),
        row_lengths=lengths,
        is_answer=is_answer,
        boundary=boundary,
        labels=labels,
        packed=packed,
    )


def check_continuation_arguments(labels: torch.Tensor | None, prompt_mask: torch.Tensor | None) -> None:
    """Refuse an instruction/answer boundary in a forward that continues a cache (which runs causally)."""
    if prompt_mask is not None or labels is not None:
        raise ValueError(
            "`cache` continues a sequence causally, so it cannot be combined with `labels` or `prompt_mask` "
            "(a new instruction on top of a cache is multi-turn data, not supported yet)."
        )


# Arguments of a transformers forward that the Bitune training forward cannot hand to its passes, and why.
_ARGUMENTS_BITUNE_SETS_PER_PASS = {
    "cache_position": "each of the three passes has its own cache positions, which Bitune computes",
    "logits_to_keep": "the answer pass already computes logits at the answer positions only (the output is zero "
    "before them), and the loss needs all of them",
    "token_type_ids": "it is not split into the instruction and answer passes",
}


def check_training_arguments(kwargs: dict[str, Any]) -> None:
    """
    Refuse, before any compute, what the training forward cannot run as asked. Its passes cover different parts of
    each row, so an argument of the model's forward would reach only one of them: none is passed on (`position_ids`
    and packed boundaries are read before, by `packing.read_packed_examples`). `logits_to_keep` is accepted only as
    0 (all), and `None` values; everything else is refused by name.
    """
    for name, value in kwargs.items():
        if value is None or (name == "logits_to_keep" and isinstance(value, int) and value == 0):
            continue
        reason = _ARGUMENTS_BITUNE_SETS_PER_PASS.get(
            name, "it runs each row in three passes of different lengths, and the argument would reach only one"
        )
        raise ValueError(f"The Bitune training forward does not accept `{name}`: {reason}. Remove it.")


def check_base_model_supported(model: Any, second_pass_attention: str = BIDIRECTIONAL) -> None:
    """Refuse, before any weights are created, a model Bitune cannot run on (with `second_pass_attention`, as the
    Bitune config asks)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generate") or not hasattr(model, "get_decoder"):
        raise ValueError(
            f"Bitune needs a transformers causal language model (e.g. `AutoModelForCausalLM`), got "
            f"{type(model).__name__}."
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"Bitune tunes decoder-only models; {type(model).__name__} is an encoder-decoder model."
        )
    if getattr(text_config(model), "use_cache", None) is None:
        raise ValueError(
            f"Bitune reads the prompt into a KV cache, and {type(model).__name__} has no KV cache support."
        )
    if not hasattr(text_config(model), "num_hidden_layers"):
        raise ValueError(f"Cannot find `num_hidden_layers` in the config of {type(model).__name__}.")
    check_no_recurrent_layers(model)
    check_decoder_stack(model)
    if second_pass_attention == BIDIRECTIONAL:
        check_bidirectional_attention(model)


def check_no_recurrent_layers(model: Any) -> None:
    """
    Refuse a model with a linear-attention or Mamba (state-space) layer, such as Qwen3-Next, Falcon-H1, Jamba or Mamba:
    its cache holds a recurrent state (one summary of the whole prefix, and a convolution window) where an attention
    layer holds keys and values per position. Bitune mixes the two prompt passes' keys and values position by
    position, which is not defined for a recurrent state. transformers' own cache says which layers hold one.
    """
    config = text_config(model)
    if getattr(config, "model_type", None) in _OWN_STATE_CACHES:
        raise ValueError(
            f"Bitune cannot tune {type(model).__name__}: it is a recurrent model whose cache is its own recurrent "
            "state, not keys and values per position; Bitune mixes its two prompt passes' keys/values position by "
            "position, which is not defined for a recurrent state. Use a model whose layers are all attention layers."
        )
    layers = DynamicCache(config=config).layers
    recurrent = [index for index, layer in enumerate(layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]
    if recurrent:
        index, layer_types = recurrent[0], getattr(config, "layer_types", None)
        kind = layer_types[index] if layer_types else type(layers[index]).__name__
        raise ValueError(
            f"Bitune cannot tune {type(model).__name__}: layer {index} (`{kind}`) has a linear-attention or Mamba "
            "part, whose cache is a recurrent state, not keys and values per position; Bitune mixes its two prompt "
            "passes' keys/values position by position, which is not defined for a recurrent state. Use a model whose "
            "layers are all attention layers."
        )


# Recurrent families whose cache is a class of their own (transformers' `generate` gives them no `DynamicCache`), so
# that `DynamicCache(config=...)` cannot tell: a Bitune pass hands them a `DynamicCache`, and they fail at the first
# forward (xLSTM: `AttributeError ... 'rnn_state'`; RWKV: a `RuntimeError`).
_OWN_STATE_CACHES = ("rwkv", "xlstm")


def check_decoder_stack(model: Any) -> None:
    """Refuse a model whose `get_decoder()` is not its decoder stack, or whose layers Bitune cannot find: Bitune runs
    its prompt passes through them. ModernBERT-decoder's returns its output projection (an `nn.Linear` named
    `decoder`), which fails at the first forward (`Linear.forward() got an unexpected keyword argument 'cache'`)."""
    from transformers import PreTrainedModel
    from transformers.modeling_layers import GradientCheckpointingLayer

    decoder = decoder_of(model)
    if not isinstance(decoder, PreTrainedModel):
        raise ValueError(
            f"Bitune cannot tune {type(model).__name__}: its `get_decoder()` returns a {type(decoder).__name__}, not "
            "the decoder stack its prompt passes run through. Use another model family (plain LoRA can tune this one)."
        )
    # Each decoder layer is found as transformers' `GradientCheckpointingLayer` (`routing.ModuleIndex`): where a
    # prompt pass ends, and what a checkpointed step reads layer by layer. GPT-NeoX-Japanese's layers are not.
    if not any(isinstance(module, GradientCheckpointingLayer) for module in decoder.modules()):
        raise ValueError(
            f"Bitune cannot tune {type(model).__name__}: its decoder layers are not transformers' "
            "`GradientCheckpointingLayer`s, by which Bitune finds each layer of its passes (an older modelling file). "
            "Use another model family (plain LoRA can tune this one)."
        )


# Families whose decoder layers do not hand `is_causal` on to their attention, so that SDPA (and flash attention),
# given no mask where the prompt has no padding, fall back on the layer's own causal flag (measured: an earlier
# position's keys do not change when a later prompt token does). Their eager attention reads the mask, which is
# bidirectional.
_IS_CAUSAL_REACHES_EAGER_ONLY = ("nemotron", "stablelm")
# The layer type of chunked attention (Llama 4), whose mask function (`create_chunked_causal_mask`) reads no
# `is_causal`: causal within each chunk, whatever is asked.
_CHUNKED = "chunked_attention"


def check_bidirectional_attention(model: Any) -> None:
    """
    Refuse a model on which `is_causal=False` would not make the bidirectional prompt pass bidirectional: it would
    silently run causally. transformers turns the argument into the config flag its mask functions read in
    `merge_with_config_defaults`, a decorator of the decoder's `forward`; families whose `forward` lacks it (Bloom,
    MPT, Falcon, GPT-Neo, GPT-NeoX-Japanese) build a causal mask whatever is asked, and so does chunked attention
    (Llama 4). Some others (Nemotron, StableLM) lose the argument on the way to SDPA or flash attention.
    """
    decoder = decoder_of(model)
    name, config = type(model).__name__, text_config(model)
    how = "run its bidirectional prompt pass causally"
    if not _reads_is_causal(type(decoder).forward):
        raise ValueError(
            f"Bitune cannot tune {name}: {type(decoder).__name__} ignores `is_causal=False` (its forward builds a "
            f"causal mask whatever is asked), so Bitune would {how}. Use another model family, or set "
            "`second_pass_attention='causal'` in the BituneConfig."
        )
    chunked = [index for index, kind in enumerate(getattr(config, "layer_types", None) or []) if kind == _CHUNKED]
    if chunked:
        raise ValueError(
            f"Bitune cannot tune {name}: layer {chunked[0]} runs chunked attention, whose mask transformers builds "
            f"causal whatever is asked, so Bitune would {how}. Use another model family, or set "
            "`second_pass_attention='causal'` in the BituneConfig."
        )
    check_attention_reads_is_causal(model)


def check_attention_reads_is_causal(model: Any) -> None:
    """Refuse a family whose decoder layers hand `is_causal=False` to eager attention only (Nemotron, StableLM) with
    another attention. Checked when the adapter is made and again by each bidirectional pass: `set_attn_implementation`
    may switch it afterwards."""
    implementation = compat.attention_implementation(model)
    if getattr(text_config(model), "model_type", None) in _IS_CAUSAL_REACHES_EAGER_ONLY and implementation != "eager":
        raise ValueError(
            f"Bitune cannot run {type(model).__name__} with `attn_implementation='{implementation}'`: its decoder "
            "layers do not hand `is_causal=False` on to that attention, so Bitune would run its bidirectional prompt "
            "pass causally. Load it (or `set_attn_implementation`) with 'eager', or set "
            "`second_pass_attention='causal'` in the BituneConfig."
        )


def _reads_is_causal(forward: Any) -> bool:
    """Whether a decoder's `forward` is wrapped in transformers' `merge_with_config_defaults`, which hands an
    `is_causal` argument to the mask functions (through the config they read): one of the functions its wrappers'
    `__wrapped__` lead through runs that decorator's wrapper code."""
    from transformers.utils.generic import merge_with_config_defaults

    wrapper_code = merge_with_config_defaults(lambda self: None).__code__
    while forward is not None:
        if getattr(forward, "__code__", None) is wrapper_code:
            return True
        forward = getattr(forward, "__wrapped__", None)
    return False
