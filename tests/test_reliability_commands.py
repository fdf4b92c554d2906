"""The commands refuse what cannot work with one line, before any work (issue 49, items 9 and 10): `bitune-sft` recipe
flags that a config's own checks refuse, and `--mixed_layers` that the model's depth (read from its config.json) does
not have; `bitune-serve` an adapter whose adapter_config.json is not a PEFT config, and a request body with an integer
longer than Python converts (a 400, like other invalid JSON, not a 500)."""

from __future__ import annotations

import json
import shutil

import pytest

from serving_helpers import BASE, TEMPLATE_FILE

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


# ---------------------------------------------------------------------- item 10: `bitune-serve`
@pytest.mark.parametrize(
    ("content", "message"),
    [
        (lambda config: {k: v for k, v in config.items() if k != "peft_type"}, "has no `peft_type`"),
        (lambda config: {**config, "peft_type": "NO_SUCH_METHOD"}, '`peft_type` "NO_SUCH_METHOD", which is no'),
        (lambda config: [config], "must hold a JSON object"),
        (lambda config: None, "must hold a JSON object"),
    ],
    ids=["no-peft-type", "unknown-peft-type", "list", "null"],
)
def test_bitune_serve_refuses_an_adapter_config_that_is_not_a_peft_config_in_one_line(
    serving_adapter, tmp_path, content, message
):
    """PEFT fails on these with a `TypeError` or `KeyError`, which the server printed as a traceback."""
    pytest.importorskip("fastapi", reason="the serving tests need the `serve` extra")
    from peft_bitune.serving import cli

    broken = tmp_path / "adapter"
    shutil.copytree(serving_adapter, broken)
    config_file = broken / "adapter_config.json"
    config_file.write_text(json.dumps(content(json.loads(config_file.read_text()))))
    with pytest.raises(SystemExit) as error:
        cli.main(["--model", BASE, "--adapter", str(broken), "--chat-template", TEMPLATE_FILE, "--port", "0"])
    refusal = str(error.value.code)
    assert refusal.startswith("bitune-serve: ") and "\n" not in refusal, refusal
    assert str(config_file) in refusal and message in refusal and "adapter again" in refusal, refusal
