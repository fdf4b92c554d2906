"""A Bitune adapter's lifecycle by PEFT's conventions (issue 56, items 1, 2, 4, 5 and 6): deleting the last
adapter, LoRA conversion refused, loading with `low_cpu_mem_usage`, no inner weight-set name in a message, replacing an
adapter by a saved one, a Hub subfolder offline, another method's config, and rows selected from a conversation
cache."""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import huggingface_hub
import pytest
import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora import convert_to_lora

from peft_bitune import BituneConfig, compat
from reference import make_bitune
from tiny_models import VOCAB

LORA = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
INPUTS = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10]]), "prompt_mask": torch.tensor([[1, 1, 1, 1, 0, 0]])}
GREEDY = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model(**INPUTS).logits


@torch.no_grad()
def greedy(model) -> torch.Tensor:
    return model.generate(input_ids=INPUTS["input_ids"][:, :4], **GREEDY)


# ------------------------------------------------------------------------------------------------------------ item 1
@pytest.mark.parametrize("second_active", [True, False], ids=["delete_active_first", "delete_inactive_first"])
def test_the_last_adapter_can_be_deleted_and_the_model_then_runs_as_the_base_model(load_base, second_active):
    """PEFT's `test_delete_adapter` / `test_delete_inactive_adapter`: after the last adapter is deleted,
    `active_adapters == []`, nothing of it is left, and the tuner runs as the base model (what LoRA's layers do with no
    active adapter); `prefill`, which only reads a prompt twice, says there is no adapter."""
    model = make_bitune(load_base("llama"), adapter_config=LoraConfig(**LORA))
    model.add_adapter("delete_me", BituneConfig(adapter_config=LoraConfig(**LORA)))
    if second_active:
        model.set_adapter("delete_me")
    model.delete_adapter("delete_me")
    assert model.active_adapters == ["default"] and list(model.peft_config) == ["default"]

    model.delete_adapter("default")
    assert model.active_adapters == [] and model.base_model.active_adapters == []
    assert not model.peft_config and not model.base_model.bitune_mixers
    assert not any("default" in name or "delete_me" in name for name in model.state_dict())
    base = load_base("llama")
    with torch.no_grad():
        assert torch.equal(model.base_model(input_ids=INPUTS["input_ids"]).logits, base(INPUTS["input_ids"]).logits)
        assert torch.equal(model.base_model.generate(input_ids=INPUTS["input_ids"][:, :4], **GREEDY),
                           base.generate(input_ids=INPUTS["input_ids"][:, :4], **GREEDY))
    with pytest.raises(ValueError, match="no active adapter .*the last one was deleted"):
        model.base_model.prefill(INPUTS["input_ids"])


def test_an_adapter_added_after_the_last_was_deleted_runs_exactly_once_active(load_base, tmp_path):
    """Deleting the only adapter and loading a saved one under its name (the way to replace an adapter by a saved one,
    see item 5) gives exactly the saved adapter, its settings included."""
    saved = make_bitune(load_base("llama"), adapter_config=LoraConfig(**LORA), seed=1, second_pass_attention="causal",
                        mix_scale=0.05)
    saved.save_pretrained(tmp_path)
    model = make_bitune(load_base("llama"), adapter_config=LoraConfig(**LORA))
    model.delete_adapter("default")
    model.load_adapter(str(tmp_path), adapter_name="default")
    model.set_adapter("default")
    assert model.peft_config["default"].second_pass_attention == "causal"
    assert torch.equal(logits(model), logits(saved)) and torch.equal(greedy(model), greedy(saved))


