"""Broken adapter files and interrupted checkpoints: every refusal names the file and what is wrong with it, a refused
`load_adapter` leaves nothing behind, and resuming skips a checkpoint whose writing a crash interrupted."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file, save_file

from peft_bitune import BituneConfig
from reference import make_bitune

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)


@pytest.fixture(scope="module")
def good_adapter(load_base, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("adapter") / "good"
    make_bitune(load_base("llama"), adapter_config=LORA, seed=1).save_pretrained(path)
    return path


def truncated(weights: Path) -> None:
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])


def emptied(weights: Path) -> None:
    weights.write_bytes(b"")


def header_corrupted(weights: Path) -> None:
    data = bytearray(weights.read_bytes())
    data[8:20] = b"not a header"
    weights.write_bytes(bytes(data))


def removed(weights: Path) -> None:
    weights.unlink()


def dangling_link(weights: Path) -> None:
    weights.unlink()
    weights.symlink_to(weights.parent / "moved-away.safetensors")


def made_a_folder(weights: Path) -> None:
    weights.unlink()
    weights.mkdir()


# How each breakage of the weights file is named in the refusal.
BROKEN_WEIGHTS = {
    truncated: "is not a complete safetensors file .*incomplete metadata.*truncated, empty or damaged",
    emptied: "is not a complete safetensors file .*header too small",
    header_corrupted: "is not a complete safetensors file .*invalid JSON in header",
    removed: rf"it has no {WEIGHTS} \(nor adapter_model.bin\), only its config",
    dangling_link: "is a symbolic link to .*moved-away.safetensors', which does not exist",
    made_a_folder: "is a folder; it must be the adapter's weights file",
}


def broken_copy(good: Path, tmp_path: Path, breakage) -> Path:
    folder = tmp_path / breakage.__name__
    shutil.copytree(good, folder)
    breakage(folder / WEIGHTS)
    return folder


def model_state(model) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


# ----------------------------------------------------------------------------------------------- items 1 and 7
@pytest.mark.parametrize("breakage", list(BROKEN_WEIGHTS), ids=lambda f: f.__name__)
def test_a_refused_load_adapter_leaves_nothing_behind(load_base, good_adapter, tmp_path, breakage):
    model = PeftModel.from_pretrained(load_base("llama"), good_adapter)
    before = model_state(model)
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "prompt_mask": torch.tensor([[1, 1, 0, 0]])}
    with torch.no_grad():
        logits = model(**inputs).logits
    folder = broken_copy(good_adapter, tmp_path, breakage)
    with pytest.raises(ValueError, match=rf"Bitune adapter at '{re.escape(str(folder))}'.*{BROKEN_WEIGHTS[breakage]}"):
        model.load_adapter(str(folder), adapter_name="second")
    assert list(model.peft_config) == ["default"]
    assert list(model.base_model.bitune_mixers) == ["default"]
    assert list(model.base_model.peft_config) == ["default"]
    after = model_state(model)
    assert after.keys() == before.keys()  # no layer of "second" anywhere
    assert all(torch.equal(after[name], before[name]) for name in before)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, logits)
    with pytest.raises(ValueError):
        model.set_adapter("second")


@pytest.mark.parametrize("breakage", list(BROKEN_WEIGHTS), ids=lambda f: f.__name__)
def test_from_pretrained_names_the_broken_weights_file_and_leaves_the_base_model_alone(
    load_base, good_adapter, tmp_path, breakage
):
    folder = broken_copy(good_adapter, tmp_path, breakage)
    base = load_base("llama")
    names = [name for name, _ in base.named_modules()]
    path = folder / WEIGHTS
    named = re.escape(str(path)) if breakage is not removed else re.escape(str(folder))
    with pytest.raises(ValueError, match=rf"{named}.*{BROKEN_WEIGHTS[breakage]}.*Nothing was loaded"):
        PeftModel.from_pretrained(base, folder)
    assert [name for name, _ in base.named_modules()] == names  # no adapter layer was injected


def test_a_refused_load_adapter_from_the_hub_cache_leaves_nothing_behind(load_base, good_adapter, tmp_path):
    """A Hub snapshot whose weights never arrived (or whose blob was removed): refused, offline, before PEFT adds the
    adapter (PEFT's own `LocalEntryNotFoundError` came after it)."""
    snapshot = tmp_path / "models--user--adapter" / "snapshots" / hashlib.sha1(b"c").hexdigest()
    snapshot.mkdir(parents=True)
    shutil.copy(good_adapter / CONFIG, snapshot / CONFIG)
    (tmp_path / "models--user--adapter" / "refs").mkdir()
    (tmp_path / "models--user--adapter" / "refs" / "main").write_text(snapshot.name)
    model = PeftModel.from_pretrained(load_base("llama"), good_adapter)
    keys = set(model.state_dict())
    with pytest.raises(ValueError, match=rf"'user/adapter': the local Hugging Face cache .* no {WEIGHTS}"):
        model.load_adapter("user/adapter", adapter_name="second", cache_dir=str(tmp_path))
    assert list(model.peft_config) == ["default"] and set(model.state_dict()) == keys


def test_a_folder_with_only_the_config_is_still_read_by_peft_config(good_adapter, tmp_path):
    """Reading a config alone (`PeftConfig.from_pretrained`, as `bitune-serve` and `bitune-eval` do before loading
    anything) does not need the weights."""
    from peft import PeftConfig

    shutil.copytree(good_adapter, tmp_path / "config_only")
    (tmp_path / "config_only" / WEIGHTS).unlink()
    assert PeftConfig.from_pretrained(str(tmp_path / "config_only")).peft_type == "BITUNE"


@pytest.mark.parametrize(
    "content, reason",
    [
        ("{not json", "is not valid JSON"),
        ("", "is empty"),
        ("[1, 2]", r"must hold a JSON object .* but holds `\[1, 2\]`"),
        ("null", "must hold a JSON object .* but holds `null`"),
    ],
    ids=["not_json", "empty", "list", "null"],
)
def test_a_broken_config_file_read_as_a_bitune_config_is_named(good_adapter, tmp_path, content, reason):
    shutil.copytree(good_adapter, tmp_path / "adapter")
    (tmp_path / "adapter" / CONFIG).write_text(content)
    path = re.escape(str(tmp_path / "adapter" / CONFIG))
    with pytest.raises(ValueError, match=rf"Cannot read the Bitune adapter config '{path}': .*{reason}"):
        BituneConfig.from_pretrained(str(tmp_path / "adapter"))


def without_mixing_scalars(good: Path, tmp_path: Path) -> Path:
    """A whole safetensors file that lacks the mixing scalars: refused by the checks of the weights, which run after
    PEFT has added the adapter."""
    folder = tmp_path / "incomplete"
    shutil.copytree(good, folder)
    weights = load_file(folder / WEIGHTS)
    save_file({key: value for key, value in weights.items() if "bitune_mixers" not in key}, folder / WEIGHTS)
    return folder


def test_a_refused_first_adapter_gives_the_base_model_back_unchanged(load_base, good_adapter, tmp_path):
    base = load_base("llama")
    names, state = [name for name, _ in base.named_modules()], model_state(base)
    with pytest.raises(ValueError, match="is incomplete: it lacks the mixing scalars"):
        PeftModel.from_pretrained(base, without_mixing_scalars(good_adapter, tmp_path))
    assert [name for name, _ in base.named_modules()] == names
    assert all(torch.equal(value, state[name]) for name, value in model_state(base).items())
    # The same base model can be used again (before: AttributeError from the inner LoRA config left on it).
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "prompt_mask": torch.tensor([[1, 1, 0, 0]])}
    with torch.no_grad():
        again = PeftModel.from_pretrained(base, good_adapter)(**inputs).logits
        fresh = PeftModel.from_pretrained(load_base("llama"), good_adapter)(**inputs).logits
    assert torch.equal(again, fresh)


