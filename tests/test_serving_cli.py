"""The `bitune-serve` command: what is wrong at startup is refused with one line that says what to do, before the
model's weights are read; and the command serves an adapter (fixtures in conftest.py)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai", reason="the serving tests need the `serve` extra")
pytest.importorskip("fastapi", reason="the serving tests need the `serve` extra")

from peft_bitune.serving import cli  # noqa: E402
from serving_helpers import BASE, NAME, REQUEST_TIMEOUT_S, ROOT, STORIES, TEMPLATE_FILE  # noqa: E402


def refusal(arguments: list[str]) -> str:
    """The message `bitune-serve` exits with; it must be one line."""
    with pytest.raises(SystemExit) as error:
        cli.main([*arguments, "--port", "0"])
    message = str(error.value.code)
    assert message.startswith("bitune-serve: ") and "\n" not in message, message
    return message


def test_the_command_refuses_to_start_without_a_chat_template(serving_adapter):
    assert "--chat-template <file>" in refusal(["--model", BASE, "--adapter", serving_adapter])


def test_a_device_torch_cannot_use_here_is_refused(serving_adapter):
    common = ["--model", BASE, "--adapter", serving_adapter, "--chat-template", TEMPLATE_FILE]
    assert "CUDA" in refusal([*common, "--device", "cuda:99"])  # no GPU, or not that many: either way refused
    assert "not a torch device" in refusal([*common, "--device", "gpu-please"])


def test_a_missing_or_truncated_adapter_is_refused(serving_adapter, tmp_path):
    common = ["--model", BASE, "--chat-template", TEMPLATE_FILE]
    message = refusal([*common, "--adapter", str(tmp_path / "no-such-adapter")])
    assert "cannot read the adapter" in message and "adapter_config.json" in message
    truncated = tmp_path / "truncated"
    shutil.copytree(serving_adapter, truncated)
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    message = refusal([*common, "--adapter", str(truncated)])
    assert "adapter_model.safetensors" in message and "truncated" in message
    assert ".." not in message and message.count("adapter again") == 1  # one sentence of advice, said once


def test_an_adapter_the_tuner_refuses_is_refused_in_one_sentence_without_a_stray_hint(serving_adapter, tmp_path):
    """A refusal of the project's own (here: a layer the base model does not have) already says what to do."""
    broken = tmp_path / "layer-99"
    shutil.copytree(serving_adapter, broken)
    config = json.loads((broken / "adapter_config.json").read_text())
    config["mixed_layers"] = [99]
    (broken / "adapter_config.json").write_text(json.dumps(config))
    message = refusal(["--model", BASE, "--chat-template", TEMPLATE_FILE, "--adapter", str(broken)])
    assert "99" in message and ".." not in message and "truncated or corrupt" not in message


def test_a_port_in_use_is_refused(serving_adapter):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as error:
            cli.main(["--model", BASE, "--adapter", serving_adapter, "--chat-template", TEMPLATE_FILE,
                      "--port", str(port)])
    message = str(error.value.code)
    assert f"cannot listen on 127.0.0.1:{port}" in message and "--port" in message and "\n" not in message


