"""The commands refuse what cannot work with one line, before any work (issue 49, item 9): `bitune-sft` recipe flags
that a config's own checks refuse, and `--mixed_layers` that the model's depth (read from its config.json) does not
have."""

from __future__ import annotations

import pytest

from serving_helpers import BASE

# ---------------------------------------------------------------------- item 9: `bitune-sft` recipe flags
REFUSED_RECIPE_FLAGS = [
    (["--mixing_lr_ratio", "nan"], "`mixing_lr_ratio` must be a finite positive number"),
    (["--bidirectional_lr_ratio", "-1"], "`bidirectional_lr_ratio` must be a finite positive number"),
    (["--mixing_warmup_steps", "5", "--max_steps", "2"], "the mixing warm-up (5 steps) is longer than training"),
    (["--mixed_layers", "0", "0"], "`mixed_layers` names a layer more than once"),
    (["--mixed_layers", "9"], "`mixed_layers` names layers [9], but the model has 4 decoder layers"),
]


def sft_arguments(model: str, flags: list[str]) -> list[str]:
    return ["--output_dir", "unused", "--model_name_or_path", model, "--dataset_name", "unused", "--use_cpu",
            "--bf16", "false", "--report_to", "none", *flags]


@pytest.fixture
def nothing_launched_or_loaded(monkeypatch):
    """Fail the test if `bitune-sft` launches a training process, starts training, or loads model weights."""
    import accelerate.commands.launch
    import transformers

    from trl_integration import cli

    monkeypatch.setattr(accelerate.commands.launch, "launch_command", lambda args: pytest.fail("launched"))
    monkeypatch.setattr(cli, "run", lambda *configs: pytest.fail("training started"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *args, **kwargs: pytest.fail("model weights loaded"))


@pytest.mark.parametrize(("flags", "message"), REFUSED_RECIPE_FLAGS,
                         ids=["lr-ratio-nan", "lr-ratio-negative", "warmup-too-long", "layer-twice", "layer-too-deep"])
def test_bitune_sft_refuses_recipe_flags_that_cannot_work_in_one_line_before_anything_loads(
    flags, message, nothing_launched_or_loaded
):
    """Both the launcher (`main`) and the training script (`train`) refuse, with the check's own message."""
    from trl_integration.cli import main, train

    for command in (main, train):
        with pytest.raises(SystemExit) as error:
            command(sft_arguments(BASE, flags))
        refusal = str(error.value.code)
        assert refusal.startswith("bitune-sft: ") and "\n" not in refusal, refusal
        assert message in refusal, refusal


def test_bitune_sft_launches_mixed_layers_the_model_has(monkeypatch):
    import accelerate.commands.launch

    from trl_integration.cli import main

    launched = []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", launched.append)
    main(sft_arguments(BASE, ["--mixed_layers", "0", "3"]))
    assert len(launched) == 1


def test_bitune_sft_leaves_the_depth_check_to_training_where_the_model_config_cannot_be_read(tmp_path, monkeypatch):
    """A model whose config.json cannot be read before launching (here: a folder without one) is not refused for
    its depth by the launcher: the training process checks `mixed_layers` once it has the model (or says why it
    cannot load it)."""
    import accelerate.commands.launch

    from trl_integration.cli import main

    launched = []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", launched.append)
    main(sft_arguments(str(tmp_path), ["--mixed_layers", "9"]))
    assert len(launched) == 1
