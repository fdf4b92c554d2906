"""TRL's packing and padding-free batches through `BituneSFTTrainer` and TRL's own `SFTTrainer`: the packed run trains
exactly as the padded run of the same examples, step by step."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import datasets
import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

import trl_helpers as helpers
from peft_bitune import BituneConfig
from trl_integration import BituneSFTTrainer

datasets.disable_progress_bars()

MINIATURE = Path(__file__).resolve().parent.parent / "examples" / "miniature"
EXAMPLES_PER_ROW = 2


def miniature_rows_of_one_length(count: int) -> list[dict[str, str]]:
    """`count` prompt-completion rows of the miniature's training set that tokenize to the same length, so that
    TRL's "bfd" packing puts exactly `EXAMPLES_PER_ROW` of them in each packed row."""
    tokenizer = AutoTokenizer.from_pretrained(MINIATURE / "base")
    by_length: dict[int, list[dict[str, str]]] = {}
    with open(MINIATURE / "data" / "train.jsonl") as lines:
        for line in lines:
            row = json.loads(line)
            length = len(tokenizer(row["prompt"] + row["completion"])["input_ids"])
            by_length.setdefault(length, []).append({"prompt": row["prompt"], "completion": row["completion"]})
    rows = max(by_length.values(), key=len)
    assert len(rows) >= count
    return rows[:count]


def miniature_run(tmp_path, rows, **args) -> BituneSFTTrainer:
    """A short run with plain SGD, whose weight moves are the learning rate times the gradients: two runs whose
    gradients agree to float32 rounding move their weights alike. Adam could not show it: it moves an entry whose
    gradient is near zero by up to the learning rate, whatever sign rounding gives that gradient."""
    settings = dict(
        output_dir=str(tmp_path), max_steps=4, optim="sgd", learning_rate=0.2, bf16=False, report_to=[],
        logging_steps=1, save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0,
        train_sampling_strategy="sequential",
    )
    trainer = BituneSFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(MINIATURE / "base", attn_implementation="sdpa"),
        args=helpers.training_args(**{**settings, **args}),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(MINIATURE / "base"),
        peft_config=BituneConfig(adapter_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")),
    )
    trainer.initial_state = helpers.trainable_state(trainer.model)
    trainer.train()
    return trainer


def step_losses(trainer) -> torch.Tensor:
    return torch.tensor([entry["loss"] for entry in trainer.state.log_history if "loss" in entry])


def test_a_packed_run_on_the_miniature_trains_as_the_padded_run_of_the_same_examples(tmp_path):
    rows = miniature_rows_of_one_length(4 * EXAMPLES_PER_ROW)
    tokenizer = AutoTokenizer.from_pretrained(MINIATURE / "base")
    tokens = len(tokenizer(rows[0]["prompt"] + rows[0]["completion"])["input_ids"]) + 1  # TRL appends EOS
    max_length = EXAMPLES_PER_ROW * tokens + tokens // 2  # room for exactly EXAMPLES_PER_ROW examples
    packed = miniature_run(tmp_path / "packed", rows, packing=True, max_length=max_length,
                           per_device_train_batch_size=1)
    packed_rows = packed.train_dataset
    assert packed_rows["seq_lengths"] == [[tokens] * EXAMPLES_PER_ROW] * 4  # each step: the same examples as padded
    # The padded run sees the examples in the order packing left them in.
    order = {tuple(tokenizer(row["prompt"] + row["completion"])["input_ids"]): index for index, row in enumerate(rows)}
    packed_order = [order[tuple(row[start : start + tokens - 1])]
                    for row in packed_rows["input_ids"] for start in range(0, len(row), tokens)]
    assert sorted(packed_order) == list(range(len(rows)))
    padded = miniature_run(tmp_path / "padded", [rows[index] for index in packed_order],
                           per_device_train_batch_size=EXAMPLES_PER_ROW, max_length=max_length)
    assert padded.train_dataset.column_names != packed_rows.column_names  # not packed
    losses = step_losses(packed)
    assert len(losses) == 4 and losses[-1] < losses[0]  # it trains
    torch.testing.assert_close(losses, step_losses(padded), atol=1e-5, rtol=1e-5)
    # Each tensor's moves agree to 1% of its largest move: float32 rounding of the gradient sums gave at most 0.14%
    # (the first layer's A matrices, whose moves are the smallest); a tensor that did not train, or trained on
    # another example's tokens, differs by its whole move. (The last layer's bidirectional weights other than its
    # keys/values get no gradient in either run: the prompt pass ends at them.)
    assert all(torch.equal(packed.initial_state[name], padded.initial_state[name]) for name in padded.initial_state)
    got, want = helpers.trainable_state(packed.model), helpers.trainable_state(padded.model)
    for name, start in padded.initial_state.items():
        got_move, want_move = got[name] - start, want[name] - start
        torch.testing.assert_close(got_move, want_move, atol=1e-2 * float(want_move.abs().max()), rtol=0, msg=name)