def test_refused_weights_for_an_adapter_the_model_already_has_leave_it_as_it_was(load_base, good_adapter, tmp_path):
    """`load_adapter` into an existing name (what the Trainer's resuming does) adds nothing: a refusal keeps the
    adapter and its weights (before, the refusal deleted it)."""
    model = PeftModel.from_pretrained(load_base("llama"), good_adapter)
    model.load_adapter(str(good_adapter), adapter_name="second")
    before = model_state(model)
    with pytest.raises(ValueError, match="is incomplete"):
        model.load_adapter(str(without_mixing_scalars(good_adapter, tmp_path)), adapter_name="second")
    assert list(model.peft_config) == ["default", "second"]
    after = model_state(model)
    assert after.keys() == before.keys() and all(torch.equal(after[name], before[name]) for name in before)


def test_the_loading_mark_is_never_saved(load_base, good_adapter, tmp_path):
    config = BituneConfig.from_pretrained(str(good_adapter))
    config.save_pretrained(str(tmp_path))
    assert json.loads((tmp_path / CONFIG).read_text()) == json.loads((good_adapter / CONFIG).read_text())


# ------------------------------------------------------------------------------------------------------------ item 8
@pytest.fixture(scope="module")
def two_checkpoints(trl_model_dir, tmp_path_factory) -> Path:
    """An output folder with `checkpoint-1` and `checkpoint-2`, each written whole."""
    from trl_helpers import make_trainer

    output_dir = tmp_path_factory.mktemp("checkpoints")
    make_trainer(trl_model_dir, output_dir, rows=None, max_steps=2, save_strategy="steps", save_steps=1).train()
    assert {"checkpoint-1", "checkpoint-2"} <= set(os.listdir(output_dir))
    return output_dir


