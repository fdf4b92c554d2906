"""The engine options Bitune needs, set for the user, and the ones refused before an engine starts.

Bitune reads a whole prompt in one step (both prompt passes see all of it) and writes keys/values into the cache that
no plain causal read of the same tokens would give, so:

- prefix caching is off (a cached prefix holds another prompt's mix, or plain causal keys/values);
- chunked prefill is off and one step's token budget holds the longest prompt (a prompt split over steps would be read
  twice in parts);
- tensor and pipeline parallelism are refused (the plugin's own attention and LoRA are computed unsharded);
- torch.compile and CUDA graphs are off (`enforce_eager`): which rows are fresh prompts is decided in Python, per step;
- speculative decoding and vLLM's own LoRA are refused (they run the model on other rows than the plugin expects).

The same checks run on the engine's config when the model is built, so that `vllm serve` refuses them too.
"""

from __future__ import annotations

from typing import Any

# The base model config field (set through `hf_overrides`) that names the adapter folder.
ADAPTER_FIELD = "bitune_adapter"
# The transformers architecture of a base model -> the registered name of the class that serves it with Bitune.
ARCHITECTURES = {
    "LlamaForCausalLM": "BituneLlamaForCausalLM",
    "MistralForCausalLM": "BituneMistralForCausalLM",
    "Qwen2ForCausalLM": "BituneQwen2ForCausalLM",
    "Qwen3ForCausalLM": "BituneQwen3ForCausalLM",
    "Gemma3ForCausalLM": "BituneGemma3ForCausalLM",
}
# Options Bitune sets; a user value other than this one is refused, with the reason.
_REQUIRED = {
    "enable_prefix_caching": (False, "a cached prefix would hold another prompt's mixed keys/values"),
    "enable_chunked_prefill": (False, "both prompt passes must read the whole prompt in one step"),
    "enforce_eager": (True, "the plugin decides per step, in Python, which rows are fresh prompts"),
    "tensor_parallel_size": (1, "the plugin computes its own attention and LoRA unsharded"),
    "pipeline_parallel_size": (1, "the bidirectional pass runs through every decoder layer in one process"),
    "enable_lora": (False, "the Bitune adapter is the plugin's LoRA; vLLM's LoRA would run beside it"),
}
_REFUSED = {
    "speculative_config": "speculative decoding runs draft rows the plugin would read as prompts",
    "hf_overrides": "the plugin sets `hf_overrides` itself (architecture and adapter folder)",
    "scheduler_cls": "the plugin's scheduler stops a preempted request that vLLM would resume inexactly",
}
# The scheduler a Bitune engine runs (vllm_integration/scheduler.py; named, not imported: it imports vLLM's).
SCHEDULER_NAME = "vllm_integration.scheduler.BituneScheduler"


def bitune_architecture(architectures: list[str] | None) -> str:
    """The registered Bitune class for a base model's `architectures`, or a refusal naming the architecture."""
    for architecture in architectures or []:
        if architecture in ARCHITECTURES:
            return ARCHITECTURES[architecture]
    raise ValueError(
        f"The Bitune vLLM plugin does not support the base architecture {architectures}: it supports "
        f"{', '.join(ARCHITECTURES)}. Serve this adapter with `bitune-serve` (peft_bitune.serving), which runs any "
        "base that peft_bitune trains."
    )


def engine_kwargs(adapter_folder: str, architecture: str, max_position_embeddings: int | None,
                  user: dict[str, Any]) -> dict[str, Any]:
    """The `vllm.LLM` keyword arguments for a Bitune adapter: the user's, checked, plus what Bitune needs."""
    for name, (value, why) in _REQUIRED.items():
        if name in user and user[name] != value:
            raise ValueError(f"`{name}={user[name]!r}` cannot be used with a Bitune adapter: {why}. Remove it.")
    for name, why in _REFUSED.items():
        if user.get(name) is not None:
            raise ValueError(f"`{name}` cannot be used with a Bitune adapter: {why}. Remove it.")
    kwargs = dict(user)
    kwargs.update({name: value for name, (value, _) in _REQUIRED.items() if name != "enable_lora"})
    max_model_len = kwargs.get("max_model_len") or max_position_embeddings
    budget = kwargs.get("max_num_batched_tokens")
    if budget is not None and max_model_len is not None and budget < max_model_len:
        raise ValueError(
            f"`max_num_batched_tokens={budget}` is below `max_model_len={max_model_len}`: a prompt that does not fit "
            "one step would be split, and both prompt passes must read it whole. Raise it, or lower `max_model_len`."
        )
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
        kwargs["max_num_batched_tokens"] = budget or max_model_len
    kwargs["hf_overrides"] = {"architectures": [architecture], ADAPTER_FIELD: adapter_folder}
    kwargs["scheduler_cls"] = SCHEDULER_NAME
    return kwargs


