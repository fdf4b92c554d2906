"""A request's conversation as the model reads it: its token ids, and where each instruction and answer is.

The server must read a conversation exactly as the adapter was trained to (`BituneConfig.multi_turn`), whatever it
happens to keep, so that the same request always gets the same answer:

- `"alternating"`: the training forward's `ConversationLayout`. Each answer of the assistant is a causal segment, and
  each run of other tokens before an answer (system and user messages, the template's headers and separators) is an
  instruction segment, read twice and mixed. The conversation is tokenized as one text, as TRL tokenizes a training
  conversation, and the answers are found from the chat template, as TRL's `assistant_only_loss` finds them: by the
  template's `{% generation %}` markers if it has them, otherwise by rendering the conversation up to each answer.
- `"history"`: the whole conversation is one instruction (the paper's whole-history scheme).

Without markers, an answer is what the model would have generated for it: the rendered assistant message from where
the generation prompt ends through its content, and the end-of-sequence token if the template writes one right after
(the template's separators after that belong to the next instruction).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from trl.chat_template_utils import get_training_chat_template, has_generation_markers

from ..constants import MultiTurnMode

PROBE_CONVERSATION = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]


class PromptLayoutError(ValueError):
    """The chat template does not let the server find where the assistant's answers are."""


@dataclass(frozen=True)
class Prompt:
    """
    A conversation's token ids and its segments, in the order Bitune reads them.

    Args:
        token_ids (`list[int]`): the rendered conversation, ending with the generation prompt, tokenized as one text.
        segment_ends (`tuple[int, ...]`): where each segment ends; segments alternate, instruction first (even
            indices instructions, odd indices answers), and the last one ends at `len(token_ids)`.
    """

    token_ids: list[int]
    segment_ends: tuple[int, ...]

    def __post_init__(self) -> None:
        ends = self.segment_ends
        if not ends or ends[-1] != len(self.token_ids) or any(b <= a for a, b in zip((0, *ends), ends)):
            raise ValueError(f"Segment ends {ends} do not split {len(self.token_ids)} tokens into non-empty segments.")

    def __len__(self) -> int:
        return len(self.token_ids)

    def segments(self) -> Iterator[tuple[int, int, bool]]:
        """(start, end, is_answer) of every segment, in order."""
        start = 0
        for number, end in enumerate(self.segment_ends):
            yield start, end, number % 2 == 1
            start = end

    def followed_by_answer(self, answer_ids: list[int]) -> Prompt:
        """This conversation with an answer after it: a new answer segment (or the last one continued, where the
        prompt already ends in one)."""
        if not answer_ids:
            return self
        ends_in_answer = len(self.segment_ends) % 2 == 0
        ends = self.segment_ends[:-1] if ends_in_answer else self.segment_ends
        return Prompt(self.token_ids + list(answer_ids), (*ends, len(self.token_ids) + len(answer_ids)))

    def answer_mask(self) -> list[bool]:
        """True on every answer token."""
        return [is_answer for start, end, is_answer in self.segments() for _ in range(start, end)]


