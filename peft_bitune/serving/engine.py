"""The chat engine behind `bitune-serve`: reads conversations as the adapter was trained to, reuses kept caches, runs
one model worker.

A request's conversation is laid out by `prompts.py` as training lays it out (turn by turn for `multi_turn=
"alternating"`, one instruction for `"history"`). The engine reuses the part of a kept conversation whose keys and
values are exactly those of that layout (`conversations.py`), crops the rest away, reads what is missing segment by
segment (each instruction twice, mixed, over the cache so far; answers causally) and decodes. So an answer never
depends on what the server happened to keep: a full prefill is the same computation with nothing reused.

Every request runs on one worker thread (`worker.ModelWorker`), one after another: a request waits for the ones before
it, and no two requests ever share a cache or a generation. The engine knows nothing about HTTP; `app.py` turns
requests into `ChatRequest`s and results into OpenAI responses.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import StoppingCriteriaList

from .. import compat
from ..caches import BituneCache
from ..common import max_positions
from ..lookup import find_bitune_tuner
from .conversations import ConversationStore, KeptConversation
from .prompts import Prompt, PromptBuilder, PromptLayoutError
from .streaming import Cancelled, cut_at_stop
from .worker import ModelWorker


@dataclass
class ChatRequest:
    """
    One chat completion, validated and laid out.

    Args:
        prompt (`Prompt`): the conversation's token ids and segments, ending with the assistant's header.
        generation_config (`GenerationConfig`): sampling settings of the request.
        max_tokens (`int`, *optional*): the most tokens to generate; `None` for as many as the model's positions
            leave.
        stop (`list[str]`): strings that end the answer; the answer returned stops before the first one.
        seed (`int`, *optional*): seeds torch right before this request's generation.
        partition (`Hashable`): whose kept conversations this request may reuse (see `conversations.py`).
    """

    prompt: Prompt
    generation_config: Any
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    partition: Hashable = None


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

    The chat template is compiled and tried once here, on a plain conversation: a template that fails, or whose
    answers cannot be found for an alternating adapter, is refused before any request (`ValueError`).

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
        tuner = find_bitune_tuner(model)
        if tuner is None:
            raise ValueError(f"`model` has no Bitune adapter ({type(model).__name__}); load one with PeftModel.")
        self.model = model
        self.tokenizer = tokenizer
        self.tuner = tuner
        self.multi_turn = tuner.peft_config[tuner.active_adapter].multi_turn
        self.prompts = PromptBuilder(tokenizer, chat_template, self.multi_turn, _eos_texts(model, tokenizer))
        from jinja2 import TemplateError  # chat templates need jinja2 (the `serve` extra)

        try:
            self.prompts.check()
        except (TemplateError, PromptLayoutError) as error:
            raise ValueError(f"The chat template cannot be used: {type(error).__name__}: {error}") from error
        self.store = ConversationStore(cache_budget_bytes)
        self.max_positions = max_positions(model)
        self.worker = ModelWorker()

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
        before the request started. A request that fails after it took a kept conversation drops that conversation
        (its cache may be half extended); requests are checked before they are queued, so that only an internal error
        can do this.
        """
        if cancelled is not None and cancelled.is_set():
            return None  # the client left while the request was queued: no work at all
        prompt = request.prompt
        generation_config = copy.copy(request.generation_config)
        generation_config.max_new_tokens = request.max_tokens
        if request.max_tokens is None:
            generation_config.max_new_tokens = self.max_positions - len(prompt) if self.max_positions else 1024
        generation_config.return_dict_in_generate = True
        kept, cached_tokens = self.store.take(request.partition, prompt)
        cache = self.read(prompt, None if kept is None else kept.cache, cached_tokens)
        if request.seed is not None:
            torch.manual_seed(request.seed)
        ids = torch.tensor([prompt.token_ids], device=self.model.device)
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
        answer_ids = output.sequences[0, len(prompt) :].tolist()
        self.store.keep(
            KeptConversation(prompt.followed_by_answer(answer_ids), compat.output_cache(output), request.partition)
        )
        content, hit_stop = cut_at_stop(self.tokenizer.decode(answer_ids, skip_special_tokens=True), request.stop)
        ended_by_eos = bool(answer_ids) and answer_ids[-1] in _eos_ids(generation_config)
        finished = hit_stop or ended_by_eos or len(answer_ids) < generation_config.max_new_tokens
        return ChatResult(content, answer_ids, "stop" if finished else "length", len(prompt), cached_tokens)

    def read(self, prompt: Prompt, cache: BituneCache | None = None, cached: int = 0) -> BituneCache:
        """
        The cache of `prompt` minus its last token, laid out segment by segment, ready for `generate`.

        Each instruction segment but its last token is read twice over the cache so far and mixed
        (`prefill(cache=...)`); the tokens between (the instruction's last token, then the answer) run causally
        first. Given a `cache` whose first `cached` positions hold `prompt`'s first tokens exactly so, it is cropped
        to them and only the rest is read.
        """
        ids = prompt.token_ids
        if cache is not None and cached < cache.get_seq_length():
            cache.crop(cached - cache.get_seq_length())  # a negative count removes that many (every release's form)
        for start, end, is_answer in prompt.segments():
            if is_answer or (cache is not None and end - 1 <= cached):
                continue  # answers run causally before the next instruction; this instruction's mix is held
            if cache is None:  # the first instruction, nothing reused
                cache = self.tuner.prefill(self._tensor(ids[:end]))
            else:
                cache.record_conversation(*self._with_mask(ids[:start]))  # ... the answer it follows ends here
                self.tuner.prefill(self._tensor(ids[:end]), cache=cache)
            cached = end - 1
        cache.record_conversation(*self._with_mask(ids[:-1]))  # all but the last token, which `generate` reads
        return cache

    def _tensor(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], dtype=torch.long, device=self.model.device)

    def _with_mask(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        tensor = self._tensor(ids)
        return tensor, torch.ones_like(tensor)

    def close(self) -> None:
        """Stop the worker once the queued requests have run."""
        self.worker.close()


def _eos_texts(model: Any, tokenizer: Any) -> list[str]:
    """The texts of the end-of-sequence tokens (the tokenizer's and the generation config's), which end an answer."""
    texts = [tokenizer.eos_token] if tokenizer.eos_token else []
    texts += [tokenizer.decode([token_id]) for token_id in sorted(_eos_ids(model.generation_config))]
    return list(dict.fromkeys(text for text in texts if text))


def _eos_ids(generation_config: Any) -> set[int]:
    eos = generation_config.eos_token_id
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}
