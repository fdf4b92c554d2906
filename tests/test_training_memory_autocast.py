"""benchmarks/training_memory.py measures the step as the trainer runs it: with `--autocast`, the forward, the loss and
TRL's metrics under bf16 autocast and the backward after it, as transformers' `Trainer` does with `bf16=True`
(`BituneSFTConfig`'s default); without it, the dtypes as loaded. The report says which."""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import training_memory  # noqa: E402
from models import TINY_SHAPES, training_batch  # noqa: E402

CPU = torch.device("cpu")
SMALL = ["--shapes", "tiny-gemma", "--batch", "2", "--prompt", "8", "--answer", "4", "--methods", "lora", "bitune"]


@pytest.mark.parametrize("method", ["lora", "bitune", "lora_full_logits"])
@pytest.mark.parametrize("autocast", [True, False])
def test_the_step_runs_its_forward_under_autocast_and_its_backward_after_it(method, autocast):
    config = TINY_SHAPES["tiny-gemma"].config()
    model = training_memory.prepared_model(training_memory.base_model(config, CPU, torch.bfloat16, True), method,
                                           checkpointing=False)
    seen = {}

    def record(when: str):
        def hook(*_) -> None:  # returns nothing: the hooked call's arguments are left as they are
            seen.setdefault(when, torch.is_autocast_enabled("cpu"))
        return hook

    embeddings = model.get_input_embeddings()
    embeddings.register_forward_pre_hook(record("forward"))
    embeddings.weight.requires_grad_(True)  # so that the backward reaches it, and its hook says what is on there
    embeddings.register_full_backward_pre_hook(record("backward"))
    batch = training_batch(2, 8, 4, config.vocab_size, CPU)
    fused = method in training_memory.FUSED_HEAD_METHODS
    with training_memory.fused_head_as_on_cuda(CPU) if fused else nullcontext():
        training_memory.step_function(model, method, batch, autocast)()
    assert seen == {"forward": autocast, "backward": False}


def test_the_report_says_whether_it_ran_under_autocast_and_the_peaks_differ(tmp_path):
    plain = training_memory.main([*SMALL, "--json", str(tmp_path / "plain.json")])
    autocast = training_memory.main([*SMALL, "--autocast", "--json", str(tmp_path / "autocast.json")])
    assert plain["settings"]["autocast"] is False and autocast["settings"]["autocast"] is True
    # The adapters are float32 on a bf16 base: under autocast their products and gradients' inputs are bf16.
    peaks, peaks_autocast = plain["shapes"]["tiny-gemma"]["peak_bytes"], autocast["shapes"]["tiny-gemma"]["peak_bytes"]
    assert set(peaks) == set(peaks_autocast)
    assert all(peaks[key] != peaks_autocast[key] for key in peaks), (peaks, peaks_autocast)


def test_a_report_from_before_the_option_is_read_as_without_autocast(tmp_path):
    """Reports written before `--autocast` have no such setting: they were measured without it, and go on so."""
    out = tmp_path / "memory.json"
    first = training_memory.main([*SMALL, "--json", str(out)])
    older = json.loads(json.dumps(first))
    del older["settings"]["autocast"]
    out.write_text(json.dumps(older))
    again = training_memory.main([*SMALL, "--json", str(out), "--remeasure", "bitune"])
    assert again["settings"]["autocast"] is False
    assert again["shapes"]["tiny-gemma"]["peak_bytes"] == first["shapes"]["tiny-gemma"]["peak_bytes"]
    with pytest.raises(SystemExit, match="other settings"):
        training_memory.main([*SMALL, "--autocast", "--json", str(out), "--remeasure", "bitune"])