@pytest.mark.parametrize("args", [{"packing": True}, {"padding_free": True, "max_length": None}],
                         ids=["packing", "padding_free"])
def test_trls_own_sft_trainer_trains_a_bitune_adapter_on_packed_rows(tmp_path, trl_model_dir, args):
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, report_to=[],
                       save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False, dataloader_num_workers=0,
                       logging_steps=1, model_init_kwargs={"attn_implementation": "sdpa"}, **args)
    trainer = SFTTrainer(model=trl_model_dir, args=config, train_dataset=datasets.Dataset.from_list(
        helpers.prompt_completion_rows(16)), processing_class=helpers.build_tokenizer(),
        peft_config=helpers.small_bitune_config())
    before = {name: value.clone() for name, value in helpers.trainable_state(trainer.model).items()}
    trainer.train()
    batch = helpers.first_batch(trainer)
    assert batch["input_ids"].shape[0] == 1 and (batch["position_ids"] == 0).sum() > 1  # a padding-free batch
    assert bool(torch.isfinite(step_losses(trainer)).all())
    after = helpers.trainable_state(trainer.model)
    assert any(not torch.equal(before[name], after[name]) for name in before)


def test_rows_packed_together_are_not_counted_as_dropped(tmp_path, trl_model_dir):
    """16 rows packed into one are 16 examples kept: before, the trainer warned that 15 rows were dropped by
    truncation (it compared the packed dataset's rows with the rows given)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = helpers.make_trainer(trl_model_dir, tmp_path, packing=True)
    assert len(trainer.train_dataset) < 16 and sum(map(len, trainer.train_dataset["seq_lengths"])) == 16
    assert not [warning for warning in caught if "were dropped" in str(warning.message)]


def test_a_split_piece_that_begins_inside_an_answer_is_refused_before_training(tmp_path, trl_model_dir):
    """TRL's "bfd_split" cuts an example longer than `max_length` into pieces; one that begins inside the answer has
    no instruction, and the trainer names it (packed row and example) before any step."""
    rows = helpers.prompt_completion_rows(4) + [{"prompt": "count to 9 ?", "completion": " 1 2 3 4 5 6 7 8 9"}]
    with pytest.raises(ValueError, match=r"Packed examples \(row:example\) \[\d+:\d+\] of the prepared "
                                         r"`train_dataset` have no instruction.*bfd_split"):
        helpers.make_trainer(trl_model_dir, tmp_path, rows=rows, packing=True, packing_strategy="bfd_split",
                             max_length=12)
    # The same rows with "bfd", which truncates the long example instead, are accepted.
    trainer = helpers.make_trainer(trl_model_dir, tmp_path, rows=rows, packing=True, max_length=12)
    assert "seq_lengths" in trainer.train_dataset.column_names
