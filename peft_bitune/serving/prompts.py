"""A request's conversation as the model reads it: its token ids, and where each instruction and answer is.

The server must read a conversation exactly as the adapter was trained to (`BituneConfig.multi_turn`), whatever it
happens to keep, so that the same request always gets the same answer:

- `"alternating"`: the training forward's `ConversationLayout`. Each answer of the assistant is a causal segment, and
  each run of other tokens before an answer (system and user messages, the template's headers and separators) is an
  instruction segment, read twice and mixed. The conversation is tokenized as one text, as TRL tokenizes a training
  conversation, and the answers are the tokens TRL's `assistant_only_loss` trains: those inside the template's
  `{% generation %}` markers, or inside the markers of TRL's training template for a template TRL knows. TRL trains
  no conversation on a template with neither, so the server refuses it.
- `"history"`: the whole conversation is one instruction (the paper's whole-history scheme).
"""

from __future__ import annotations

import copy
import itertools
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
    """A conversation's token ids (rendered, ending with the generation prompt, tokenized as one text) and where each
    of its segments ends, in the order Bitune reads them: instruction first (even indices instructions, odd indices
    answers), the last one ending at `len(token_ids)`."""

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
        return zip((0, *self.segment_ends[:-1]), self.segment_ends, itertools.cycle((False, True)))

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
    """Renders conversations with the chat template training used (`chat_template` overrides the tokenizer's own;
    where TRL's `SFTTrainer` would swap in its training template, `training_chat_template`, that one) and lays them
    out for the adapter's `multi_turn`. An alternating adapter needs a template with `{% generation %}` markers, or
    one TRL adds them to: another raises `PromptLayoutError`."""

    def __init__(self, tokenizer: Any, chat_template: str | None, multi_turn: MultiTurnMode):
        self.tokenizer = tokenizer
        self.multi_turn = multi_turn
        self.chat_template = chat_template
        template = chat_template if chat_template is not None else tokenizer.chat_template
        if template is not None and not has_generation_markers(template):
            try:
                self.chat_template = training_chat_template(tokenizer, chat_template)
            except PromptLayoutError:
                # A history adapter reads no answers: it renders with the template as it is (as TRL renders
                # prompt-completion rows, the only conversations it trains without markers).
                if multi_turn == "alternating":
                    self.render(PROBE_CONVERSATION)  # a template that does not render at all says that first
                    raise

    def render(self, messages: list[dict]) -> str:
        """The conversation as text, ending with the generation prompt."""
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, add_generation_prompt=True, tokenize=False
        )

    def build(self, messages: list[dict]) -> Prompt:
        """The conversation's prompt. Raises jinja2's `TemplateError` if the template refuses the messages, and
        `PromptLayoutError` if it opens with an answer (training refuses such a row)."""
        if self.multi_turn == "history" or not any(message["role"] == "assistant" for message in messages):
            # The template writes the special tokens (e.g. BOS) itself, as in transformers' `apply_chat_template`.
            token_ids = self.tokenizer(self.render(messages), add_special_tokens=False)["input_ids"]
            return Prompt(token_ids, (len(token_ids),))
        encoded = self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, add_generation_prompt=True, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True,
        )
        return _from_answer_mask(list(encoded["input_ids"]), [bool(m) for m in encoded["assistant_masks"]])

    def check(self) -> None:
        """Lay out a plain three-message conversation once: raises `TemplateError` or `PromptLayoutError` (see
        `checked_prompt_builder`)."""
        prompt = self.build(PROBE_CONVERSATION)
        if self.multi_turn == "alternating" and len(prompt.segment_ends) != 3:
            raise PromptLayoutError(
                f"The chat template's rendering of {PROBE_CONVERSATION} has {len(prompt.segment_ends) // 2} answers "
                "where the assistant wrote one."
            )


def checked_prompt_builder(
    tokenizer: Any, chat_template: str | None, multi_turn: MultiTurnMode, where: str = "The chat template"
) -> PromptBuilder:
    """A `PromptBuilder` whose template (`where`, for messages) was compiled, rendered once on a plain conversation and
    laid out, so that a template that is missing, broken, or that training could not have used stops the server at
    startup (`ValueError`, saying what to do) rather than failing every request."""
    from jinja2 import TemplateError  # chat templates need jinja2 (the `serve` extra)

    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("The tokenizer has no chat template, so conversations cannot be rendered. Pass one with "
                         "`--chat-template <file>` (a Jinja template, e.g. the one your adapter was trained with).")
    try:
        builder = PromptBuilder(tokenizer, chat_template, multi_turn)
        builder.check()
    except TemplateError as error:
        line = f" (line {error.lineno})" if getattr(error, "lineno", None) else ""
        raise ValueError(f"{where} fails on a plain conversation: {type(error).__name__}: {str(error).rstrip('.')}"
                         f"{line}. Fix the template.") from error
    except PromptLayoutError as error:
        raise ValueError(f"{where} cannot be used with this adapter (multi_turn={multi_turn!r}): {error}") from error
    return builder


def training_chat_template(tokenizer: Any, chat_template: str | None) -> str:
    """The chat template TRL's `SFTTrainer` (`assistant_only_loss=True`, the only way Bitune trains conversations)
    renders with in place of `chat_template` (the tokenizer's own if None), which has no `{% generation %}` markers:
    TRL's training template, with markers. Raises `PromptLayoutError` with TRL's reason for a template TRL does not
    know (`SFTTrainer` refuses to train on conversations with it)."""
    from jinja2 import TemplateError  # chat templates need jinja2 (the `serve` extra)

    if chat_template is not None and chat_template != tokenizer.chat_template:
        # TRL reads the template from the tokenizer (`--chat-template` is what training set there): a copy holds it.
        tokenizer = copy.copy(tokenizer)
        tokenizer.chat_template = chat_template
    try:
        return get_training_chat_template(tokenizer)
    except (ValueError, TypeError, TemplateError) as error:
        # ValueError: not a template TRL knows. The others come from TRL's checks, which render it with a tool call
        # first: `SFTTrainer` fails on them too.
        raise PromptLayoutError(
            "The chat template has no {% generation %} markers, so TRL's SFTTrainer cannot train conversations on it "
            f"(assistant_only_loss=True) and the server cannot find the answers as training does. TRL: {error} "
            "Mark what the assistant writes, its content and the end-of-sequence token after it, with "
            "{% generation %} ... {% endgeneration %} (as examples/miniature/chat_template.jinja does), and train "
            "and serve with that template (an adapter trained with multi_turn='history' needs no markers)."
        ) from error


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
