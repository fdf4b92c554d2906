"""`bitune-sft`, the command line of `BituneSFTTrainer`: training from flags, launching through accelerate, and its
parser (TRL's flags and every Bitune setting)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
from peft import PeftConfig

import trl_helpers as helpers
from peft_bitune import BituneConfig, compat
from trl_integration.cli import TRAINING_MODULE, BituneArguments, make_parser
from trl_integration.cli import main as cli_main
from trl_integration.cli import train as cli_train

datasets.disable_progress_bars()


def write_jsonl_dataset(directory: Path, rows: list[dict]) -> Path:
    directory.mkdir()
    with open(directory / "train.jsonl", "w") as file:
        for row in rows:
            file.write(json.dumps(row) + "\n")
    return directory


CLI_TRAINING_FLAGS = [
    "--max_steps", "2", "--per_device_train_batch_size", "4", "--learning_rate", "1e-2", "--bf16", "false",
    f"--{compat.CHECKPOINTING_ARGUMENT}", "false", "--use_cpu", "--report_to", "none", "--save_strategy", "no",
]


def test_cli_trains_and_saves_a_bitune_adapter(tmp_path, trl_model_dir):
    data = write_jsonl_dataset(tmp_path / "data", helpers.prompt_completion_rows(8))
    output = tmp_path / "out"
    cli_train([
        "--model_name_or_path", trl_model_dir, "--dataset_name", str(data), "--output_dir", str(output),
        *CLI_TRAINING_FLAGS, "--lora_r", "4", "--mix_init", "0.02", "--second_pass_attention", "causal",
    ])
    saved = json.loads((output / "adapter_config.json").read_text())
    assert saved["peft_type"] == "BITUNE"
    assert saved["mix_init"] == 0.02 and saved["second_pass_attention"] == "causal"
    assert saved["adapter_config"]["r"] == 4 and saved["adapter_config"]["lora_alpha"] == 16  # Bitune's default alpha
    assert saved["adapter_config"]["target_modules"] == "all-linear"
    assert (output / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_bitune_sft_launches_through_accelerate_like_trl_sft(tmp_path, trl_model_dir):
    """`--num_processes 1` (an `accelerate launch` flag, refused before) goes to the launcher, the rest to the
    training script, which runs in a process of its own; `--use_peft` (as in `trl sft` commands) is accepted."""
    data = write_jsonl_dataset(tmp_path / "data", helpers.prompt_completion_rows(8))
    output = tmp_path / "out"
    command = [
        sys.executable, "-c", "from trl_integration.cli import main; main()",
        "--model_name_or_path", trl_model_dir, "--dataset_name", str(data), "--output_dir", str(output),
        *CLI_TRAINING_FLAGS, "--num_processes", "1", "--use_peft", "--lora_r", "4",
    ]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"Bitune adapter saved to {output}" in result.stdout
    saved = json.loads((output / "adapter_config.json").read_text())
    assert saved["peft_type"] == "BITUNE" and saved["adapter_config"]["r"] == 4


def test_cli_refuses_an_empty_data_file_by_name(tmp_path, trl_model_dir):
    data = write_jsonl_dataset(tmp_path / "data", [])
    with pytest.raises(ValueError, match=r"the data file .*/data/train\.jsonl is empty"):
        cli_train(["--model_name_or_path", trl_model_dir, "--dataset_name", str(data),
                   "--output_dir", str(tmp_path / "o"),
                   *CLI_TRAINING_FLAGS])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dataset_train_split", "nosuch"],
         r"`--dataset_train_split nosuch`: .* has no split 'nosuch'; its splits are \['train'\]"),
        (["--eval_strategy", "steps", "--eval_steps", "1"],
         r"`--dataset_test_split test`, but .* has no split 'test'; its splits are \['train'\].*--eval_strategy no"),
    ],
    ids=["train-split", "test-split"],
)
def test_cli_refuses_a_split_the_dataset_does_not_have(tmp_path, trl_model_dir, flags, message):
    data = write_jsonl_dataset(tmp_path / "data", helpers.prompt_completion_rows(8))
    with pytest.raises(ValueError, match=message):
        cli_train(["--model_name_or_path", trl_model_dir, "--dataset_name", str(data),
                   "--output_dir", str(tmp_path / "o"),
                   *CLI_TRAINING_FLAGS, *flags])


def test_cli_refuses_a_max_length_that_truncation_leaves_no_row_to_train_on(tmp_path, trl_model_dir):
    data = write_jsonl_dataset(tmp_path / "data", helpers.prompt_completion_rows(8))
    with pytest.raises(ValueError, match=r"Every row of `train_dataset` \(8\) was dropped .* `max_length=8`"):
        cli_train(["--model_name_or_path", trl_model_dir, "--dataset_name", str(data),
                   "--output_dir", str(tmp_path / "o"),
                   *CLI_TRAINING_FLAGS, "--max_length", "8"])


@pytest.mark.slow
def test_bitune_sft_shows_the_training_process_error_last_and_exits_non_zero(tmp_path, trl_model_dir):
    """The launcher's own error (`CalledProcessError`) would otherwise be the last thing printed."""
    data = write_jsonl_dataset(tmp_path / "data", helpers.prompt_completion_rows(8))
    command = [
        sys.executable, "-c", "from trl_integration.cli import main; main()",
        "--model_name_or_path", trl_model_dir, "--dataset_name", str(data), "--output_dir", str(tmp_path / "out"),
        *CLI_TRAINING_FLAGS, "--num_processes", "1", "--dataset_train_split", "nosuch",
    ]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("bitune-sft: training failed: ValueError: `--dataset_train_split nosuch`"), (
        result.stderr[-3000:]
    )


