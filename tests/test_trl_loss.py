"""`BituneSFTTrainer`'s loss and TRL's metrics, checked against the one-row-at-a-time references (tests/reference.py),
with the instruction/answer segments taken from the labels TRL builds: prompt-completion rows, and single- and
multi-turn conversations."""

from __future__ import annotations

import datasets
import pytest
import torch
from peft import LoraConfig
from torch.nn import functional as F
from transformers.trainer_pt_utils import LabelSmoother

import trl_helpers as helpers
from peft_bitune import BituneConfig
from peft_bitune.constants import IGNORE_INDEX
from reference import reference_alternating, reference_row
from trl_helpers import (
    first_batch,
    make_trainer,
)

datasets.disable_progress_bars()


def loss_and_logged_metrics(trainer, batch) -> tuple[torch.Tensor, dict[str, float]]:
    """`compute_loss` on `batch` (without gradients), and the training log written right after it: TRL's metrics of
    that batch, as the trainer reports them. Whatever an earlier call left unlogged is logged first."""
    assert trainer.model.training, "the metrics would be logged as evaluation metrics"
    trainer.log({})
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, dict(batch))
    trainer.log({})
    return loss, trainer.state.log_history[-1]


def randomize_adapters(model, seed: int = 0) -> None:
    """Non-trivial, different weight sets and mixing scalars (LoRA's B starts at zero otherwise)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.requires_grad:
                parameter.copy_(0.002 + 0.05 * torch.rand(parameter.shape, generator=generator))


def turns_from_labels(labels: torch.Tensor) -> tuple[list[tuple[int, int]], int]:
    """(instruction length, answer length) of each turn of one unpadded row, and its trailing unsupervised tokens:
    the instruction/answer segments exactly as the labels mark them."""
    supervised = (labels != IGNORE_INDEX).tolist()
    runs, start = [], 0
    for position in range(1, len(supervised) + 1):
        if position == len(supervised) or supervised[position] != supervised[start]:
            runs.append((supervised[start], position - start))
            start = position
    trailing = runs.pop()[1] if not runs[-1][0] else 0
    assert [is_answer for is_answer, _ in runs] == [False, True] * (len(runs) // 2)
    return [(runs[i][1], runs[i + 1][1]) for i in range(0, len(runs), 2)], trailing


def reference_predictions(model, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits predicting each supervised token of one unpadded row, and those tokens, from the per-row references."""
    turns, trailing = turns_from_labels(labels)
    if len(turns) == 1:
        (instruction, answer), = turns
        logits, _ = reference_row(model, tokens, instruction)
        return logits[:answer], tokens[instruction : instruction + answer]
    _, turn_logits = reference_alternating(model, tokens, turns, trailing)
    logits, targets, position = [], [], 0
    for (instruction, answer), turn in zip(turns, turn_logits):
        logits.append(turn[:answer])
        targets.append(tokens[position + instruction : position + instruction + answer])
        position += instruction + answer
    return torch.cat(logits), torch.cat(targets)


def reference_statistics(model, batch) -> dict[str, float]:
    """Loss (plain, DFT, label-smoothed), entropy and top-1 accuracy over the supervised tokens, one row at a time
    with the reference forwards; each row's segments are those its labels mark."""
    entropies, correct, nll, dft, uniform = [], [], [], [], []
    for row in range(batch["input_ids"].shape[0]):
        length = int(batch["attention_mask"][row].sum())
        logits, targets = reference_predictions(model, batch["input_ids"][row, :length], batch["labels"][row, :length])
        log_probs = F.log_softmax(logits.float(), dim=-1)
        target_log_probs = log_probs.gather(1, targets[:, None]).squeeze(1)
        nll += (-target_log_probs).tolist()
        dft += (-target_log_probs * target_log_probs.exp()).tolist()
        uniform += (-log_probs.mean(-1)).tolist()
        entropies += (-(log_probs.exp() * log_probs).sum(-1)).tolist()
        correct += (log_probs.argmax(-1) == targets).tolist()
    count = len(nll)
    return {
        "loss": sum(nll) / count,
        "dft_loss": sum(dft) / count,
        "smoothed_loss": 0.9 * sum(nll) / count + 0.1 * sum(uniform) / count,  # label smoothing 0.1
        "entropy": sum(entropies) / count,
        "mean_token_accuracy": sum(correct) / count,
    }


# ---------------------------------------------------------------------- loss and TRL's metrics
@pytest.fixture(scope="module")
def random_adapter_trainer(trl_model_dir, tmp_path_factory):
    adapter = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    trainer = make_trainer(
        trl_model_dir, tmp_path_factory.mktemp("metrics"), peft_config=BituneConfig(adapter_config=adapter)
    )
    randomize_adapters(trainer.model)
    return trainer


