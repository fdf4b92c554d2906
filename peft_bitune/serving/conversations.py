"""The kept conversations of a chat server: each one's mixed cache, keyed by exactly what that cache stands for.

A kept conversation remembers the rendered text of the conversation so far (the chat template's rendering of the
earlier messages, plus the answer as generated, special tokens included) and the token ids the cache holds (the
previous `generate` output sequence). A later request continues it only if its own rendered prompt starts with exactly
that text; anything else (an edited or reordered history, a changed system message, an answer the client altered)
gets a full prefill. The store never guesses and never continues a cache from a history it does not hold.

Kept caches are bounded by a memory budget in bytes; the least recently used are dropped first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from ..caches import BituneCache


@dataclass
class KeptConversation:
    """
    One conversation whose cache the server keeps.

    Args:
        text (`str`): the rendered conversation the cache stands for (prompt text, then the answer as decoded with
            its special tokens).
        token_ids (`list[int]`): the token ids of that conversation as `generate` saw and produced them (the output
            sequence); the cache holds all of them but the last generated one, which the next turn feeds first.
        cache (`BituneCache`): the conversation's mixed cache.
    """

    text: str
    token_ids: list[int]
    cache: BituneCache
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        if self.cache.conversation_length != len(self.token_ids):
            raise ValueError(
                f"The cache stands for {self.cache.conversation_length} tokens but `token_ids` has "
                f"{len(self.token_ids)}."
            )
        self.nbytes = cache_nbytes(self.cache)


def cache_nbytes(cache: BituneCache) -> int:
    """Bytes held by a cache's keys and values."""
    total = 0
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
    return total


class ConversationStore:
    """
    Kept conversations under a memory budget, least recently used dropped first.

    `take` hands a kept conversation over to the request that continues it (it leaves the store: `generate` extends
    the cache in place, and the result is kept again as a new, longer conversation). A conversation that is never
    continued stays until the budget needs its room.

    Args:
        max_bytes (`int`): the budget for all kept caches together; 0 keeps nothing (every request is a full prefill).
    """

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

    def take(self, prompt_text: str) -> KeptConversation | None:
        """Remove and return the longest kept conversation whose text `prompt_text` extends (strictly), if any."""
        with self._lock:
            best_key, best = None, None
            for key, kept in self._kept.items():
                if len(kept.text) < len(prompt_text) and prompt_text.startswith(kept.text):
                    if best is None or len(kept.text) > len(best.text):
                        best_key, best = key, kept
            if best_key is not None:
                del self._kept[best_key]
                self._nbytes -= best.nbytes
            return best

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
