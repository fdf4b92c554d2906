"""The chat engine behind `bitune-serve`: renders conversations, continues kept caches, runs one model worker.

Every request runs on one worker thread (`worker.ModelWorker`), one after another: a request waits for the
ones before it, and no two requests ever share a cache or a generation. A request whose rendered prompt extends a kept
conversation (see `conversations.py`) is a chat continuation exactly as in docs/generation.md: `input_ids` is the kept
output sequence followed by the tokens of the new text, `cache` the kept cache, so only the new tokens are
read (paper A.8, alternating). Otherwise the whole rendered prompt is one instruction (a full prefill).

The engine knows nothing about HTTP; `app.py` turns requests into `ChatRequest`s and results into OpenAI responses.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import StoppingCriteriaList

from .. import compat
from ..common import max_positions
from .conversations import ConversationStore, KeptConversation
from .streaming import Cancelled, cut_at_stop
from .worker import ModelWorker


@dataclass
class ChatRequest:
    """
    One chat completion, validated and rendered.

    Args:
        prompt_text (`str`): the conversation rendered by the chat template, ending with the assistant's header.
        prompt_ids (`list[int]`): `prompt_text` tokenized on its own (the input of a full prefill).
        generation_config (`GenerationConfig`): sampling settings of the request.
        max_tokens (`int`, *optional*): the most tokens to generate; `None` for as many as the model's positions
            leave.
        stop (`list[str]`): strings that end the answer; the answer returned stops before the first one.
        seed (`int`, *optional*): seeds torch right before this request's generation.
    """

    prompt_text: str
    prompt_ids: list[int]
    generation_config: Any
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class ChatResult:
    """What a finished request produced: the answer, why it ended, and the OpenAI usage counts."""

    content: str
    answer_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int


class ChatEngine:
    """
    A Bitune `PeftModel`, its tokenizer and chat template, the kept conversations, and the one worker thread.

    Args:
        model (`PeftModel`): the base model with a Bitune adapter, in eval mode.
        tokenizer: its tokenizer.
        chat_template (`str`, *optional*): a Jinja chat template overriding the tokenizer's own; one of the two is
            required.
        cache_budget_bytes (`int`): memory for kept conversation caches (0: none kept, every turn a full prefill).
    """

    def __init__(self, model: Any, tokenizer: Any, chat_template: str | None, cache_budget_bytes: int) -> None:
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "The tokenizer has no chat template, so conversations cannot be rendered: pass one with "
                "`--chat-template <file>` (a Jinja template, as for vLLM's server), or use a tokenizer that has one."
            )
        self.model = model
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.store = ConversationStore(cache_budget_bytes)
        self.max_positions = max_positions(model)
        self.worker = ModelWorker()

    def render(self, messages: list[dict]) -> str:
        """The conversation as the chat template writes it, ending with the assistant's header."""
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, add_generation_prompt=True, tokenize=False
        )

    def tokenize(self, text: str) -> list[int]:
        # The template writes the special tokens (e.g. BOS) itself, as in transformers' `apply_chat_template`.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def room_for(self, prompt_tokens: int, max_tokens: int | None) -> bool:
        """Whether a prompt of this many tokens and its answer fit in the model's positions."""
        if self.max_positions is None:
            return True
        return prompt_tokens + (max_tokens or 1) <= self.max_positions

    def run(
        self, request: ChatRequest, streamer: Any = None, cancelled: threading.Event | None = None
    ) -> ChatResult | None:
        """
        Answer one request; runs on the worker thread.

        `streamer` receives the answer's tokens as they come (`streaming.TextStream`). Once `cancelled` is set (the
        client left), generation ends at the next token and the conversation is not kept; returns None if it was set
        before the request started.
        """
        if cancelled is not None and cancelled.is_set():
            return None  # the client left while the request was queued: no work at all
        input_ids, cache, cached_tokens = self._continuation_or_full_prefill(request)
        max_new_tokens = request.max_tokens
        if max_new_tokens is None:
            max_new_tokens = self.max_positions - len(input_ids) if self.max_positions else 1024
        if request.seed is not None:
            torch.manual_seed(request.seed)
        generation_config = copy.copy(request.generation_config)
        generation_config.max_new_tokens = max_new_tokens
        generation_config.return_dict_in_generate = True
        ids = torch.tensor([input_ids], device=self.model.device)
        output = self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),  # one conversation: no padding anywhere
            cache=cache,
            generation_config=generation_config,
            tokenizer=self.tokenizer,  # for stop strings
            streamer=streamer,
            stopping_criteria=StoppingCriteriaList([Cancelled(cancelled)] if cancelled is not None else []),
        )
        if cancelled is not None and cancelled.is_set():
            return None  # the client left: an answer cut short is neither returned nor kept
        sequence = output.sequences[0].tolist()
        answer_ids = sequence[len(input_ids) :]
        decoded = self.tokenizer.decode(answer_ids, skip_special_tokens=False)
        self.store.keep(KeptConversation(request.prompt_text + decoded, sequence, compat.output_cache(output)))
        content, hit_stop = cut_at_stop(self.tokenizer.decode(answer_ids, skip_special_tokens=True), request.stop)
        ended_by_eos = bool(answer_ids) and answer_ids[-1] in _eos_ids(request.generation_config)
        finish_reason = "length" if not (hit_stop or ended_by_eos) and len(answer_ids) >= max_new_tokens else "stop"
        return ChatResult(content, answer_ids, finish_reason, len(input_ids), cached_tokens)

    def _continuation_or_full_prefill(self, request: ChatRequest) -> tuple[list[int], Any, int]:
        """The input ids, the cache to continue (or None) and how many of the inputs that cache already holds."""
        kept = self.store.take(request.prompt_text)
        if kept is None:
            return request.prompt_ids, None, 0
        new_ids = self.tokenize(request.prompt_text[len(kept.text) :])
        input_ids = kept.token_ids + new_ids
        if not new_ids or not self.room_for(len(input_ids), request.max_tokens):
            # The full prefill was checked to fit; the continuation's own tokenization may be a little longer.
            self.store.keep(kept)
            return request.prompt_ids, None, 0
        return input_ids, kept.cache, kept.cache.get_seq_length()


def _eos_ids(generation_config: Any) -> set[int]:
    eos = generation_config.eos_token_id
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}
