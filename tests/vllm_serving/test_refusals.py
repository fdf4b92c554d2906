"""What the plugin cannot serve exactly is refused before an engine starts, in one line naming the cause and fix."""

from __future__ import annotations

import pytest
import torch
from helpers import save_adapter, save_base
from peft import IA3Config, LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Phi3Config

from peft_bitune import BituneConfig
from vllm_integration import load_llm

CONFLICTS = [
    ({"enable_prefix_caching": True}, "enable_prefix_caching"),
    ({"enable_chunked_prefill": True}, "enable_chunked_prefill"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"enforce_eager": False}, "enforce_eager"),
    ({"max_model_len": 64, "max_num_batched_tokens": 32}, "max_num_batched_tokens"),
    ({"hf_overrides": {"architectures": ["LlamaForCausalLM"]}}, "hf_overrides"),
]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("refusals")
    return save_adapter(save_base("llama", str(root / "base")), str(root / "adapter"))


@pytest.mark.parametrize(("options", "named"), CONFLICTS)
def test_conflicting_engine_options_are_refused(adapter, options, named):
    with pytest.raises(ValueError, match=named):
        load_llm(adapter, **options)


def test_another_architecture_is_refused_by_name(tmp_path):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(Phi3Config(vocab_size=96, hidden_size=64, intermediate_size=128,
                                                       num_hidden_layers=2, num_attention_heads=2,
                                                       pad_token_id=0, bos_token_id=1, eos_token_id=2))
    base.save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    get_peft_model(base, BituneConfig(adapter_config=LoraConfig(r=2, target_modules="all-linear"))).save_pretrained(
        tmp_path / "adapter")
    with pytest.raises(ValueError, match="Phi3ForCausalLM"):
        load_llm(str(tmp_path / "adapter"))


@pytest.mark.parametrize(("inner", "named"), [
    (LoraConfig(r=2, target_modules="all-linear", use_dora=True), "DoRA"),
    (IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]), "IA3"),
])
def test_inner_methods_it_does_not_compute_are_refused_by_name(tmp_path, inner, named):
    base_folder = save_base("llama", str(tmp_path / "base"))
    base = AutoModelForCausalLM.from_pretrained(base_folder)
    get_peft_model(base, BituneConfig(adapter_config=inner)).save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match=named):
        load_llm(str(tmp_path / "adapter"))