def test_a_chat_template_that_does_not_render_is_refused_at_startup(serving_adapter, tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for message in messages %}{{ message['content'] }}{% endfor")  # a syntax error
    message = refusal(["--model", BASE, "--adapter", serving_adapter, "--chat-template", str(broken)])
    assert "fails on a plain conversation" in message and "TemplateSyntaxError" in message
    failing = tmp_path / "failing.jinja"
    failing.write_text("{{ raise_exception('this template only takes system messages') }}")
    assert "only takes system messages" in refusal(
        ["--model", BASE, "--adapter", serving_adapter, "--chat-template", str(failing)])


def test_a_chat_template_without_generation_markers_is_refused_at_startup(serving_adapter, serving_template, tmp_path):
    """TRL cannot train an alternating adapter's conversations on it (`assistant_only_loss`), so it is not served."""
    unmarked = tmp_path / "unmarked.jinja"
    unmarked.write_text(serving_template.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    message = refusal(["--model", BASE, "--adapter", serving_adapter, "--chat-template", str(unmarked)])
    assert "--chat-template" in message and "{% generation %}" in message and "patching is not supported" in message


def test_the_api_key_comes_from_the_flag_or_the_environment(monkeypatch):
    required = ["--model", BASE, "--adapter", "x"]
    monkeypatch.setenv(cli.API_KEY_VARIABLE, "from-env")
    assert cli.parse_args(required).settings.api_keys == ("from-env",)
    assert cli.parse_args([*required, "--api-key", "a", "--api-key", "b"]).settings.api_keys == ("a", "b")
    monkeypatch.delenv(cli.API_KEY_VARIABLE)
    assert cli.parse_args(required).settings.api_keys == ()


@pytest.mark.slow  # a fresh Python process imports torch, transformers and FastAPI: about half a minute on 2 cores
def test_the_command_serves_the_adapter_behind_its_api_key(serving_adapter):
    command = [sys.executable, "-m", "peft_bitune.serving.cli", "--model", BASE, "--adapter", serving_adapter,
               "--chat-template", TEMPLATE_FILE, "--port", "0", "--served-model-name", NAME]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           cli.API_KEY_VARIABLE: "secret"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = process.stdout.readline()
        assert "serving" in line, line
        url = line.split(" on ")[-1].strip()
        assert url.startswith("http://127.0.0.1:")
        settings = dict(model=NAME, messages=[{"role": "user", "content": STORIES[0]}], max_tokens=2, temperature=0)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).chat.completions.create(**settings)
        client = openai.OpenAI(base_url=url + "/v1", api_key="secret", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        assert client.chat.completions.create(**settings).usage.completion_tokens <= 2
    finally:
        process.terminate()
        process.wait(timeout=30)


def parse_refusal(arguments: list[str]) -> str:
    """The one line `bitune-serve` exits with while reading its flags (before anything is loaded)."""
    with pytest.raises(SystemExit) as error:
        cli.parse_args(["--model", BASE, "--adapter", "x", *arguments])
    message = str(error.value.code)
    assert message.startswith("bitune-serve: ") and "\n" not in message, message
    return message


def test_batch_limits_below_one_are_refused_before_any_work():
    assert cli.parse_args(["--model", BASE, "--adapter", "x"]).limits.max_batch_size == 8  # the measured default
    for flag in ("--max-batch-size", "--max-batch-tokens"):
        assert f"{flag} must be at least 1, got 0." in parse_refusal([flag, "0"])


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999", "1e308"])
def test_a_cache_budget_that_is_not_a_finite_number_of_bytes_is_refused_in_one_line(value):
    assert "--cache-memory-mb" in parse_refusal([f"--cache-memory-mb={value}"])


@pytest.mark.parametrize("flag", ["--port", "--max-request-bytes", "--max-batch-size", "--max-batch-tokens"])
def test_integer_flags_beyond_64_bits_are_refused_in_one_line(flag):
    assert f"{flag} must fit in 64 bits" in parse_refusal([flag, str(2**64)])


@pytest.mark.parametrize("key", ["clé", "tab\tkey", " padded", "日本"])
def test_an_api_key_that_is_not_printable_ascii_is_refused_at_startup(key, monkeypatch):
    assert "--api-key" in parse_refusal(["--api-key", key])
    monkeypatch.setenv(cli.API_KEY_VARIABLE, key)
    assert cli.API_KEY_VARIABLE in parse_refusal([])
    command = cli.parse_args(["--model", BASE, "--adapter", "x", "--api-key", "sk-Abc_123~!"])
    assert command.settings.api_keys == ("sk-Abc_123~!",)


def test_a_reduced_precision_server_that_batches_says_that_batching_may_change_answers():
    """docs/serving.md, "Precision": exact in float32 or one request at a time; in bfloat16 and float16 the server
    says at startup that a batched answer can differ, and how to make it exact."""
    for dtype in ("bfloat16", "float16"):
        note = cli.precision_note(dtype, 8)
        assert note.startswith("bitune-serve: note: ") and dtype in note and "--dtype float32" in note
        assert "\n" not in note and cli.precision_note(dtype, 1) is None
    assert cli.precision_note("float32", 8) is None
