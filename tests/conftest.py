"""
Tiny random models of every supported architecture, saved and loaded back through transformers' real loading code.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch
from transformers import AutoModelForCausalLM

import peft_bitune  # noqa: F401  (registers the BITUNE peft type)
from tiny_models import model_configs

# The test models are tiny: one thread avoids thread hand-off costs that dominate at this size (and oversubscription).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def saved_models(tmp_path_factory) -> dict[str, str]:
    """Each architecture's tiny random model, written once with `save_pretrained`."""
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for name, config in model_configs().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        path = root / name
        model.save_pretrained(path)
        paths[name] = str(path)
    return paths


@pytest.fixture(scope="session")
def load_base(saved_models):
    """`load_base(arch, attn_implementation="eager", dtype=torch.float32)` -> a fresh base model."""

    def load(arch: str, attn_implementation: str = "eager", dtype: torch.dtype = torch.float32):
        model = AutoModelForCausalLM.from_pretrained(
            saved_models[arch], attn_implementation=attn_implementation, dtype=dtype
        )
        return model.eval()

    return load


@pytest.fixture(scope="session")
def trl_model_dir(tmp_path_factory) -> str:
    """The TRL tests' tiny Llama and word-level tokenizer, saved in one folder (usable as `model_name_or_path`)."""
    import trl_helpers

    return trl_helpers.save_model_and_tokenizer(tmp_path_factory.mktemp("trl_model"))
