r"""
A multi-turn chat with a Bitune adapter that keeps the conversation in the key/value cache (paper, appendix A.8,
"alternating"): each turn reads only the new instruction (twice, causal and bidirectional weights, over the cache so
far, then mixes), and decodes the answer from there. Earlier turns are never read again.

    python examples/quickstart.py                  # trains the adapter this script loads by default (out/quickstart)
    python examples/chat.py                        # three held-out prompts of the embedded data, as three turns
    python examples/chat.py --turn "Story: Ana has 2 hats. Bo has 5 hats.\nAsk: How many hats do they have?\nAnswer:"
    python examples/chat.py --interactive          # type the turns (\n for a line break); an empty line ends

It runs offline on the embedded miniature model. For a real adapter, pass `--adapter` (a folder or Hub id; the base
model recorded in the adapter is loaded, or `--model_name_or_path`):

    python examples/quickstart.py --base smollm2 --output_dir out/smollm2-quickstart
    python examples/chat.py --adapter out/smollm2-quickstart --interactive

When the adapter's tokenizer has a chat template (a chat model such as SmolLM2), each turn is a user message: the
tokens appended for it are what the template adds to the conversation (the end of the previous assistant turn, the
user turn, the assistant's header), found by rendering the conversation before and after the turn. The quickstart's
adapter on the miniature carries examples/prompt_completion_template.jinja, which adds the turn's text as it is (after
the previous answer's EOS token). Without a template, turns are plain text, tokenized as TRL tokenizes prompts; the
first turn gets the tokenizer's special tokens (e.g. BOS), later ones are appended as they are.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

EXAMPLES_DIR = os.path.dirname(os.path.abspath(__file__))
MINIATURE_DATA = os.path.join(EXAMPLES_DIR, "miniature", "data")
DEFAULT_ADAPTER = os.path.join("out", "quickstart")
DEFAULT_TURNS = 3


@dataclass
class Turn:
    instruction: str
    answer: str
    instruction_ids: list[int]  # the tokens of the instruction as appended to the conversation
    answer_ids: list[int]  # the generated tokens, special tokens (e.g. the final EOS) included
    new_tokens: int  # tokens this turn read: the new instruction (and the previous answer's last token)
    cache_length: int  # positions in the cache after the turn: the whole conversation


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", default=DEFAULT_ADAPTER, help="The Bitune adapter: a folder or a Hub id.")
    parser.add_argument(
        "--model_name_or_path", default=None, help="Base model (default: the one the adapter records)."
    )
    parser.add_argument(
        "--turn", action="append", default=[],
        help="One turn's instruction (\\n for a line break); repeat for several.",
    )
    parser.add_argument("--interactive", action="store_true", help="Read the turns from the terminal.")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max_new_tokens must be at least 1, got {args.max_new_tokens}.")
    if args.interactive and args.turn:
        parser.error("Pass either --turn (scripted turns) or --interactive, not both.")
    if args.adapter == DEFAULT_ADAPTER and not os.path.isdir(DEFAULT_ADAPTER):
        parser.error(
            f"No adapter at {DEFAULT_ADAPTER}: train one first with `python examples/quickstart.py` (it saves there), "
            "or pass --adapter."
        )
    if not args.turn and not args.interactive and not os.path.isdir(MINIATURE_DATA):
        parser.error(f"The embedded data ({MINIATURE_DATA}) is missing, so there are no default turns: pass --turn.")
    return args


def load(adapter: str, model_name_or_path: str | None) -> tuple[Any, Any]:
    """The base model with the Bitune adapter, and the tokenizer saved with the adapter (else the base model's)."""
    from peft import AutoPeftModelForCausalLM, PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import peft_bitune  # noqa: F401  (registers the BITUNE adapter type; without it: KeyError: 'BITUNE')

    if model_name_or_path is None:
        model = AutoPeftModelForCausalLM.from_pretrained(adapter)
        model_name_or_path = PeftConfig.from_pretrained(adapter).base_model_name_or_path
    else:
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_name_or_path), adapter)
    try:
        tokenizer = AutoTokenizer.from_pretrained(adapter)
    except (OSError, ValueError):
        tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    return model.eval(), tokenizer


