"""The kept conversations of a chat server: each one's mixed cache, and exactly what that cache stands for.

A kept conversation remembers the conversation its cache was built from, laid out as the adapter reads it (a `Prompt`:
the token ids of the request, then of the answer as generated, and where each instruction and answer is). A later
request reuses the longest part of it whose keys and values are exactly those a full prefill of the request would
compute, and computes only the rest:

- an instruction segment's keys and values are those of the segment read twice and mixed, so they depend on the whole
  segment: they are reused only where the request has the same segment (all tokens but the last, which is read
  causally: a request that changes only that token reuses the rest);
- an answer's keys and values are causal, so any prefix of an answer that the request shares is reused (a client
  that strips the answer's trailing whitespace, an answer cut by a `stop` string or by `max_tokens`, a template that
  writes an answer differently from how it was generated);
- the segments before that point must be the same segments, instructions and answers alike.

So reuse is invisible in the answers: a request gets the same answer whether its conversation came from the cache, a
full prefill, a restarted server or a retry. Conversations are kept apart by a partition (the API key and the client's
`user` and `prompt_cache_key`): a request never reuses, nor learns of, another partition's conversations.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

from ..tuner.caches import BituneCache
from .prompts import Prompt


@dataclass
class KeptConversation:
    """One conversation whose mixed cache the server keeps: `prompt` is the conversation the cache stands for, laid
    out as the adapter reads it (the request's prompt, then the answer as generated, whose last token the cache does
    not hold yet); `partition` is who may reuse it (see the module docstring)."""

    prompt: Prompt
    cache: BituneCache
    partition: Hashable = None
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        if self.cache.conversation_length != len(self.prompt):
            raise ValueError(
                f"The cache stands for {self.cache.conversation_length} tokens but the prompt has {len(self.prompt)}."
            )
        self.nbytes = cache_nbytes(self.cache)

    def reusable_length(self, prompt: Prompt) -> int:
        """How many leading tokens of `prompt` this cache holds exactly as a full prefill of `prompt` would compute
        them (at most all but the prompt's last token, which `generate` must read)."""
        cache_length = self.cache.get_seq_length()
        length = min(reusable_prefix(self.prompt, prompt), cache_length, len(prompt) - 1)
        if length < cache_length and any(self.cache.is_sliding):
            return 0  # cropping: a sliding-window layer has dropped what it would need
        return length


def reusable_prefix(kept: Prompt, request: Prompt) -> int:
    """The longest prefix of `request` laid out as in `kept` whose keys and values are those of `kept` (see the module
    docstring): whole equal segments, then the prefill part of an instruction segment equal in `kept` (all its tokens
    but the last), or a shared part of an answer."""
    shared = common_prefix_length(kept.token_ids, request.token_ids)
    for (start, end, is_answer), (_, kept_end, _) in zip(request.segments(), kept.segments()):
        if end == kept_end and end <= shared:
            continue  # the same segment
        if is_answer:
            return min(shared, end, kept_end)
        if end == kept_end and shared == end - 1:
            return end - 1  # the same instruction but its last token, which is read causally
        return start
    return min(shared, len(kept), len(request))


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two lists (slice comparisons in a binary search: C speed)."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while high - low > 1:  # a[:low] == b[:low] and a[:high] != b[:high]
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


def cache_nbytes(cache: BituneCache) -> int:
    """Bytes held by a cache's keys and values."""
    tensors = (tensor for layer in cache.layers for tensor in (layer.keys, layer.values) if tensor is not None)
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


class ConversationStore:
    """Kept conversations under a memory budget for all their caches together (`max_bytes`; 0 keeps nothing),
    least recently used dropped first. `take` hands a kept conversation over to the request that reuses it (it
    leaves the store: `generate` extends the cache in place, and the result is kept again as a new conversation)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"`max_bytes` must be 0 or more, got {max_bytes}.")
        self.max_bytes = max_bytes
        self._kept: OrderedDict[int, KeptConversation] = OrderedDict()
        self._next_key = 0
        self._nbytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def take(self, partition: Hashable, prompt: Prompt) -> tuple[KeptConversation | None, int]:
        """Remove and return the kept conversation of `partition` that holds the most of `prompt`, and how many of
        its tokens it holds (see `KeptConversation.reusable_length`); `(None, 0)` if none holds any."""
        with self._lock:
            lengths = {key: kept.reusable_length(prompt) for key, kept in self._kept.items()
                       if kept.partition == partition}
            best_key = max(lengths, key=lengths.__getitem__, default=None)  # the first of the longest
            best_length = 0 if best_key is None else lengths[best_key]
            if best_length == 0:
                return None, 0
            best = self._kept.pop(best_key)
            self._nbytes -= best.nbytes
            return best, best_length

    def keep(self, conversation: KeptConversation) -> bool:
        """Keep a conversation, dropping the least recently used ones it needs room from; False if it alone exceeds
        the budget (it is not kept then)."""
        with self._lock:
            if conversation.nbytes > self.max_bytes:
                return False
            while self._nbytes + conversation.nbytes > self.max_bytes:
                _, dropped = self._kept.popitem(last=False)
                self._nbytes -= dropped.nbytes
            self._kept[self._next_key] = conversation
            self._next_key += 1
            self._nbytes += conversation.nbytes
            return True

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()
            self._nbytes = 0
