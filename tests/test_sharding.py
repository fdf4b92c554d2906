"""Bitune under sharded data parallelism (FSDP), on 2 CPU processes with gloo, against the same steps in one process.

accelerate turns an FSDP request into plain DDP on a machine without accelerators, so the sharding is applied
directly: FSDP2 `fully_shard` on every decoder layer, then on the root (also with the root's parameters freed after
forward, and a loss recomputed from the logits after an in-place op on them), and through accelerate's own FSDP2
preparation (which also makes units of the embeddings and of the final norm with the LM head); FSDP1 as the
`FullyShardedDataParallel` wrapper with one unit per decoder layer. The DDP test is in test_trl_training.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sharded_training

ROOT = Path(__file__).resolve().parent.parent

CASES = [
    {"name": "fsdp2", "sharding": "fsdp2"},
    {"name": "fsdp2_accelerate", "sharding": "fsdp2_accelerate", "save": True},
    {"name": "fsdp2_checkpointing", "sharding": "fsdp2", "gradient_checkpointing": True},  # non-reentrant
    # The loss recomputed from the logits after an in-place op on them, with the root's parameters freed after forward.
    {"name": "fsdp2_in_place_on_logits", "sharding": "fsdp2_root_resharded", "in_place_on_logits": True},
    # TRL's fused-head call (`fused_lm_head=True`), as every TRL trainer makes it, also with checkpointing.
    {"name": "fsdp2_fused_head", "sharding": "fsdp2", "fused_head": True},
    {"name": "fsdp2_fused_head_checkpointing", "sharding": "fsdp2", "fused_head": True,
     "gradient_checkpointing": True},
    {"name": "fsdp1", "sharding": "fsdp1"},
    # Each process's rows packed into one padding-free row (TRL's `packing`), also checkpointed through the fused head.
    {"name": "fsdp2_packed", "sharding": "fsdp2", "packed": True},
    {"name": "fsdp2_packed_fused_head_checkpointing", "sharding": "fsdp2", "packed": True, "fused_head": True,
     "gradient_checkpointing": True},
    {"name": "fsdp2_layers_only", "sharding": "fsdp2_layers_only"},
    # A multi-head model, whose checkpointed answer pass recomputes both prompt passes' keys/values in its layers.
    {"name": "fsdp2_checkpointing_multi_head", "sharding": "fsdp2", "gradient_checkpointing": True,
     "multi_head": True},
    {"name": "fsdp2_fused_head_checkpointing_multi_head", "sharding": "fsdp2", "fused_head": True,
     "gradient_checkpointing": True, "multi_head": True},
    # Mixing only the upper layer: the bidirectional pass's lower layer is read by no answer layer, only carried
    # through, and its backward must still run inside that layer's FSDP2 gathering.
    {"name": "fsdp2_checkpointing_multi_head_mixing_layer_1", "sharding": "fsdp2", "gradient_checkpointing": True,
     "multi_head": True, "mixed_layers": [1]},
]


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> dict[str, dict]:
    """Every case of `CASES`, trained by one `torchrun` with 2 processes; the outcome of each, by name."""
    output_dir = tmp_path_factory.mktemp("sharded")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
        str(sharded_training.PROCESSES), str(Path(sharded_training.__file__)), str(output_dir), json.dumps(CASES),
    ]
    environment = {
        **os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    # Its own process group, so that a timeout ends the workers too, not only the launcher.
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment,
                                start_new_session=True)
    try:
        _, stderr = launcher.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.communicate()
        raise
    assert launcher.returncode == 0, stderr[-4000:]
    outcomes = {case["name"]: torch.load(output_dir / f"{case['name']}.pt") for case in CASES}
    outcomes["fsdp2_accelerate"]["adapter_dir"] = output_dir / "fsdp2_accelerate"
    return outcomes


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return sharded_training.reference_training()


def _receives_gradient(name: str) -> bool:
    """In the last layer, the bidirectional weights only produce the keys/values of the prompt cache: the others
    (query, output, MLP) get no gradient."""
    last_layer = f"layers.{sharded_training.NUM_LAYERS - 1}."
    kv_projection = ".k_proj." in name or ".v_proj." in name
    return not ("__bidirectional" in name and last_layer in name and not kv_projection)


def test_reference_trains_both_weight_sets_and_the_mixing_scalars(reference):
    before, after = reference
    for kind in ("__causal", "__bidirectional", "bitune_mixers"):
        assert any(kind in name for name in before), kind
    for name in before:
        assert torch.equal(before[name], after[name]) != _receives_gradient(name), name


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        "fsdp2", "fsdp2_accelerate", "fsdp2_checkpointing", "fsdp2_in_place_on_logits", "fsdp2_fused_head",
        "fsdp2_fused_head_checkpointing", "fsdp1", "fsdp2_packed", "fsdp2_packed_fused_head_checkpointing",
    ],
)
def test_sharded_training_matches_one_process(sharded_runs, reference, case):
    check_against_reference(sharded_runs[case], reference, case)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        "fsdp2_checkpointing_multi_head", "fsdp2_fused_head_checkpointing_multi_head",
        "fsdp2_checkpointing_multi_head_mixing_layer_1",
    ],
)
def test_sharded_training_recomputing_the_prompt_keys_values_matches_one_process(sharded_runs, case):
    settings = next(settings for settings in CASES if settings["name"] == case)
    reference = sharded_training.reference_training(multi_head=True, mixed_layers=settings.get("mixed_layers"))
    check_against_reference(sharded_runs[case], reference, case)


def check_against_reference(outcome: dict, reference, case: str) -> None:
    assert "error" not in outcome, outcome.get("error")
    if case.startswith("fsdp2"):
        layers = {f"base_model.model.model.layers.{i}" for i in range(sharded_training.NUM_LAYERS)}
        assert layers | {""} <= set(outcome["fsdp2_units"])  # every decoder layer, and the root
    # FSDP hooks the decoder layers' forwards: the prompt passes run to the end of the decoder.
    assert outcome["stops_early"] is False
    before, expected = reference
    weights = outcome["weights"]
    assert set(weights) == set(expected)
    for name, value in weights.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(value, before[name]) != _receives_gradient(name), name


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", ["fsdp2", "fsdp2_accelerate", "fsdp2_checkpointing", "fsdp2_in_place_on_logits", "fsdp2_fused_head"]
)
def test_fsdp2_units_return_no_views(sharded_runs, case):
    """An in-place op on a view that a unit returned would drop FSDP2's pre-backward hook (which gathers the unit's
    parameters again), and FSDP2 warns about every such output."""
    outcome = sharded_runs[case]
    assert "error" not in outcome, outcome.get("error")
    assert outcome["view_warnings"] == []


@pytest.mark.slow
def test_refuses_sharded_layers_with_unsharded_mixing_scalars(sharded_runs):
    assert "Apply `fully_shard` to the PEFT model itself" in sharded_runs["fsdp2_layers_only"]["error"]


@pytest.mark.slow
def test_adapter_saved_from_the_sharded_model_loads_with_the_trained_weights(sharded_runs, reference):
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(
        sharded_training.build_base(), str(sharded_runs["fsdp2_accelerate"]["adapter_dir"])
    )
    expected = reference[1]
    state = loaded.state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _documented_accelerate_configs() -> list[str]:
    """The accelerate config files shown in docs/training.md, "More than one device"."""
    text = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    section = text.split("\n## More than one device\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```yaml\n(.*?)```", section, flags=re.S)


def test_documented_accelerate_configs_are_valid(tmp_path):
    """Each config of the docs loads in accelerate (which refuses unknown keys), and its FSDP settings are options of
    `accelerate launch`: FSDP2, one unit per decoder layer, without FSDP's own activation checkpointing."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    launch_options = {action.dest for action in launch_command_parser()._actions}
    configs = _documented_accelerate_configs()
    assert len(configs) == 4  # DDP and FSDP2, on one machine and on two
    for number, text in enumerate(configs):
        path = tmp_path / f"{number}.yaml"
        path.write_text(text)
        config = ClusterConfig.from_yaml_file(str(path))
        assert config.num_processes % config.num_machines == 0
        if config.num_machines > 1:
            assert config.main_process_ip and config.main_process_port
        if config.distributed_type == "FSDP":
            assert set(config.fsdp_config) <= launch_options
            assert config.fsdp_config["fsdp_version"] == 2
            assert config.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
            assert config.fsdp_config["fsdp_activation_checkpointing"] is False
