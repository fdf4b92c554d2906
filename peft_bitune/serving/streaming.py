"""Streaming an answer while `generate` runs (transformers' public streamer protocol, `put`/`end`): its text piece by
piece (`TextStream`), each row of a batch to its own client (`RowStreams`), and stop strings by one rule, so that a
stream ends exactly where the whole answer is cut (`StopTextFilter`, `StopStrings`, `cut_at_stop`). Each searches
only the new text and the tail held back, so each piece costs time bounded by the stop strings' capped lengths, and
they keep nothing beyond their request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers.decoders import DecodeStream
from transformers.generation.streamers import BaseStreamer

REPLACEMENT_CHARACTER = "\ufffd"


def answer_text(tokenizer: Any, token_ids: list[int]) -> str:
    """An answer's whole text, decoded exactly as `IncrementalDecoder` streams it, special tokens skipped: by the
    Rust tokenizer itself, since `DecodeStream` never applies transformers' `clean_up_tokenization_spaces`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return (tokenizer if backend is None else backend).decode(token_ids, skip_special_tokens=True)


def incremental_decoder(tokenizer: Any) -> IncrementalDecoder | WindowDecoder:
    """The incremental decoder of `tokenizer`: `DecodeStream` over its Rust tokenizer, or `WindowDecoder` for one
    that has none."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # No Rust tokenizer (a Python or mistral-common one): a fallback, not a refusal, as such models are served today.
    return WindowDecoder(tokenizer) if backend is None else IncrementalDecoder(backend)


class IncrementalDecoder:
    """Decodes token ids into text as they come, with tokenizers' `DecodeStream` over the Rust tokenizer `backend`
    (TGI's incremental detokenization): a token that completes a character only with the next one waits for it, each
    token costs the same however long the answer grows, and the pieces add up to `answer_text`."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.stream = DecodeStream(skip_special_tokens=True)

    def add(self, token_ids: list[int]) -> str:
        """The text the new tokens complete ("" while they complete nothing yet)."""
        return "".join(self._step(token_id) for token_id in token_ids)

    def _step(self, token_id: int) -> str:
        try:
            return self.stream.step(self.backend, token_id) or ""
        except Exception as error:  # tokenizers raises a bare Exception
            if "Invalid prefix" not in str(error):
                raise
        # A byte-fallback decoder merged bytes that are no UTF-8 with text already handed out, which no piece can take
        # back: the stream goes on from this token, parted from the whole answer's decoding from here on.
        self.stream = DecodeStream(skip_special_tokens=True)
        return self.stream.step(self.backend, token_id) or ""


# By hand: DecodeStream needs a Rust tokenizer, and transformers' TextStreamer re-decodes all the text at each token.
class WindowDecoder:
    """
    `IncrementalDecoder` for a tokenizer without a Rust backend: each new piece is the decoding of a small window of
    the latest tokens minus the decoding of that window without the newest ones, as `DecodeStream` does.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []  # the window, from the start of the text handed out before the last piece
        self._read_end = 0  # the window's text up to here has been handed out

    def add(self, token_ids: list[int]) -> str:
        """The text the new tokens complete ("" while they complete nothing yet)."""
        self.token_ids.extend(token_ids)
        sent = self._decode(self.token_ids[: self._read_end])
        text = self._decode(self.token_ids)
        if len(text) > len(sent) and not text.endswith(REPLACEMENT_CHARACTER):
            self.token_ids = self.token_ids[self._read_end :]
            self._read_end = len(self.token_ids)
            return text[len(sent) :]
        return ""

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if token_ids else ""


class TextStream(BaseStreamer):
    """Decodes the tokens `generate` produces into text, incrementally (`incremental_decoder`), and calls `on_text`
    with each new piece, on the thread that runs `generate`. The first `put` holds the prompt and is skipped."""

    def __init__(self, tokenizer: Any, on_text: Callable[[str], None]) -> None:
        self.decoder = incremental_decoder(tokenizer)
        self.on_text = on_text
        self._prompt_skipped = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_skipped:
            self._prompt_skipped = True
            return
        if piece := self.decoder.add(value.flatten().tolist()):
            self.on_text(piece)

    def end(self) -> None:
        """Nothing to flush: text still held back (an incomplete character) is in the whole answer's decoding,
        which the caller sends after the stream (see `app.py`)."""


@dataclass(eq=False)
class RowStreams(BaseStreamer):
    """The streamer of a batch: row i's prompt and then its tokens go to `streams[i]` (None: a row nobody streams), up
    to and including the token that ended the row (`ended(i)`: `RowStops`, which runs after each token is streamed);
    the padding `generate` feeds a row after it ended is not streamed."""

    streams: list[BaseStreamer | None]
    ended: Callable[[int], bool]

    def put(self, value: torch.Tensor) -> None:
        for row, stream in enumerate(self.streams):
            if stream is not None and not self.ended(row):
                stream.put(value[row : row + 1])

    def end(self) -> None:
        for stream in self.streams:
            if stream is not None:
                stream.end()


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """`text` up to the first stop string (OpenAI returns the answer without it), and whether one was found: the
    earliest start of any stop string's first occurrence."""
    search = StopTextFilter(stop)
    before = search.feed(text)
    return (before, True) if search.stopped else (text, False)


class StopTextFilter:
    """Streams text that cannot be the start of a stop string, so that a stream ends exactly where the whole answer is
    cut (`cut_at_stop`): the tail that might begin one is held back until it is decided. Each piece is searched with
    that tail only, so its cost is bounded by the piece and the stop strings (at most 4 of 512 characters,
    `validation.py`), as vLLM searches the decoded tail."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped or not text:
            return ""
        self.pending += text  # `pending` held no whole stop string: any occurrence now takes some of `text`
        cut = min((i for i in (self.pending.find(s) for s in self.stop) if i >= 0), default=None)
        if cut is not None:
            self.stopped = True
            ready, self.pending = self.pending[:cut], ""
            return ready
        held = max((_begun(self.pending, s) for s in self.stop), default=0)
        ready, self.pending = self.pending[: len(self.pending) - held], self.pending[len(self.pending) - held :]
        return ready

    def flush(self) -> str:
        ready, self.pending = ("" if self.stopped else self.pending), ""
        return ready


def _begun(text: str, stop: str) -> int:
    """The length of the longest end of `text` that begins `stop` (shorter than `stop`): tried from the earliest
    place within `len(stop) - 1` characters of the end where the stop string's first character is."""
    place = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while place >= 0:
        if stop.startswith(text[place:]):
            return len(text) - place
        place = text.find(stop[0], place + 1)
    return 0


class StopStrings:
    """Whether a row's answer has reached one of its stop strings, checked on the text as it is decoded, by the rule
    of the stream and `cut_at_stop`, in time bounded per token and keeping nothing beyond the row. (transformers'
    `StopStringCriteria` builds a table of about 4 KB per stop character for each tokenizer and stop strings, and
    keeps the last 8 for the whole process: distinct stop strings would make the server's memory grow.)"""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.decoder = incremental_decoder(tokenizer)
        self.text = StopTextFilter(stop)

    def add(self, token_id: int) -> bool:
        """Feed the row's newest token; True once the answer holds a stop string."""
        if piece := self.decoder.add([token_id]):
            self.text.feed(piece)
        return self.text.stopped