def check_engine_config(vllm_config: Any) -> None:
    """The same refusals on an engine's config (the `vllm serve` path), before the model is built."""
    found = {
        "enable_prefix_caching": vllm_config.cache_config.enable_prefix_caching,
        "enable_chunked_prefill": vllm_config.scheduler_config.enable_chunked_prefill,
        "enforce_eager": vllm_config.model_config.enforce_eager,
        "tensor_parallel_size": vllm_config.parallel_config.tensor_parallel_size,
        "pipeline_parallel_size": vllm_config.parallel_config.pipeline_parallel_size,
        "enable_lora": vllm_config.lora_config is not None,
    }
    for name, (value, why) in _REQUIRED.items():
        if found[name] != value:
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"The Bitune adapter needs `{name}={value!r}` ({flag}), got {found[name]!r}: {why}."
            )
    scheduler = vllm_config.scheduler_config.scheduler_cls
    scheduler_name = scheduler if isinstance(scheduler, str) else f"{scheduler.__module__}.{scheduler.__qualname__}"
    if scheduler_name != SCHEDULER_NAME:
        raise ValueError(
            f"The Bitune adapter needs `--scheduler-cls {SCHEDULER_NAME}`, got {scheduler_name}: vLLM's own scheduler "
            "resumes a preempted request by reading its answer as prompt, which Bitune would mix."
        )
    if vllm_config.speculative_config is not None:
        why = _REFUSED["speculative_config"]
        raise ValueError(f"Speculative decoding cannot be used with a Bitune adapter: {why}.")
    budget = vllm_config.scheduler_config.max_num_batched_tokens
    max_model_len = vllm_config.model_config.max_model_len
    if budget < max_model_len:
        raise ValueError(
            f"The Bitune adapter needs `--max-num-batched-tokens` ({budget}) of at least `--max-model-len` "
            f"({max_model_len}): both prompt passes must read a prompt in one step."
        )
    if not getattr(vllm_config.model_config.hf_config, ADAPTER_FIELD, None):
        raise ValueError(
            f"No Bitune adapter named: pass `--hf-overrides` with \"{ADAPTER_FIELD}\": \"<adapter folder>\" (see "
            "docs/serving.md, On vLLM), or use `vllm_integration.load_llm`."
        )


def check_chat(messages: Any, multi_turn: str) -> None:
    """Refuse a chat of several turns for an `alternating` adapter: it reads each instruction twice over the
    conversation so far, which one vLLM prompt cannot express (a `history` adapter reads the chat as one instruction,
    which is what vLLM's prompt is)."""
    conversations = messages if messages and isinstance(messages[0], list) else [messages]
    for conversation in conversations:
        users = sum(1 for message in conversation if message.get("role") == "user")
        if multi_turn == "alternating" and users > 1:
            raise ValueError(
                f"A chat of {users} user turns cannot be served exactly for this adapter (multi_turn='alternating' "
                "reads each turn twice over the conversation's cache, which vLLM does not keep): send one turn, or "
                "serve multi-turn chats with `bitune-serve`."
            )


MULTI_TURN_REFUSAL = (
    "This Bitune adapter (multi_turn='alternating') reads each user turn twice over the conversation's cache, which "
    "vLLM does not keep, so a chat of several user turns cannot be served exactly: send one turn, or serve "
    "multi-turn chats with bitune-serve."
)


def guarded_chat_template(template: str) -> str:
    """`template` with a guard in front that refuses (through the template's `raise_exception`, before any token) a
    chat of several user turns: the server-side counterpart of `check_chat`, for `vllm serve`."""
    guard = (
        "{%- if (messages | selectattr('role', 'equalto', 'user') | list | length) > 1 -%}"
        "{{ raise_exception(" + repr(MULTI_TURN_REFUSAL) + ") }}{%- endif -%}\n"
    )
    return guard + template