def interrupted_in_the_weights(checkpoint: Path) -> None:
    """Killed while the adapter weights were written: they are cut short, and nothing after them exists."""
    truncated(checkpoint / WEIGHTS)
    for name in os.listdir(checkpoint):
        if name not in (WEIGHTS, CONFIG, "README.md"):
            os.remove(checkpoint / name)


def interrupted_before_the_state(checkpoint: Path) -> None:
    """Killed after the optimizer, scheduler and RNG states, before `trainer_state.json`."""
    os.remove(checkpoint / "trainer_state.json")


def interrupted_in_the_state(checkpoint: Path) -> None:
    state = checkpoint / "trainer_state.json"
    state.write_text(state.read_text()[:40])


INTERRUPTIONS = {
    interrupted_in_the_weights: "it has no trainer_state.json",
    interrupted_before_the_state: "it has no trainer_state.json",
    interrupted_in_the_state: "its trainer_state.json is not a complete JSON object",
}


def copied_run(two_checkpoints: Path, tmp_path: Path, interruption=None) -> Path:
    output_dir = tmp_path / "run"
    shutil.copytree(two_checkpoints, output_dir)
    if interruption is not None:
        interruption(output_dir / "checkpoint-2")
    return output_dir


@pytest.mark.parametrize("interruption", list(INTERRUPTIONS), ids=lambda f: f.__name__)
def test_resuming_skips_a_checkpoint_whose_writing_was_interrupted(
    two_checkpoints, trl_model_dir, tmp_path, interruption
):
    from trl_helpers import make_trainer

    output_dir = copied_run(two_checkpoints, tmp_path, interruption)
    trainer = make_trainer(trl_model_dir, output_dir, max_steps=2, save_strategy="no")
    skipped = re.escape(str(output_dir / "checkpoint-2"))
    used = re.escape(str(output_dir / "checkpoint-1"))
    with pytest.warns(UserWarning, match=rf"Resuming from '{used}', .*'{skipped}' \({INTERRUPTIONS[interruption]}"):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 2
    # Resumed after step 1: the log of step 1 comes from checkpoint-1, step 2 was trained again.
    assert [entry["step"] for entry in trainer.state.log_history if "loss" in entry] == [1, 2]


def test_resuming_a_complete_run_takes_its_last_checkpoint_without_a_warning(two_checkpoints, trl_model_dir, tmp_path):
    from trl_helpers import make_trainer

    output_dir = copied_run(two_checkpoints, tmp_path)
    trainer = make_trainer(trl_model_dir, output_dir, max_steps=2, save_strategy="no")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert trainer._complete_checkpoint(True) == str(output_dir / "checkpoint-2")
    assert not [w for w in caught if "Resuming from" in str(w.message)]


def test_resuming_refuses_a_named_incomplete_checkpoint(two_checkpoints, trl_model_dir, tmp_path):
    from trl_helpers import make_trainer

    output_dir = copied_run(two_checkpoints, tmp_path, interrupted_in_the_weights)
    trainer = make_trainer(trl_model_dir, output_dir, max_steps=2, save_strategy="no")
    named = re.escape(str(output_dir / "checkpoint-2"))
    with pytest.raises(ValueError, match=rf"Cannot resume from '{named}': it has no trainer_state.json"):
        trainer.train(resume_from_checkpoint=str(output_dir / "checkpoint-2"))


def test_resuming_refuses_when_no_checkpoint_is_complete(two_checkpoints, trl_model_dir, tmp_path):
    from trl_helpers import make_trainer

    output_dir = copied_run(two_checkpoints, tmp_path, interrupted_before_the_state)
    interrupted_in_the_state(output_dir / "checkpoint-1")
    trainer = make_trainer(trl_model_dir, output_dir, max_steps=2, save_strategy="no")
    with pytest.raises(ValueError, match=r"found no complete checkpoint in .*checkpoint-2.*checkpoint-1"):
        trainer.train(resume_from_checkpoint=True)


def test_a_checkpoint_with_damaged_weights_but_a_whole_state_is_incomplete(two_checkpoints, tmp_path):
    from trl_integration.trainer import incomplete_checkpoint_problem

    output_dir = copied_run(two_checkpoints, tmp_path)
    assert incomplete_checkpoint_problem(str(output_dir / "checkpoint-2")) is None
    truncated(output_dir / "checkpoint-2" / WEIGHTS)
    problem = incomplete_checkpoint_problem(str(output_dir / "checkpoint-2"))
    assert problem is not None and "adapter_model.safetensors is not a complete safetensors file" in problem
    json.loads((output_dir / "checkpoint-2" / "trainer_state.json").read_text())  # the state itself is whole