def test_bitune_sft_reports_a_training_process_killed_without_an_error(tmp_path, monkeypatch, capsys):
    import accelerate.commands.launch

    def killed(args):
        assert os.environ["TORCHELASTIC_ERROR_FILE"]  # where a failing process records its error (`@record`)
        raise subprocess.CalledProcessError(returncode=137, cmd=["python"])

    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", killed)
    with pytest.raises(SystemExit) as exit_status:
        cli_main(["--output_dir", str(tmp_path), "--use_cpu"])
    assert exit_status.value.code == 137
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "bitune-sft: training failed: the training process exited with status 137 without reporting an error"
    )
    assert "TORCHELASTIC_ERROR_FILE" not in os.environ


def test_bitune_sft_shows_the_error_of_the_first_failed_process_of_several(tmp_path, monkeypatch, capsys):
    """Several processes run under torchrun, which gives each its own error file and raises `ChildFailedError`."""
    import accelerate.commands.launch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure, record

    def failing_process():
        raise ValueError("no row left")

    error_file = tmp_path / "rank1.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(ValueError):
        record(failing_process)()
    failure = ProcessFailure(local_rank=1, pid=12, exitcode=1, error_file=str(error_file))

    def several_failed(args):
        raise ChildFailedError(TRAINING_MODULE, {1: failure})

    monkeypatch.setattr(accelerate.commands.launch, "launch_command", several_failed)
    with pytest.raises(SystemExit) as exit_status:
        cli_main(["--output_dir", str(tmp_path), "--use_cpu"])
    assert exit_status.value.code == 1
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line == "bitune-sft: training failed: ValueError: no row left"


def test_bitune_sft_hands_the_launcher_its_arguments_and_the_script_the_rest(tmp_path, monkeypatch):
    import accelerate.commands.launch

    launched = []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", launched.append)
    training = ["--output_dir", str(tmp_path), "--use_cpu", "--mix_init", "0.02", "--lora_r", "4"]
    cli_main([*training[:3], "--num_processes", "1", *training[3:], "--main_process_port", "0"])
    (args,) = launched
    assert args.num_processes == 1 and args.main_process_port == 0
    assert args.module and args.training_script == TRAINING_MODULE
    assert args.training_script_args == training


def test_bitune_sft_refuses_arguments_neither_training_nor_launcher_knows(tmp_path):
    with pytest.raises(ValueError, match=r"Unknown arguments \['--learnin_rate'.*accelerate launch"):
        cli_main(["--output_dir", str(tmp_path), "--use_cpu", "--learnin_rate", "1"])


def test_cli_refuses_to_turn_peft_off(tmp_path):
    for flags in (["--use_peft", "false"], ["--no_use_peft"]):
        with pytest.raises(ValueError, match="always trains a Bitune adapter"):
            make_parser().parse_args_and_config(["--output_dir", str(tmp_path), "--use_cpu", *flags])