def test_deleting_the_active_adapter_warns_once_with_bitune_names_only(load_base):
    model = make_bitune(load_base("llama"), adapter_config=LoraConfig(**LORA))
    model.add_adapter("other", BituneConfig(adapter_config=LoraConfig(**LORA)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.delete_adapter("default")
    messages = [str(warning.message) for warning in caught if "active" in str(warning.message)]
    assert messages == ["Adapter default was active which is now deleted. Setting active adapter to other."]
    assert model.active_adapters == ["other"]
    layers = model.base_model._router.index.tuner_layers
    assert all(compat.routed_adapters(layer) == ["other__causal"] for layer in layers)


# ------------------------------------------------------------------------------------------------------------ item 2
def test_lora_conversion_is_refused_with_the_reason(load_base):
    model = make_bitune(load_base("llama"), adapter_config=LoraConfig(**LORA))
    assert model.supports_lora_conversion() is False  # PEFT's `test_lora_conversion` then stops
    with pytest.raises(AttributeError, match="cannot be converted to LoRA, since no LoRA of the base model reads"):
        convert_to_lora(model, rank=4)


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_inner_inits_that_change_the_base_weights_are_refused(init):
    """PEFT warns when such an adapter sits next to another; a Bitune adapter always makes two weight sets."""
    with pytest.raises(ValueError, match=rf"`init_lora_weights='{init}'` cannot be used: it changes the base model"):
        BituneConfig(adapter_config=LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=init))


# ------------------------------------------------------------------------------------------------------------ item 4
def test_low_cpu_mem_usage_loads_exactly_what_a_plain_load_does(load_base, tmp_path):
    saved = make_bitune(load_base("llama"), adapter_config=LoraConfig(**LORA), seed=2)
    saved.save_pretrained(tmp_path)
    plain = PeftModel.from_pretrained(load_base("llama"), tmp_path)
    low = PeftModel.from_pretrained(load_base("llama"), tmp_path, low_cpu_mem_usage=True)
    assert not any(param.is_meta for param in low.parameters())
    assert torch.equal(logits(low), logits(plain)) and torch.equal(greedy(low), greedy(plain))
    assert not any(param.requires_grad for param in low.parameters())

    trainable = PeftModel.from_pretrained(load_base("llama"), tmp_path, low_cpu_mem_usage=True, is_trainable=True)
    want = PeftModel.from_pretrained(load_base("llama"), tmp_path, is_trainable=True)
    assert ({name for name, p in trainable.named_parameters() if p.requires_grad}
            == {name for name, p in want.named_parameters() if p.requires_grad})

    plain.load_adapter(str(tmp_path), adapter_name="second", low_cpu_mem_usage=True)
    plain.set_adapter("second")
    assert not any(param.is_meta for param in plain.parameters())
    assert torch.equal(logits(plain), logits(saved))


# ------------------------------------------------------------------------------------------------------------ item 6
def write_hub_snapshot(cache: Path, repo_id: str, folder: Path, label: str) -> None:
    """`folder` (with its subfolders) in an HF cache as huggingface_hub lays it out: blobs, snapshot links, main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(label.encode()).hexdigest()
    for file in sorted(path for path in folder.rglob("*") if path.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / file.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)


def test_a_hub_subfolder_offline_is_refused_before_anything_is_added(load_base, tmp_path, monkeypatch):
    """PEFT's offline loader looks for a subfolder's weights under the subfolder twice and failed after adding the
    adapter; refused before, and the way round the refusal (the snapshot's path) loads exactly."""
    saved = make_bitune(load_base("llama"), adapter_config=LoraConfig(**LORA), seed=3)
    saved.save_pretrained(tmp_path / "repo" / "sub")
    cache = tmp_path / "cache"
    write_hub_snapshot(cache, "user/adapters", tmp_path / "repo", "sub")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    model = make_bitune(load_base("llama"), adapter_config=LoraConfig(**LORA))
    keys = set(model.state_dict())
    refused = r"from its subfolder 'sub' offline: PEFT's loader looks for the weights offline at 'sub/sub/"
    with pytest.raises(ValueError, match=refused):
        model.load_adapter("user/adapters", adapter_name="second", subfolder="sub", cache_dir=str(cache))
    assert list(model.peft_config) == ["default"] and set(model.state_dict()) == keys
    base = load_base("llama")
    names = [name for name, _ in base.named_modules()]
    with pytest.raises(ValueError, match=refused):
        PeftModel.from_pretrained(base, "user/adapters", subfolder="sub", cache_dir=str(cache))
    assert [name for name, _ in base.named_modules()] == names

    snapshot = huggingface_hub.snapshot_download("user/adapters", local_files_only=True, cache_dir=str(cache))
    model.load_adapter(snapshot, adapter_name="second", subfolder="sub")
    model.set_adapter("second")
    assert torch.equal(logits(model), logits(saved))


def test_another_method_s_config_is_named_by_its_type(load_base, tmp_path):
    from peft import get_peft_model

    get_peft_model(load_base("llama"), LoraConfig(**LORA)).save_pretrained(tmp_path)
    named = r"holds a LORA adapter \(\"peft_type\": \"LORA\"\), not a Bitune one"
    with pytest.raises(ValueError, match=named) as error:
        BituneConfig.from_pretrained(str(tmp_path))
    assert "upgrade" not in str(error.value)


def test_rows_selected_from_a_conversation_cache_continue_as_if_they_had_run_alone(load_base):
    """docs/generation.md: after `num_return_sequences` or a batch, select rows from both the sequences and the cache
    (`cache.batch_select_indices`); the next turn of the kept rows equals running them alone from the start."""
    model = make_bitune(load_base("llama"), adapter_config=LoraConfig(**LORA)).eval()
    generator = torch.Generator().manual_seed(4)
    prompts = torch.randint(3, VOCAB, (3, 5), generator=generator)
    follow_up = torch.randint(3, VOCAB, (3, 3), generator=generator)
    settings = dict(GREEDY, return_dict_in_generate=True, output_logits=True)
    kept = torch.tensor([2, 0])

    with torch.no_grad():
        first = model.generate(input_ids=prompts, **settings)
        cache = compat.output_cache(first)
        cache.batch_select_indices(kept)
        second = model.generate(input_ids=torch.cat([first.sequences[kept], follow_up[kept]], dim=1), cache=cache,
                                **settings)
        alone_first = model.generate(input_ids=prompts[kept], **settings)
        alone = model.generate(input_ids=torch.cat([alone_first.sequences, follow_up[kept]], dim=1),
                               cache=compat.output_cache(alone_first), **settings)
    assert torch.equal(second.sequences, alone.sequences)
    for got, want in zip(second.logits, alone.logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert torch.equal(compat.output_cache(second).conversation_ids, second.sequences)


def test_repeated_rows_of_a_conversation_cache_keep_their_record(load_base):
    model = make_bitune(load_base("llama"), adapter_config=LoraConfig(**LORA)).eval()
    prompts = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        out = model.generate(input_ids=prompts, **GREEDY, return_dict_in_generate=True)
    cache = compat.output_cache(out)
    cache.batch_repeat_interleave(2)
    assert torch.equal(cache.conversation_ids, out.sequences.repeat_interleave(2, dim=0))
    assert cache.conversation_mask.shape == (4, out.sequences.shape[1])

