"""The streamed text of an answer, piece by piece (tokenizers' `DecodeStream`, or the window decoder of a tokenizer
without a Rust backend): whole characters only, adding up to the whole answer's decoding, and its stop strings found
where `cut_at_stop` finds them in that decoding."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models
from tokenizers.decoders import DecodeStream

from peft_bitune.serving.streaming import IncrementalDecoder, StopStrings, answer_text, cut_at_stop
from serving_helpers import streamed_pieces

# Emoji (4 bytes of UTF-8) and CJK (3 bytes), which the miniature's byte-level BPE splits over several tokens.
MULTI_BYTE = "Bonjour 😀 世界 </s>— ok 🎉日本語!"
WHOLE_CHARACTERS = "😀世界—🎉日本語"


class PythonOnlyTokenizer:
    """A tokenizer with `decode` and no Rust backend (`backend_tokenizer`), as a Python or mistral-common one."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


@pytest.fixture(scope="module")
def multi_byte_ids(serving_tokenizer) -> list[int]:
    token_ids = serving_tokenizer(MULTI_BYTE, add_special_tokens=False)["input_ids"]
    split = [token for token in token_ids if "\ufffd" in serving_tokenizer.decode([token])]
    assert len(split) >= 6, "the text must have characters split over byte-level tokens"
    assert serving_tokenizer.eos_token_id in token_ids  # a special token in the middle, skipped
    return token_ids


def test_multi_byte_characters_are_streamed_whole_and_add_up_to_the_whole_answer(serving_tokenizer, multi_byte_ids):
    pieces = streamed_pieces(serving_tokenizer, multi_byte_ids)
    whole = serving_tokenizer.decode(multi_byte_ids, skip_special_tokens=True)
    assert "".join(pieces) == whole == answer_text(serving_tokenizer, multi_byte_ids)
    assert not any("\ufffd" in piece for piece in pieces), pieces  # no piece ends inside a character
    assert all(any(char in piece for piece in pieces) for char in WHOLE_CHARACTERS), pieces
    assert len(pieces) > 10  # piece by piece, not at the end


def test_a_tokenizer_without_a_rust_backend_streams_the_same_pieces(serving_tokenizer, multi_byte_ids):
    python_only = PythonOnlyTokenizer(serving_tokenizer)
    assert not hasattr(python_only, "backend_tokenizer")
    assert streamed_pieces(python_only, multi_byte_ids) == streamed_pieces(serving_tokenizer, multi_byte_ids)
    assert answer_text(python_only, multi_byte_ids) == answer_text(serving_tokenizer, multi_byte_ids)


@pytest.mark.parametrize("stop", ["界", "🎉日", " ok", "語!", "not in it"])
def test_a_row_stops_at_the_token_that_completes_its_stop_string(serving_tokenizer, multi_byte_ids, stop):
    """`StopStrings` (a row of a batch) ends at the first token whose decoding so far holds the stop string, and
    `cut_at_stop` cuts the whole answer just before it."""
    for python_only in (False, True):
        tokenizer = PythonOnlyTokenizer(serving_tokenizer) if python_only else serving_tokenizer
        stops = StopStrings(tokenizer, [stop])
        stopped_at = next((n for n, token in enumerate(multi_byte_ids, 1) if stops.add(token)), None)
        expected = next((n for n in range(1, len(multi_byte_ids) + 1)
                         if stop in answer_text(serving_tokenizer, multi_byte_ids[:n])), None)
        assert stopped_at == expected, (stop, python_only)
    whole = answer_text(serving_tokenizer, multi_byte_ids)
    assert cut_at_stop(whole, [stop]) == ((whole[: whole.index(stop)], True) if stop in whole else (whole, False))


def test_bytes_that_are_no_utf8_do_not_end_a_byte_fallback_stream():
    """A byte-fallback decoder (Llama 2's, Mistral's) writes a run of byte tokens that is no UTF-8 as U+FFFD, taking in
    text already handed out, and `DecodeStream` raises "Invalid prefix"; the stream goes on from that token."""
    vocab = {"<unk>": 0, **{f"<0x{byte:02X}>": 1 + byte for byte in range(256)}, "▁": 257, "a": 258, "b": 259,
             "▁a": 260, "▁b": 261}
    tokenizer = Tokenizer(models.BPE(vocab, [("▁", "a"), ("▁", "b")], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    byte = lambda value: vocab[f"<0x{value:02X}>"]  # noqa: E731
    token_ids = [vocab["▁a"], byte(0x20), byte(0xC3), byte(0xBB), byte(0x80), vocab["b"], vocab["▁a"], vocab["▁b"]]
    raw = DecodeStream(skip_special_tokens=True)
    with pytest.raises(Exception, match="Invalid prefix"):
        for token in token_ids:
            raw.step(tokenizer, token)
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.add([token]) for token in token_ids]
    assert pieces[:5] == ["a", " ", "", "û", ""]  # " û" is streamed before 0x80 makes it no UTF-8
    assert "".join(pieces[5:]) == tokenizer.decode(token_ids[5:]) == "b a b"
