"""Local building blocks for the TRL tests: a word-level tokenizer with a chat template, a tiny model saved next to it
(so that a model path alone is enough, as for `bitune-sft`), and small prompt-completion / conversational datasets.
Nothing is downloaded."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from peft_bitune import compat

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"]
NUMBERS = [str(n) for n in range(20)]
WORDS = ["what", "is", "plus", "minus", "?", "answer", ":", "the", "and", "then", "count", "to", "say"]
VOCAB = SPECIAL_TOKENS + NUMBERS + WORDS

# Generation markers let TRL's `assistant_only_loss` find the assistant tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|> {{ message['content'] }} <|end|> "
    "{% else %}<|assistant|> {% generation %}{{ message['content'] }} <|end|>{% endgeneration %} {% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer that prepends `<s>` to every text, with a chat template."""
    vocab = {token: index for index, token in enumerate(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|end|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def model_config() -> LlamaConfig:
    tokenizer_vocab = len(VOCAB)
    return LlamaConfig(
        vocab_size=tokenizer_vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )


def save_model_and_tokenizer(directory: str | Path) -> str:
    """Write a tiny random Llama and the tokenizer into one directory (usable as `model_name_or_path`)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config())
    model.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return str(directory)


def arithmetic_rows(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """(question, answer) pairs of different lengths, e.g. ("what is 3 plus 4 ?", "7")."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randrange(10), rng.randrange(10)
        if rng.random() < 0.5:
            rows.append((f"what is {a} plus {b} ?", f"{a + b}"))
        else:
            end = rng.randrange(2, 6)
            rows.append((f"count to {end} and then say {a} ?", " ".join(str(n) for n in range(1, end + 1))))
    return rows


def prompt_completion_rows(count: int, seed: int = 0) -> list[dict[str, str]]:
    """Standard prompt-completion rows; the completion starts with a space, as in the paper's templates."""
    pairs = arithmetic_rows(count, seed)
    return [{"prompt": f"{question} answer :", "completion": f" {answer}"} for question, answer in pairs]


def conversation_rows(count: int, turns: int = 1, seed: int = 0) -> list[dict[str, list[dict[str, str]]]]:
    """Conversational language-modelling rows (`messages`) with `turns` user/assistant exchanges each."""
    pairs = arithmetic_rows(count * turns, seed)
    rows = []
    for start in range(0, len(pairs), turns):
        messages = []
        for question, answer in pairs[start : start + turns]:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        rows.append({"messages": messages})
    return rows


# ---------------------------------------------------------------------- shared by the TRL tests
def make_trainer(model_dir, output_dir, rows=None, peft_config=None, **args):
    """A `BituneSFTTrainer` on `rows` (16 prompt-completion rows by default) with the settings of `training_args` and
    `small_bitune_config`."""
    from datasets import Dataset

    from trl_integration import BituneSFTTrainer

    rows = prompt_completion_rows(16) if rows is None else rows
    return BituneSFTTrainer(
        model=model_dir,
        args=training_args(output_dir, **args),
        train_dataset=Dataset.from_list(rows),
        processing_class=build_tokenizer(),
        peft_config=small_bitune_config() if peft_config is None else peft_config,
    )


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def adapter_state(model) -> dict[str, torch.Tensor]:
    """Both weight sets and the mixing scalars, trainable or not (a loaded adapter is frozen)."""
    return {n: p.detach() for n, p in model.named_parameters() if "lora_" in n or "bitune_mixers" in n}


def weight_set_state(model, weight_set: str) -> dict[str, torch.Tensor]:
    return {name: p for name, p in trainable_state(model).items() if f"default__{weight_set}" in name}


def receives_gradient(name: str, num_layers: int = model_config().num_hidden_layers) -> bool:
    """Every trainable weight gets a gradient except, by construction, the bidirectional weights of the last layer
    outside its key/value projections: the bidirectional pass is used only for the keys/values it writes, and the last
    layer's attention output and MLP feed no further layer."""
    last_layer = f".layers.{num_layers - 1}."
    writes_the_cache = "k_proj" in name or "v_proj" in name
    return not ("default__bidirectional" in name and last_layer in name and not writes_the_cache)


def mixer_state(model) -> torch.Tensor:
    mixer = model.base_model.mixer
    return torch.cat([mixer.key_weights.detach(), mixer.value_weights.detach()]).clone()


def first_batch(trainer) -> dict[str, torch.Tensor]:
    return next(iter(trainer.get_train_dataloader()))


def never_loaded(tmp_path) -> str:
    """A model path that does not exist: a trainer given it must refuse before anything is loaded."""
    return str(tmp_path / "never-loaded")


# ---------------------------------------------------------------------- a training run, also under `accelerate launch`
def small_bitune_config():
    """LoRA r=4 on every linear layer for both weight sets; a small, fast Bitune adapter."""
    from peft import LoraConfig

    from peft_bitune import BituneConfig

    return BituneConfig(adapter_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))


def training_args(output_dir: str | Path, checkpointing: bool = False, **overrides):
    """Fast, deterministic CPU settings (fp32, no saving, log every step); activation checkpointing only if
    `checkpointing`, set under the installed transformers' name for it."""
    from trl_integration import BituneSFTConfig

    settings = dict(
        output_dir=str(output_dir), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-2, bf16=False,
        report_to=[], logging_steps=1, save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
        dataloader_num_workers=0, **{compat.CHECKPOINTING_ARGUMENT: checkpointing},
    )
    settings.update(overrides)
    return BituneSFTConfig(**settings)


def run_training(model_dir: str, output_dir: str, per_device_train_batch_size: int, max_steps: int, rows: int = 16,
                 **overrides) -> list[dict]:
    """Train on prompt-completion rows, save the adapter to `output_dir/adapter`, and return the log history."""
    from datasets import Dataset

    from trl_integration import BituneSFTTrainer

    trainer = BituneSFTTrainer(
        model=model_dir,
        args=training_args(output_dir, per_device_train_batch_size=per_device_train_batch_size, max_steps=max_steps,
                           **overrides),
        train_dataset=Dataset.from_list(prompt_completion_rows(rows)),
        processing_class=build_tokenizer(),
        peft_config=small_bitune_config(),
    )
    trainer.train()
    trainer.save_model(str(Path(output_dir) / "adapter"))  # every process takes part (FSDP gathers the weights)
    return trainer.state.log_history


if __name__ == "__main__":
    # `accelerate launch ... tests/trl_helpers.py MODEL_DIR OUTPUT_DIR PER_DEVICE_BATCH MAX_STEPS [JSON overrides]`:
    # trains, then the main process writes the log history to OUTPUT_DIR/log_history.json.
    import json
    import sys

    model_dir, output_dir, batch_size, steps = sys.argv[1:5]
    overrides = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    history = run_training(model_dir, output_dir, int(batch_size), int(steps), **overrides)
    from accelerate import PartialState

    if PartialState().is_main_process:
        Path(output_dir, "log_history.json").write_text(json.dumps(history))
    # Leaving with gloo's process group alive can abort a process at exit ("terminate called without an active
    # exception", seen once in CI after training had finished), failing the launch.
    PartialState().destroy_process_group()