@pytest.mark.parametrize("loss", ["loss", "dft_loss", "smoothed_loss"])
def test_loss_and_metrics_match_the_reference_forward(random_adapter_trainer, loss):
    trainer = random_adapter_trainer
    batch = first_batch(trainer)
    assert bool((batch["attention_mask"] == 0).any()), "the batch must hold right-padded rows"
    trainer.args.loss_type = "dft" if loss == "dft_loss" else "nll"
    trainer.label_smoother = LabelSmoother(epsilon=0.1) if loss == "smoothed_loss" else None
    try:
        value, logged = loss_and_logged_metrics(trainer, batch)
    finally:
        trainer.args.loss_type, trainer.label_smoother = "nll", None
    expected = reference_statistics(trainer.model, batch)
    assert value.item() == pytest.approx(expected[loss], abs=1e-5)
    assert logged["entropy"] == pytest.approx(expected["entropy"], abs=1e-5)
    assert logged["mean_token_accuracy"] == pytest.approx(expected["mean_token_accuracy"])
    assert logged["num_tokens"] >= int(batch["attention_mask"].sum())


def test_compute_loss_func_gets_the_bitune_logits_through_trl(random_adapter_trainer):
    """TRL hands `compute_loss_func` the model's logits from a forward without labels; the Bitune forward finds the
    instruction from the `prompt_mask` the trainer adds, so the logits are those of the answer passes."""
    trainer = random_adapter_trainer
    batch = first_batch(trainer)
    received = {}

    def summed_nll(outputs, labels, num_items_in_batch=None):  # a user's own loss: summed, not averaged
        received["labels"] = labels
        logits, targets = outputs.logits[:, :-1], labels[:, 1:]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")

    trainer.compute_loss_func = summed_nll
    try:
        value, logged = loss_and_logged_metrics(trainer, batch)
    finally:
        trainer.compute_loss_func = None
    expected = reference_statistics(trainer.model, batch)
    count = int((batch["labels"] != IGNORE_INDEX).sum())
    assert torch.equal(received["labels"], batch["labels"])
    assert value.item() == pytest.approx(expected["loss"] * count, abs=1e-4)
    assert logged["entropy"] == pytest.approx(expected["entropy"], abs=1e-5)  # TRL's metrics, from the fused call


def test_the_nll_loss_builds_no_logits(random_adapter_trainer):
    """TRL's own loss goes through the fused head: the LM head module never runs over (batch, length, vocabulary)."""
    trainer = random_adapter_trainer
    calls = []
    hook = trainer.model.get_output_embeddings().register_forward_hook(lambda *args: calls.append(1))
    try:
        loss_and_logged_metrics(trainer, first_batch(trainer))
    finally:
        hook.remove()
    assert calls == []


def test_accuracy_metric_counts_correct_predictions(random_adapter_trainer):
    """Accuracy on random weights is near zero; make some predictions right to check the metric sees them."""
    trainer = random_adapter_trainer
    batch = first_batch(trainer)
    with torch.no_grad():
        logits = trainer.model(**batch).logits
    predicted = batch["labels"].clone()
    predicted[:, 1:] = torch.where(batch["labels"][:, 1:] != IGNORE_INDEX, logits[:, :-1].argmax(-1), IGNORE_INDEX)
    _, logged = loss_and_logged_metrics(trainer, {**batch, "labels": predicted})
    assert logged["mean_token_accuracy"] == pytest.approx(1.0)


@pytest.mark.parametrize("conversation_format", ["messages", "prompt-completion"])
def test_single_turn_conversations_train_on_the_assistant_answer(tmp_path, trl_model_dir, conversation_format):
    rows = helpers.conversation_rows(8)
    if conversation_format == "prompt-completion":
        rows = [{"prompt": row["messages"][:1], "completion": row["messages"][1:]} for row in rows]
    adapter = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    trainer = make_trainer(
        trl_model_dir, tmp_path, rows=rows, peft_config=BituneConfig(adapter_config=adapter),
        assistant_only_loss=conversation_format == "messages",
    )
    randomize_adapters(trainer.model)
    batch = first_batch(trainer)
    tokenizer = helpers.build_tokenizer()
    for row in range(batch["input_ids"].shape[0]):
        first = int((batch["labels"][row] != IGNORE_INDEX).nonzero()[0])
        # The instruction the model reads ends with the assistant marker; the answer is the assistant's words.
        assert tokenizer.convert_ids_to_tokens(int(batch["input_ids"][row, first - 1])) == "<|assistant|>"
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, dict(batch))
    assert loss.item() == pytest.approx(reference_statistics(trainer.model, batch)["loss"], abs=1e-5)


def test_multi_turn_conversations_train_on_every_assistant_answer(tmp_path, trl_model_dir):
    """Two-turn conversations: both answers are supervised, and the loss and metrics are those of the alternating
    multi-turn reference with the segments the labels mark."""
    adapter = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    trainer = make_trainer(
        trl_model_dir, tmp_path, rows=helpers.conversation_rows(4, turns=2),
        peft_config=BituneConfig(adapter_config=adapter), assistant_only_loss=True,
    )
    randomize_adapters(trainer.model)
    batch = first_batch(trainer)
    for row in range(batch["input_ids"].shape[0]):
        length = int(batch["attention_mask"][row].sum())
        assert len(turns_from_labels(batch["labels"][row, :length])[0]) == 2
    loss, logged = loss_and_logged_metrics(trainer, batch)
    expected = reference_statistics(trainer.model, batch)
    assert loss.item() == pytest.approx(expected["loss"], abs=1e-5)
    assert logged["entropy"] == pytest.approx(expected["entropy"], abs=1e-5)
    assert logged["mean_token_accuracy"] == pytest.approx(expected["mean_token_accuracy"])