class PromptBuilder:
    """
    Renders conversations with the chat template training used and lays them out for the adapter's multi-turn scheme.

    Args:
        tokenizer: the model's tokenizer; laying out alternating turns needs a fast one (character offsets).
        chat_template (`str`, *optional*): a Jinja chat template overriding the tokenizer's own. Where TRL's
            `SFTTrainer` would swap in its training template for it (`training_chat_template`), that one is used.
        multi_turn (`str`): the adapter's `multi_turn`, `"alternating"` or `"history"`.
        eos_texts (`list[str]`): the texts of the end-of-sequence tokens, which end an answer when the template writes
            one right after the content.
    """

    def __init__(self, tokenizer: Any, chat_template: str | None, multi_turn: MultiTurnMode, eos_texts: list[str]):
        self.tokenizer = tokenizer
        self.multi_turn = multi_turn
        self.eos_texts = [text for text in eos_texts if text]
        template = chat_template if chat_template is not None else tokenizer.chat_template
        # The template TRL renders training conversations with in its place, or None where training uses `template`.
        self.training_template = training_chat_template(tokenizer, chat_template)
        self.chat_template = self.training_template if self.training_template is not None else chat_template
        self.has_generation_markers = self.training_template is not None or (
            template is not None and has_generation_markers(template)
        )

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def build(self, messages: list[dict]) -> Prompt:
        """The conversation's prompt. Raises jinja2's `TemplateError` if the template refuses the messages, and
        `PromptLayoutError` if the answers cannot be found in its rendering."""
        if self.multi_turn == "history" or not any(message["role"] == "assistant" for message in messages):
            token_ids = self._tokenize(self.render(messages))
            return Prompt(token_ids, (len(token_ids),))
        if self.has_generation_markers:
            encoded = self.tokenizer.apply_chat_template(
                messages, chat_template=self.chat_template, add_generation_prompt=True, tokenize=True,
                return_dict=True, return_assistant_tokens_mask=True,
            )
            return _from_answer_mask(list(encoded["input_ids"]), [bool(m) for m in encoded["assistant_masks"]])
        # Hand-written: TRL's training templates and transformers' assistant mask were considered, but both read
        # answers from markers only, and TRL adds markers only to the templates it knows by their exact text.
        text = self.render(messages)
        spans = self._answer_spans(messages, text)
        try:
            encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError as error:
            raise PromptLayoutError(
                "Laying out an alternating conversation needs the character offsets of a fast tokenizer "
                f"(tokenizer.json); this tokenizer has none ({error})."
            ) from error
        return _from_answer_mask(list(encoded["input_ids"]), _overlapping(encoded["offset_mapping"], spans))

    def check(self) -> None:
        """Compile and render the template once, on a plain three-message conversation, and lay it out: raises
        `TemplateError` or `PromptLayoutError` (a server refuses to start rather than answer every request with an
        error)."""
        prompt = self.build(PROBE_CONVERSATION)
        if self.multi_turn == "alternating" and len(prompt.segment_ends) != 3:
            raise PromptLayoutError(
                f"The chat template's rendering of {PROBE_CONVERSATION} has {len(prompt.segment_ends) // 2} answers "
                "where the assistant wrote one."
            )

    def _tokenize(self, text: str) -> list[int]:
        # The template writes the special tokens (e.g. BOS) itself, as in transformers' `apply_chat_template`.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _answer_spans(self, messages: list[dict], text: str) -> list[tuple[int, int]]:
        """
        The character span of each answer in `text` (the whole conversation, rendered once), in time linear in the
        conversation: each message is rendered in a window of a few messages (`_window`), and the pieces must tile
        `text` exactly, or the template's rendering of a message depends on more than its window and the request is
        refused (`PromptLayoutError`, which asks for `{% generation %}` markers).

        An answer is what the assistant's message adds after the generation prompt, through its content and the
        end-of-sequence token if the template writes one right after (`_content_end`). An assistant message that
        opens the conversation is an answer too (as TRL's assistant mask and the training forward read it), starting
        where the template writes its content, if the generation prompt is written right before it.
        """
        rendered: dict[tuple[tuple[int, ...], bool], str] = {}

        def render(indices: tuple[int, ...], add_generation_prompt: bool) -> str:
            key = (indices, add_generation_prompt)
            if key not in rendered:
                rendered[key] = self.render([messages[i] for i in indices], add_generation_prompt)
            return rendered[key]

        spans, cursor = [], 0  # `cursor`: where the next message's rendering starts in `text`
        for k, message in enumerate(messages):
            before, through = _window(k, len(messages))
            earlier = render(before, False) if before else ""
            written = render(through, False)
            if k == 0:
                piece_start = 0  # the first message's rendering includes what the template writes first (e.g. BOS)
            elif not written.startswith(earlier):
                raise self._hidden(k)
            else:
                piece_start = len(earlier)
            piece = written[piece_start:]
            if not text.startswith(piece, cursor):
                raise self._hidden(k)
            if message["role"] == "assistant":
                start = self._answer_start(message, written, earlier, before, render, k)
                end = self._content_end(written[start:], message["content"])
                if end is None:
                    raise PromptLayoutError(
                        f"The chat template does not write the content of messages[{k}] (an assistant answer) as "
                        "given, so the server cannot tell where the answer is. " + _MARKERS_HINT
                    )
                if end > 0:
                    spans.append((cursor - piece_start + start, cursor - piece_start + start + end))
            cursor += len(piece)
        before, _ = _window(len(messages), len(messages))
        generation_prompt = render(before, True)[len(render(before, False)) :]
        if text[cursor:] != generation_prompt:
            raise self._hidden(len(messages))
        return spans

    def _answer_start(self, message: dict, written: str, earlier: str, before: tuple[int, ...], render: Any,
                      k: int) -> int:
        """Where the answer of assistant message `k` starts in `written` (its window's rendering through it): after
        the generation prompt that the window before it ends with; for a first message, where its content is
        written, if the generation prompt is written right before it."""
        if before:
            prompted = render(before, True)
            if not (prompted.startswith(earlier) and written.startswith(prompted)):
                raise self._hidden(k)
            return len(prompted)
        generation_prompt = self.generation_prompt()
        prompted_at = written.find(generation_prompt + message["content"])
        if prompted_at < 0:
            raise PromptLayoutError(
                "The conversation opens with an assistant message, and the chat template does not write the "
                f"generation prompt ({generation_prompt!r}) right before its content, so the server cannot tell where "
                "that answer starts as training would read it. Start the conversation with a system or user message, "
                "or " + _MARKERS_HINT[0].lower() + _MARKERS_HINT[1:]
            )
        return prompted_at + len(generation_prompt)

    def generation_prompt(self) -> str:
        """What the template writes to prompt an answer (after the probe conversation)."""
        return self.render(PROBE_CONVERSATION, True)[len(self.render(PROBE_CONVERSATION, False)) :]

    def _hidden(self, k: int) -> PromptLayoutError:
        return PromptLayoutError(
            f"The chat template renders messages[{k}] differently depending on the messages around it (not only the "
            f"first {WINDOW_ANCHOR} and the message itself), so the server cannot tell where the answers are without "
            "rendering the conversation once per answer. " + _MARKERS_HINT
        )

    def _content_end(self, written: str, content: str) -> int | None:
        """Where the answer ends in the assistant's rendered message: after its content (the last place it is
        written, preferring one followed by an end-of-sequence token), and after that token if there is one."""
        places, place = [], written.find(content)
        while place >= 0:
            places.append(place)
            place = written.find(content, place + 1)
        if not places:
            return None
        for place in reversed(places):
            end = place + len(content)
            eos = next((e for e in self.eos_texts if written.startswith(e, end)), None)
            if eos is not None:
                return end + len(eos)
        return places[-1] + len(content)


