"""The real-model path of the examples, end to end on a tiny stand-in: a Llama written as a GGUF file, converted by
examples/smollm2/load.py, trained by the quickstart on chat `messages` rows with SmolLM2's training chat template, and
chatted with over several turns (cache continued). Only the weights differ from `--base smollm2`."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from bitsandbytes_support import why_bitsandbytes_cannot_run
from test_smollm2_loader import write_tiny_llama_gguf

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# SmolLM2-135M-Instruct's own chat template, as its GGUF file carries it.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"real_path_{name.replace('/', '_')}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    gguf_path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_llama_gguf(gguf_path)
    return load_example("smollm2/load").converted_folder(gguf_path, tmp_path_factory.mktemp("cache"), "tiny")


def test_training_template_renders_smollm2s_chat_exactly_and_marks_the_answer(tiny_folder):
    tokenizer = AutoTokenizer.from_pretrained(tiny_folder)
    training = (EXAMPLES / "smollm2" / "chatml_training.jinja").read_text()
    conversations = [
        [{"role": "user", "content": "Ask: how many?\nAnswer:"}, {"role": "assistant", "content": "3"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
         {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    ]
    for messages in conversations:
        for generation_prompt in (False, True):
            rendered = [tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template,
                                                      add_generation_prompt=generation_prompt)
                        for template in (SMOLLM2_CHAT_TEMPLATE, training)]
            assert rendered[0] == rendered[1]
    marked = tokenizer.apply_chat_template(conversations[0], chat_template=training, return_dict=True,
                                           return_assistant_tokens_mask=True)
    answer = [token for token, mask in zip(marked["input_ids"], marked["assistant_masks"]) if mask]
    assert tokenizer.decode(answer) == "3<|im_end|>"  # the answer and the end of turn: the model learns to stop


@pytest.mark.slow
def test_quickstart_on_chat_messages_then_a_chat_that_continues_the_cache(tiny_folder, tmp_path):
    quickstart, chat = load_example("quickstart"), load_example("chat")
    output_dir = tmp_path / "adapter"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        quickstart.main(["--model_name_or_path", str(tiny_folder), "--conversational",
                         "--chat_template", quickstart.SMOLLM2_TRAINING_TEMPLATE, "--output_dir", str(output_dir),
                         "--max_steps", "2", "--per_device_train_batch_size", "4", "--num_prompts", "2",
                         "--max_new_tokens", "4", "--learning_rate", "1e-2"])
    printed = printed.getvalue()
    assert json.loads((output_dir / "adapter_config.json").read_text())["peft_type"] == "BITUNE"
    assert printed.count("answer:") == 2 and printed.count("untuned:") == 2
    assert "user: Read the story" in printed or "user: Ask:" in printed  # held-out prompts went in as chat turns
    assert "{% generation %}" in AutoTokenizer.from_pretrained(output_dir).chat_template

    turns = chat.main(["--adapter", str(output_dir), "--model_name_or_path", str(tiny_folder), "--turn", "the cat",
                       "--turn", "the hat", "--turn", "a", "--max_new_tokens", "3"])
    model, tokenizer = chat.load(str(output_dir), str(tiny_folder))
    # What the chat fed the model is exactly the rendered conversation (the template's own text between turns).
    ids = sum((t.instruction_ids + t.answer_ids for t in turns), [])
    messages = sum(([{"role": "user", "content": t.instruction}, {"role": "assistant", "content": t.answer}]
                    for t in turns), [])
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered.startswith(tokenizer.decode(ids[: -len(turns[-1].answer_ids)]))
    # And the answers are what the training forward on the whole conversation predicts (alternating scheme).
    labels = sum(([-100] * len(t.instruction_ids) + t.answer_ids for t in turns), [])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).logits
    targets = (torch.tensor(labels) != -100).nonzero().flatten()
    assert logits[0, targets - 1].argmax(-1).tolist() == torch.tensor(labels)[targets].tolist()


@pytest.mark.slow
def test_the_qlora_comparison_runs_bitune_over_a_4bit_base_and_serves_it_on_the_float_base(tiny_folder):
    problem = why_bitsandbytes_cannot_run()
    if problem is not None:
        pytest.skip(problem)
    qlora = load_example("smollm2/qlora")
    result = qlora.one_run("bitune-4bit", steps=1, evaluate=True, folder=str(tiny_folder))
    assert result["run"] == "bitune-4bit" and result["steps"] == 1
    # The high-water mark restarts from the resident memory at its reset, just after the "after loading" reading:
    # pages returned to the system in between (measured: 1 MiB, in 1 run of CI's) can put the peak that far below it.
    assert result["peak_rss_training_mib"] >= result["rss_after_loading_mib"] - 2 > 0
    for base in ("on_4bit_base", "on_float_base"):
        held_out = result[base]
        assert held_out["answer_tokens"] > 0 and held_out["answer_loss"] > 0
        assert len(held_out["answers"]) == held_out["prompts"] == qlora.HELD_OUT_PROMPTS
    assert 0 <= result["same_answer_on_both_bases"] <= qlora.HELD_OUT_PROMPTS
