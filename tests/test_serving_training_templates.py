"""`bitune-serve` reads a conversation as `BituneSFTTrainer` trained on it when the chat template has no
`{% generation %}` markers but is one TRL knows: TRL's `SFTTrainer` (`assistant_only_loss=True`) swaps in its training
template, so the server renders with that template and takes the answers from its markers. Built offline: the
miniature tokenizer with a model family's special tokens and that family's chat template as TRL ships it."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the serving tests need the `serve` extra")

import trl.chat_template_utils as trl_templates  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import trl_helpers as helpers  # noqa: E402
from peft_bitune.constants import IGNORE_INDEX  # noqa: E402
from peft_bitune.serving.app import ChatCompletions  # noqa: E402
from peft_bitune.serving.engine import ChatEngine  # noqa: E402
from peft_bitune.serving.prompts import PromptBuilder  # noqa: E402
from serving_helpers import BASE, NAME, assistant, load_model, user  # noqa: E402
from trl_integration import BituneSFTTrainer  # noqa: E402

# Families whose templates TRL patches: Qwen2.5's training template adds markers only (the template alone is read
# otherwise: its answers start after the header's newline); Qwen3's also writes an empty thinking block into every
# earlier answer, which the template alone drops (it renders earlier answers depending on what follows them).
FAMILIES = {
    "qwen2_5": trl_templates.qwen2_5_chat_template,
    "qwen3": trl_templates.qwen3_chat_template,
}
QWEN_TOKENS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    user("Story: Ana has 2 hats. Bo has 5 hats.\nAsk: How many hats do they have?"),
    assistant("Answer: 7"),
    user("Ask: Are you sure?"),
    assistant("Answer: yes, 7"),
]


def family_tokenizer(chat_template: str | None):
    """The miniature tokenizer with Qwen's special tokens (one token each, `<|im_end|>` the EOS, as in Qwen's)."""
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = chat_template
    return tokenizer


def trained_row(tmp_path, tokenizer) -> tuple[list[int], list[bool], object]:
    """The conversation as `BituneSFTTrainer` tokenizes it for training (TRL's own data preparation), as token ids and
    which of them are supervised (answers), and the trainer's Bitune model."""
    from datasets import Dataset

    config = helpers.model_config()
    config.vocab_size, config.eos_token_id = len(tokenizer), tokenizer.eos_token_id
    config.max_position_embeddings = 512
    trainer = BituneSFTTrainer(
        model=AutoModelForCausalLM.from_config(config),
        args=helpers.training_args(tmp_path, assistant_only_loss=True),
        train_dataset=Dataset.from_list([{"messages": CONVERSATION}]),
        processing_class=tokenizer,
        peft_config=helpers.small_bitune_config(),
    )
    row = trainer.train_dataset[0]
    return list(row["input_ids"]), [label != IGNORE_INDEX for label in row["labels"]], trainer.model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_serving_finds_the_answers_training_supervised_for_a_template_trl_patches(tmp_path, serving_template, family):
    """The server's layout of the conversation (the trained row and a new user message after it) holds the trained
    row's tokens, with answer segments exactly on the tokens training supervised; the same with the template given
    as `--chat-template` over a tokenizer whose own template is another."""
    template = FAMILIES[family]
    tokenizer = family_tokenizer(template)
    assert not trl_templates.has_generation_markers(template)
    assert len(tokenizer("<|im_start|><|im_end|>", add_special_tokens=False)["input_ids"]) == 2
    token_ids, supervised, model = trained_row(tmp_path, tokenizer)
    assert any(supervised) and not supervised[0]

    requests = ChatCompletions(ChatEngine(model.eval(), tokenizer, None, 0), NAME)
    messages = [*CONVERSATION, user("Ask: Who has more hats?")]
    prompt = requests.chat_request({"model": NAME, "messages": messages, "max_tokens": 2}).prompt
    assert prompt.token_ids[: len(token_ids)] == token_ids
    assert prompt.answer_mask() == supervised + [False] * (len(prompt) - len(token_ids))
    answers = [tokenizer.decode(prompt.token_ids[s:e]) for s, e, is_answer in prompt.segments() if is_answer]
    assert len(answers) == 2 and all(a.rstrip("\n").endswith("<|im_end|>") for a in answers)
    assert answers[1].lstrip("\n").removeprefix("<think>\n\n</think>\n\n").startswith("Answer: yes, 7")

    overridden = PromptBuilder(family_tokenizer(serving_template), template, "alternating")
    assert overridden.build(messages) == prompt


def test_the_miniature_template_is_laid_out_as_training_supervises_it(tmp_path, serving_tokenizer, serving_template):
    """The miniature template marks what the assistant writes (its content and the EOS token), so TRL trains
    conversations on it as it is, and the server's answer segments are exactly the tokens training supervised."""
    assert trl_templates.has_generation_markers(serving_template)
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    tokenizer.chat_template = serving_template
    token_ids, supervised, model = trained_row(tmp_path, tokenizer)
    assert any(supervised) and not supervised[0]
    assert trl_templates.is_chat_template_stop_token_trained(tokenizer)
    requests = ChatCompletions(ChatEngine(model.eval(), serving_tokenizer, serving_template, 0), NAME)
    messages = [*CONVERSATION, user("Ask: Who has more hats?")]
    prompt = requests.chat_request({"model": NAME, "messages": messages, "max_tokens": 2}).prompt
    assert prompt.token_ids[: len(token_ids)] == token_ids
    assert prompt.answer_mask() == supervised + [False] * (len(prompt) - len(token_ids))


def test_a_template_without_markers_that_trl_cannot_patch_is_refused_for_an_alternating_adapter(
    serving_adapter, serving_tokenizer, serving_template
):
    """TRL's `SFTTrainer` refuses `assistant_only_loss` with such a template, so no alternating adapter was trained on
    conversations with it: the server refuses it at startup with TRL's reason and the fix. A history adapter reads a
    conversation as one instruction (as prompt-completion rows train it), which needs no markers."""
    unmarked = serving_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert not trl_templates.has_generation_markers(unmarked)
    with pytest.raises(ValueError, match="patching is not supported") as refused:
        ChatEngine(load_model(serving_adapter), serving_tokenizer, unmarked, 0)
    assert "{% generation %}" in str(refused.value) and "multi_turn" in str(refused.value)
    history = PromptBuilder(serving_tokenizer, unmarked, "history")
    history.check()
    assert history.chat_template == unmarked