def training_chat_template(tokenizer: Any, chat_template: str | None) -> str | None:
    """
    The chat template TRL's `SFTTrainer` (`assistant_only_loss=True`, the only way Bitune trains conversations)
    renders conversations with in place of `chat_template` (the tokenizer's own if None): TRL's training template, with
    `{% generation %}` markers, for a template without markers that TRL knows; None for a template with markers (used
    as it is) or one TRL does not know (`SFTTrainer` refuses to train on conversations with it).
    """
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if template is None or has_generation_markers(template):
        return None
    from jinja2 import TemplateError  # chat templates need jinja2 (the `serve` extra)

    if chat_template is not None and chat_template != tokenizer.chat_template:
        # TRL reads the template from the tokenizer (`--chat-template` is what training set there): a copy holds it.
        tokenizer = copy.copy(tokenizer)
        tokenizer.chat_template = chat_template
    try:
        return get_training_chat_template(tokenizer)
    except (ValueError, TypeError, TemplateError):
        # ValueError: not a template TRL knows. The others come from TRL's checks, which render it with a tool call
        # first: `SFTTrainer` fails on them too, so training had no TRL template (`check` reports a broken one).
        return None


# How the answers are found without markers: every message is rendered after the first `WINDOW_ANCHOR` messages (a
# system message and the first turn, which templates often write specially) and at most one message before it, so
# that a window keeps the parity of the message's position (templates that check roles alternate count on it).
WINDOW_ANCHOR = 2
_MARKERS_HINT = (
    "Mark the assistant's part of the template with {% generation %} ... {% endgeneration %} (as TRL's "
    "assistant_only_loss needs)."
)


def _window(k: int, count: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The messages rendered before message `k` and through it (indices): the whole prefix for the first
    `WINDOW_ANCHOR` messages, then the anchor and the messages from an index of the same parity as the anchor's end."""
    if k <= WINDOW_ANCHOR:
        return tuple(range(k)), tuple(range(min(k + 1, count)))
    first = k - (k - WINDOW_ANCHOR) % 2
    anchor = tuple(range(WINDOW_ANCHOR))
    return anchor + tuple(range(first, k)), anchor + tuple(range(first, min(k + 1, count)))


def _overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """True on every token that overlaps a span (transformers' rule for `return_assistant_tokens_mask`)."""
    mask, span = [], 0
    for start, end in offsets:
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        mask.append(span < len(spans) and end > spans[span][0])
    return mask


def _from_answer_mask(token_ids: list[int], is_answer: list[bool]) -> Prompt:
    """Segments from a per-token answer mask. A conversation whose first token is an answer token is refused, as
    training refuses such a row: Bitune reads an instruction before every answer."""
    if is_answer and is_answer[0]:
        raise PromptLayoutError(
            "The conversation opens with an assistant answer that the chat template writes before any other token, "
            "so there is no instruction before it to read twice (training refuses such a row). Start the "
            "conversation with a system or user message."
        )
    ends = [i for i in range(1, len(is_answer)) if is_answer[i] != is_answer[i - 1]]
    return Prompt(token_ids, (*ends, len(token_ids)))