def chat(model: Any, tokenizer: Any, instructions: Iterable[str], max_new_tokens: int) -> Iterator[Turn]:
    """
    Answer each instruction in turn, continuing from the cache of the previous turn.

    `generate(..., return_dict_in_generate=True)` returns the sequences and the cache; the next call gets the whole
    conversation as `input_ids` (the previous output sequences, then the new instruction) and that cache as `cache`,
    and reads only what the cache does not hold yet.
    """
    import torch

    from peft_bitune import compat  # reads `output.cache`, or `output.past_key_values` before transformers 5.24

    output, messages = None, []
    generated = None  # the previous answer as the model generated it (special tokens included); none before turn 1
    for instruction in instructions:
        if tokenizer.chat_template:
            text = _chat_turn_text(tokenizer, messages, instruction, generated=generated)
            new = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        else:
            new = tokenizer(instruction, add_special_tokens=output is None, return_tensors="pt")["input_ids"]
        if new.shape[1] == 0:
            raise ValueError(f"The instruction {instruction!r} has no tokens.")
        new = new.to(model.device)
        if output is None:
            input_ids, cache, read = new, None, new.shape[1]
        else:
            input_ids, cache = torch.cat([output.sequences, new], dim=1), compat.output_cache(output)
            read = input_ids.shape[1] - cache.get_seq_length()
        output = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),  # one conversation: no padding anywhere
            cache=cache,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            return_dict_in_generate=True,
        )
        answer_ids = output.sequences[0, input_ids.shape[1] :]
        answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
        generated = tokenizer.decode(answer_ids)
        messages += [{"role": "user", "content": instruction}, {"role": "assistant", "content": answer}]
        held = compat.output_cache(output).get_seq_length()
        yield Turn(instruction, answer, new[0].tolist(), answer_ids.tolist(), read, held)


def _chat_turn_text(tokenizer: Any, messages: list[dict], instruction: str, generated: str | None) -> str:
    """
    The text a new user turn adds to a chat conversation, after what the model already generated.

    The template renders the earlier assistant answer followed by its own closing text (e.g. `<|im_end|>\n`); the
    model generated the answer and part of that closing text (its end-of-turn token, unless `max_new_tokens` cut it
    short). What is missing of the closing text, then the new user turn and the assistant's header, is the new part.
    """
    turn = {"role": "user", "content": instruction}
    if not messages:
        return tokenizer.apply_chat_template([turn], add_generation_prompt=True, tokenize=False)
    before = tokenizer.apply_chat_template(messages, tokenize=False)
    after = tokenizer.apply_chat_template([*messages, turn], add_generation_prompt=True, tokenize=False)
    answer = messages[-1]["content"]
    end = before.rfind(answer) + len(answer) if answer else len(before.rstrip())
    if not after.startswith(before) or end < len(answer):
        raise ValueError("The chat template does not render a conversation as the previous one plus the new turn, so "
                         "the cache cannot be continued; start a new conversation.")
    closing = before[end:]
    emitted = generated[generated.rfind(answer) + len(answer):] if answer and answer in generated else ""
    missing = closing[len(emitted):] if closing.startswith(emitted) else closing
    return missing + after[len(before):]


def default_turns(count: int) -> list[str]:
    """The first held-out prompts of the embedded data: the kind of instruction the quickstart adapter learned."""
    from datasets import load_dataset

    dataset = load_dataset(MINIATURE_DATA)
    split = next((name for name in ("test", "validation", "train") if name in dataset), None)
    if split is None:
        raise SystemExit(f"{MINIATURE_DATA} has no test, validation or train split; pass --turn.")
    return list(dataset[split].select(range(min(count, len(dataset[split]))))["prompt"])


def typed_turns() -> Iterator[str]:
    while True:
        try:
            line = input("\nyou> ")
        except EOFError:
            return
        if not line.strip():
            return
        yield line.replace("\\n", "\n")  # a typed \n is a line break


def main(argv: Sequence[str] | None = None) -> list[Turn]:
    args = parse_args(argv)
    model, tokenizer = load(args.adapter, args.model_name_or_path)
    typed = [turn.replace("\\n", "\n") for turn in args.turn]
    instructions = typed_turns() if args.interactive else (typed or default_turns(DEFAULT_TURNS))
    turns = []
    conversation = chat(model, tokenizer, instructions, args.max_new_tokens)
    while True:
        try:
            turn = next(conversation)
        except StopIteration:
            return turns
        except ValueError as error:
            if not args.interactive:
                raise
            print(f"The conversation cannot go on: {error}")  # e.g. longer than the model's positions
            return turns
        if not args.interactive:
            print(f"\n[turn {len(turns) + 1}] you> {turn.instruction}")
        print(f"bitune> {turn.answer}")
        print(f"        (read {turn.new_tokens} new tokens; the cache holds {turn.cache_length} positions)")
        turns.append(turn)


if __name__ == "__main__":
    main()
    sys.exit(0)