def test_cli_covers_every_bitune_setting():
    """Each `BituneConfig` field of its own (not PEFT's, not the weight-set method, not a record of the base model) is
    a `bitune-sft` flag."""
    records = {"base_model_vocab_size", "base_model_num_hidden_layers"}
    own_fields = (
        set(BituneConfig.__dataclass_fields__) - set(PeftConfig.__dataclass_fields__) - {"adapter_config"} - records
    )
    assert set(BituneArguments.__dataclass_fields__) == own_fields


def test_cli_parser_offers_trl_and_bitune_flags():
    help_text = make_parser().format_help()
    for flag in ("--model_name_or_path", "--dataset_name", "--lora_r", "--assistant_only_loss", "--mix_init",
                 "--shared_weights", "--mixing_logging_steps"):
        assert flag in help_text
    assert "use_peft" not in help_text  # always on
    # The LoRA defaults are Bitune's, and the help says how they differ from `trl sft`'s.
    assert " ".join(help_text.split()).count("`trl sft` uses") == 4


def help_section(help_text: str, title: str) -> str:
    """The lines of `--help`'s section `title` (up to the next section)."""
    start = help_text.index(f"\n{title}:\n") + len(title) + 3
    end = help_text.find("\n\n", start)
    return help_text[start:] if end < 0 else help_text[start:end]


def test_help_starts_with_what_it_does_and_bitunes_options_and_marks_the_refused_ones():
    """`bitune-sft --help` was 921 lines with no description, Bitune's options last, and refused options offered
    without saying so: now a short usage, a description, Bitune's options, the options with refused values marked,
    then TRL's and transformers' options as in `trl sft`."""
    help_text = make_parser().format_help()
    lines = help_text.splitlines()
    assert lines[0].startswith("usage: bitune-sft --model_name_or_path") and len(help_text.split("\n\n")[0]) < 300
    assert "Bitune adapter" in lines[2]  # the description, right after the usage
    titles = [line[:-1] for line in lines if line and not line.startswith(" ") and line.endswith(":")]
    assert titles == ["example", "Bitune options", "Options with values bitune-sft refuses",
                      "TRL's and transformers' options (as `trl sft`)"], titles
    bitune = help_section(help_text, "Bitune options")
    for flag in ("--mix_init", "--mixed_layers", "--multi_turn", "--shared_weights", "--lora_r", "--lora_alpha",
                 "--lora_target_modules", "--mixing_lr_ratio", "--bidirectional_lr_ratio", "--mixing_warmup_steps",
                 "--mixing_logging_steps"):
        assert flag in bitune, flag
    refused = " ".join(help_section(help_text, "Options with values bitune-sft refuses").split())
    assert "--packing_strategy" in refused and "Refused: 'wrapped', since it cuts examples anywhere" in refused
    others = help_section(help_text, "TRL's and transformers' options (as `trl sft`)")
    for flag in ("--packing", "--padding_free", "--eval_packing"):  # packing is read example by example
        assert f"  {flag} " in others and help_text.count(f"  {flag} ") == 1, flag
    assert "  --learning_rate " in others


def test_the_value_the_help_marks_refused_is_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"bitune-sft: `packing_strategy='wrapped'` is not supported by Bitune"):
        cli_train(["--output_dir", str(tmp_path), "--use_cpu", "--model_name_or_path", "unused", "--packing", "true",
                   "--packing_strategy", "wrapped"])


@pytest.mark.parametrize("flags", [
    ["--learning_rate", "nan"], ["--num_train_epochs", "inf"], ["--max_grad_norm", "1e999"], ["--mix_init", "nan"],
    ["--seed", str(2**64)], ["--lora_r", str(2**70)],
])
def test_bitune_sft_refuses_numbers_that_parse_but_cannot_be_used_in_one_line(flags, monkeypatch):
    """nan, inf and integers beyond 64 bits parse (Python's float and int), then trained on nan or failed later with
    a traceback; both the launcher and the training script refuse them first, naming the flag."""
    import accelerate.commands.launch

    monkeypatch.setattr(accelerate.commands.launch, "launch_command", lambda args: pytest.fail("launched"))
    arguments = ["--output_dir", "unused", "--model_name_or_path", "unused", "--use_cpu", "--bf16", "false", *flags]
    for command in (cli_main, cli_train):
        with pytest.raises(SystemExit) as error:
            command(arguments)
        message = str(error.value.code)
        assert message.startswith(f"bitune-sft: `{flags[0]}` must ") and "\n" not in message, message
