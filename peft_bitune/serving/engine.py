"""The chat engine behind `bitune-serve`: reads conversations as the adapter was trained to, reuses kept caches, and
answers waiting requests in batches on one model worker.

A request's conversation is laid out by `prompts.py` as training lays it out (turn by turn for `multi_turn=
"alternating"`, one instruction for `"history"`). The engine reuses the part of a kept conversation whose keys and
values are exactly those of that layout (`conversations.py`), crops the rest away, reads what is missing segment by
segment (each instruction twice, mixed, over the cache so far; answers causally) and decodes. So an answer never
depends on what the server happened to keep: a full prefill is the same computation with nothing reused.

All model work runs on one worker thread (`worker.py`), which answers the requests that arrived while it was busy in
one batch (`batching.py`: each prompt read alone, only decoding batched), or on a `run` caller's thread, never both
at once (`_MODEL_LOCKS`). Batches are static: continuous batching would need a decoding loop of our own instead of
transformers' `generate`. HTTP is `app.py`'s.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import StoppingCriteriaList

from .. import compat
from ..tuner.caches import BituneCache
from ..tuner.find_tuner import find_bitune_tuner
from ..utils.base_model import max_positions
from .batching import RowStops, row_cache, stack_left_padded
from .conversations import ConversationStore, KeptConversation
from .prompts import Prompt, checked_prompt_builder
from .settings import BatchLimits
from .streaming import RowStreams, StopStrings, answer_text, cut_at_stop
from .worker import ModelWorker

# One lock per Bitune model, held by each batch from its first read to its end, whichever engine and thread runs it.
# The model's own calls already take turns (`routing.one_call_at_a_time`), but a batch is several of them (each row's
# read, then `generate` after seeding torch's random state) over shared kept caches, and it hands a row's result over
# from inside `generate`, so that a caller may go on to `run` while the worker still finishes that batch.
_MODEL_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class ChatRequest:
    """One chat completion, validated and laid out. A `seed` seeds torch right before the request's generation, and
    the request is then answered alone, so that its random stream is its own."""

    prompt: Prompt  # the conversation's token ids and segments, ending with the assistant's header
    generation_config: Any  # the request's sampling settings
    max_tokens: int | None = None  # None: as many as the model's positions leave
    stop: list[str] = field(default_factory=list)  # strings that end the answer (returned without them)
    seed: int | None = None
    partition: Hashable = None  # whose kept conversations this request may reuse (see `conversations.py`)


@dataclass
class ChatResult:
    """What a finished request produced: the answer, why it ended, and the OpenAI usage counts."""

    content: str
    answer_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int


@dataclass
class _Row:
    """A request waiting for the worker, with where its answer streams to and whether its client left."""

    request: ChatRequest
    streamer: Any
    cancelled: threading.Event | None
    sampling: dict  # the generation settings rows of one batch must share


@dataclass
class _Read:
    """A row whose prompt has been read: its cache holds all of the prompt but the last token."""

    row: _Row
    cache: BituneCache | None
    cached_tokens: int


class ChatEngine:
    """A Bitune `PeftModel` in eval mode, its tokenizer and chat template (`chat_template` overrides the tokenizer's
    own; checked here, `prompts.checked_prompt_builder`), the kept conversations (`cache_budget_bytes`; 0: every turn
    a full prefill), and the one worker thread, which answers waiting requests together within `limits`."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        chat_template: str | None,
        cache_budget_bytes: int,
        limits: BatchLimits | None = None,
    ) -> None:
        tuner = find_bitune_tuner(model)
        if tuner is None:
            raise ValueError(f"`model` has no Bitune adapter ({type(model).__name__}); load one with PeftModel.")
        self.model = model
        self.tokenizer = tokenizer
        self.tuner = tuner
        self.multi_turn = tuner.peft_config[tuner.active_adapter].multi_turn
        self.prompts = checked_prompt_builder(tokenizer, chat_template, self.multi_turn)
        self.store = ConversationStore(cache_budget_bytes)
        self.max_positions = max_positions(model)
        self.chars_per_token = max(1, max((len(token) for token in tokenizer.get_vocab()), default=1))
        self.limits = limits or BatchLimits()
        # Sliding-window layers count their window in cache columns and keep only its last ones: such caches cannot
        # be padded together, so those models answer one request at a time.
        self.batchable = not any(BituneCache(config=model.config).is_sliding)
        self.worker = ModelWorker()
        self._model_lock = _MODEL_LOCKS.setdefault(tuner, threading.RLock())

    def fewest_tokens(self, messages: list[dict]) -> int:
        """The fewest tokens `messages` can take once rendered, known without rendering them (so that a conversation
        that cannot fit is refused in time linear in the request): a template writes at least one token per message
        and every message's text, and one token holds at most the vocabulary's longest token's characters."""
        characters = sum(len(message["content"]) for message in messages)
        return max(len(messages), -(-characters // self.chars_per_token))

    def room_for(self, prompt_tokens: int, max_tokens: int | None) -> bool:
        """Whether a prompt of this many tokens and its answer fit in the model's positions."""
        return self.max_positions is None or prompt_tokens + (max_tokens or 1) <= self.max_positions

    def submit(self, request: ChatRequest, streamer: Any = None, cancelled: threading.Event | None = None) -> Future:
        """Queue a request on the worker (answered in its next batch, with the waiting requests that `can_join` it);
        returns the future of its `ChatResult` (None if its client left first). `streamer` receives the answer's
        tokens as they come. Once `cancelled` is set (the client left), the request's row ends at the next token,
        unstreamed and not kept; set before the request started, no work is done for it."""
        return self.worker.submit_item(self, _Row(request, streamer, cancelled, _sampling_settings(request)))

    def run(
        self, request: ChatRequest, streamer: Any = None, cancelled: threading.Event | None = None
    ) -> ChatResult | None:
        """Answer one request alone, on the calling thread once no batch uses the model (the unbatched reference: what
        `submit` answers too)."""
        (result,) = self.run_batch([_Row(request, streamer, cancelled, _sampling_settings(request))])
        if isinstance(result, BaseException):
            raise result
        return result

    def can_join(self, batch: list[_Row], row: _Row) -> bool:
        """Whether `row` may be answered in one batch with `batch`: within `limits`, the same sampling settings, no
        `seed` (its answer must not depend on what else is waiting), no sliding-window layers (their caches cannot be
        padded), and a padded batch that fits in the model's positions."""
        rows = [*batch, row]
        if not self.batchable or len(rows) > self.limits.max_batch_size:
            return False
        if any(r.request.seed is not None for r in rows) or row.sampling != batch[0].sampling:
            return False
        longest = max(len(r.request.prompt) for r in rows) + max(self.max_new_tokens(r.request) for r in rows)
        if self.max_positions is not None and longest > self.max_positions:
            return False
        return len(rows) * longest <= self.limits.max_batch_tokens

    def max_new_tokens(self, request: ChatRequest) -> int:
        """The most tokens the request's answer may take: its `max_tokens`, or what the model's positions leave."""
        if request.max_tokens is not None:
            return request.max_tokens
        return self.max_positions - len(request.prompt) if self.max_positions else 1024

    def run_batch(
        self, rows: list[_Row], deliver: Callable[[int, Any], None] | None = None
    ) -> list[ChatResult | BaseException | None]:
        """Answer rows together, on the worker thread: each row's prompt read alone (`read`, from its kept conversation
        where there is one), then all decoded in one `generate`. One result per row: a `ChatResult`, None for a row
        whose client left, or the exception of a row that failed (which drops the kept conversation it took: its
        cache may be half extended). `deliver(index, result)` gets a row's result as soon as the row has ended."""
        with self._model_lock:  # the batch's whole use of the model (see `_MODEL_LOCKS`)
            results: list[ChatResult | BaseException | None] = [None] * len(rows)
            ready: list[tuple[int, _Read]] = []
            for index, row in enumerate(rows):
                if row.cancelled is not None and row.cancelled.is_set():
                    continue  # the client left while the request was queued: no work at all
                try:
                    kept, cached_tokens = self.store.take(row.request.partition, row.request.prompt)
                    cache = self.read(row.request.prompt, None if kept is None else kept.cache, cached_tokens)
                except Exception as error:
                    results[index] = error
                else:
                    ready.append((index, _Read(row, cache, cached_tokens)))
            if ready:
                early = None if deliver is None else (lambda number, result: deliver(ready[number][0], result))
                for (index, _), result in zip(ready, self._decode([read for _, read in ready], early)):
                    results[index] = result
            return results

    def _decode(
        self, reads: list[_Read], deliver: Callable[[int, Any], None] | None = None
    ) -> list[ChatResult | BaseException | None]:
        """Decode read prompts in one `generate`, left-padded; keep each finished conversation. In a batch of several,
        each row's result is made (and handed to `deliver`) when the row ends, from its columns of the batch's cache
        as they stand then."""
        prompts = [read.row.request.prompt for read in reads]
        width = max(len(prompt) for prompt in prompts)
        generation_config = copy.copy(reads[0].row.request.generation_config)
        max_new_tokens = [self.max_new_tokens(read.row.request) for read in reads]
        generation_config.max_new_tokens = max(max_new_tokens)
        generation_config.stop_strings = None  # per row, in `RowStops`
        generation_config.return_dict_in_generate = True
        pad = generation_config.pad_token_id or 0
        ids = torch.tensor([[pad] * (width - len(p)) + p.token_ids for p in prompts], device=self.model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.model.device)
        if len(reads) == 1:
            cache = reads[0].cache  # nothing to pad: the cache as read (also for sliding-window layers)
        else:
            cache = stack_left_padded([read.cache for read in reads], self.tuner.model)
            cache.record_conversation(ids[:, :-1], mask[:, :-1])
        for read in reads:
            read.cache = None  # the rows' own caches are in the batch now: free them
        results: dict[int, ChatResult | BaseException | None] = {}

        def row_ended(row: int, sequences: torch.Tensor) -> None:
            try:
                results[row] = self._result(reads[row], row, sequences, cache, stops, alone=False)
            except Exception as error:  # this row's failure; the batch goes on
                results[row] = error
            if deliver is not None:
                deliver(row, results[row])

        stops = RowStops(width, max_new_tokens, _eos_ids(generation_config),
                         [StopStrings(self.tokenizer, read.row.request.stop) if read.row.request.stop else None
                          for read in reads],
                         [read.row.cancelled for read in reads], row_ended if len(reads) > 1 else None)
        streams = [read.row.streamer for read in reads]
        seed = reads[0].row.request.seed
        if seed is not None:  # only ever alone in its batch (`can_join`)
            torch.manual_seed(seed)
        streamer = RowStreams(streams, lambda row: stops.lengths[row] is not None) if any(streams) else None
        output = self.model.generate(input_ids=ids, attention_mask=mask, cache=cache, streamer=streamer,
                                     generation_config=generation_config,
                                     stopping_criteria=StoppingCriteriaList([stops]))
        output_cache = compat.output_cache(output)
        return [results[row] if row in results else self._result(read, row, output.sequences, output_cache, stops,
                                                                   len(reads) == 1)
                for row, read in enumerate(reads)]

    def _result(
        self, read: _Read, row: int, sequences: torch.Tensor, cache: BituneCache, stops: RowStops, alone: bool
    ) -> ChatResult | None:
        """One row's answer, its conversation kept (its columns of the batch's cache)."""
        request, width = read.row.request, stops.prompt_width
        if read.row.cancelled is not None and read.row.cancelled.is_set():
            return None  # the client left: an answer cut short is neither returned nor kept
        generated = stops.lengths[row] if stops.lengths[row] is not None else sequences.shape[1] - width
        answer_ids = sequences[row, width : width + generated].tolist()
        prompt = request.prompt
        if not alone:
            conversation = prompt.token_ids + answer_ids
            cache = row_cache(cache, row, width - len(prompt), width - 1 + generated, conversation, self.tuner.model)
        self.store.keep(KeptConversation(prompt.followed_by_answer(answer_ids), cache, request.partition))
        content, hit_stop = cut_at_stop(answer_text(self.tokenizer, answer_ids), request.stop)
        ended_by_eos = bool(answer_ids) and answer_ids[-1] in stops.eos_ids
        finished = hit_stop or ended_by_eos or generated < stops.max_new_tokens[row]
        return ChatResult(content, answer_ids, "stop" if finished else "length", len(prompt), read.cached_tokens)

    def read(self, prompt: Prompt, cache: BituneCache | None = None, cached: int = 0) -> BituneCache:
        """The cache of `prompt` minus its last token, ready for `generate`: each instruction segment but its last
        token read twice over the cache so far and mixed (`prefill(cache=...)`), the tokens between (the instruction's
        last token, then the answer) causally first. Given a `cache` whose first `cached` positions hold `prompt`'s
        first tokens exactly so, it is cropped to them and only the rest is read."""
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


def _sampling_settings(request: ChatRequest) -> dict:
    """The request's generation settings but its answer length and stop strings, which each row of a batch has of its
    own: rows of one batch share the rest (one `generate`)."""
    own = ("max_new_tokens", "stop_strings")
    return {key: value for key, value in request.generation_config.to_dict().items() if key not in own}


def _eos_ids(generation_config: Any) -> set[int]:
    eos = generation_config.eos_token_id
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos or ()}
