"""Streaming an answer while `generate` runs: its text piece by piece, each row of a batch to its own client, and
stop strings.

`TextStream` is a transformers streamer (the public `put`/`end` protocol of `generate(streamer=...)`): it decodes the
new tokens incrementally and hands each new piece of text to a callback. `RowStreams` is the streamer of a batch: it
hands each row's tokens to that row's `TextStream` until the row has ended (`batching.RowStops`). `StopTextFilter`
holds back text that may be the start of a stop string, so that a stream ends exactly where the whole answer is cut
(`cut_at_stop`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

REPLACEMENT_CHARACTER = "\ufffd"


class TextStream(BaseStreamer):
    """
    Decodes the tokens `generate` produces into text, incrementally, and calls `on_text` with each new piece.

    The first `put` holds the prompt and is skipped. Each piece is the decoding of a small window of the latest tokens
    minus the decoding of that window without the newest ones (the incremental detokenization of vLLM and TGI): a
    token that completes a character only with the next one (a byte of UTF-8, a word piece) waits for it, and the
    decoding costs the same at every token however long the answer grows.

    Args:
        tokenizer: the model's tokenizer (anything with `decode(ids, skip_special_tokens=...)`).
        on_text (`Callable[[str], None]`): called with each new piece of text, on the thread that runs `generate`.
    """

    def __init__(self, tokenizer: Any, on_text: Callable[[str], None]) -> None:
        self.tokenizer = tokenizer
        self.on_text = on_text
        self.token_ids: list[int] = []
        self._prompt_skipped = False
        self._prefix_start = 0  # the window starts here ...
        self._read_end = 0  # ... and its text up to here has been sent

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_skipped:
            self._prompt_skipped = True
            return
        self.token_ids.extend(value.flatten().tolist())
        sent = self._decode(self.token_ids[self._prefix_start : self._read_end])
        text = self._decode(self.token_ids[self._prefix_start :])
        if len(text) > len(sent) and not text.endswith(REPLACEMENT_CHARACTER):
            self._prefix_start, self._read_end = self._read_end, len(self.token_ids)
            self.on_text(text[len(sent) :])

    def end(self) -> None:
        """Nothing to flush: text still held back (an incomplete character) is in the whole answer's decoding,
        which the caller sends after the stream (see `app.py`)."""

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if token_ids else ""


class RowStreams(BaseStreamer):
    """
    The streamer of a batch: row i's prompt and then its tokens go to `streams[i]` (None: a row nobody streams), up to
    and including the token that ended the row; the padding `generate` feeds a row after it ended is not streamed.

    Args:
        streams (`list`): per row, a streamer (e.g. a `TextStream`) or None.
        ended (`Callable[[int], bool]`): whether row i has ended (`RowStops`, which runs after each token is streamed).
    """

    def __init__(self, streams: list[BaseStreamer | None], ended: Callable[[int], bool]) -> None:
        self.streams = streams
        self.ended = ended

    def put(self, value: torch.Tensor) -> None:
        for row, stream in enumerate(self.streams):
            if stream is not None and not self.ended(row):
                stream.put(value[row : row + 1])

    def end(self) -> None:
        for stream in self.streams:
            if stream is not None:
                stream.end()


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """`text` up to the first stop string (OpenAI returns the answer without it), and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


class StopTextFilter:
    """Streams text that cannot be the start of a stop string, so that a stream ends exactly where the whole answer
    is cut (`cut_at_stop`): the tail that might begin a stop string is held back until it is decided."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = stop
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        self.pending += text
        cut, hit = cut_at_stop(self.pending, self.stop)
        if hit:
            self.stopped = True
            self.pending = ""
            return cut
        held = max((n for s in self.stop for n in range(1, len(s)) if self.pending.endswith(s[:n])), default=0)
        ready, self.pending = self.pending[: len(self.pending) - held], self.pending[len(self.pending) - held :]
        return ready

    def flush(self) -> str:
        ready, self.pending = ("" if self.stopped else self.pending), ""
        return ready
