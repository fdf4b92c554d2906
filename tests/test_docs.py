"""
The README, the documentation site and the examples cannot rot: every code block that can run here is run.

Code blocks of README.md and docs/**/*.md, in the order they appear:

- `python` blocks of one file run in one namespace, like the cells of a notebook;
- `bash` blocks run with bash (`-e -o pipefail`), with this Python's scripts (`python`, `bitune-sft`, ...) on the PATH;
- blocks of the languages in `NOT_CODE` (diagrams, output, templates) are not run; any other language, or a fence
  without one, fails the test, so that nothing is silently left out.

Both run in a scratch folder that holds `examples/` (a link to the repository's), so that the blocks' relative paths
(`examples/miniature/base`, `out/...`) work as they do for a reader at the repository root. Nothing can reach the
Hugging Face Hub: `peft_bitune.push_to_hub` uploads into a local folder named like the repo (`your-name/model`), which
`from_pretrained("your-name/model")` then reads as a local path, so that upload and download are both exercised.

A block that cannot run here is marked on the line before its fence, with the reason:

    <!-- docs-test: skip (needs the Hugging Face Hub and a GPU) -->

A skipped block must still parse (`compile` for Python, `bash -n` for bash).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
MINIATURE_BASE = EXAMPLES / "miniature" / "base"
README = REPO / "README.md"
DOCUMENTS = [README, *sorted((REPO / "docs").rglob("*.md"))]

PYTHON = {"python", "py"}
SHELL = {"bash", "sh", "shell"}
NOT_CODE = {"text", "mermaid", "jinja", "yaml", "json", "markdown", "console"}

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)[^\n]*$")
MARKER = re.compile(r"<!--\s*docs-test:(?P<body>.*?)-->")
SKIP = re.compile(r"^\s*skip\s*\((?P<reason>[^()]*\S[^()]*)\)\s*$")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    skip_reason: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def extract_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, with the skip marker (if any) on the line before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        end = index + 1
        while end < len(lines) and not re.match(rf"^{re.escape(indent)}{re.escape(fence)}\s*$", lines[end]):
            end += 1
        if end == len(lines):
            raise AssertionError(f"{path.relative_to(REPO)}:{index + 1}: the code fence is never closed.")
        body = textwrap.dedent("\n".join(line[len(indent):] if line.startswith(indent) else line
                                         for line in lines[index + 1 : end]))
        blocks.append(Block(path, index + 1, opening["lang"].lower(), body + "\n", _skip_reason(path, lines, index)))
        index = end + 1
    return blocks


def _skip_reason(path: Path, lines: list[str], fence_index: int) -> str | None:
    previous = next((lines[i] for i in range(fence_index - 1, -1, -1) if lines[i].strip()), "")
    marker = MARKER.search(previous)
    if marker is None:
        return None
    skip = SKIP.match(marker["body"])
    if skip is None:
        raise AssertionError(
            f"{path.relative_to(REPO)}:{fence_index + 1}: unknown docs-test marker {previous.strip()!r}; the only "
            "marker is `<!-- docs-test: skip (reason) -->`, and it needs a reason."
        )
    return skip["reason"].strip()


def all_blocks() -> list[Block]:
    return [block for path in DOCUMENTS for block in extract_blocks(path)]


# ---------------------------------------------------------------------------------------------------- the Hub stand-in
class LocalHubApi:
    """What `peft_bitune.push_to_hub` calls on `HfApi`, writing the repo `user/name` into the folder `user/name`."""

    def __init__(self, *args, **kwargs) -> None:
        self.root = Path.cwd()

    def create_repo(self, repo_id: str, **kwargs) -> SimpleNamespace:
        (self.root / repo_id).mkdir(parents=True, exist_ok=True)
        return SimpleNamespace(repo_id=repo_id)

    def create_branch(self, repo_id: str, branch: str, **kwargs) -> None:
        raise AssertionError("The documentation pushes to the main branch only; the stand-in has no branches.")

    def upload_folder(self, repo_id: str, folder_path: str, revision: str | None = None, **kwargs) -> SimpleNamespace:
        assert revision is None, "the stand-in has no branches"
        shutil.copytree(folder_path, self.root / repo_id, dirs_exist_ok=True)
        return SimpleNamespace(commit_url=f"local://{repo_id}")


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """A scratch folder that looks like the repository root to the blocks, with the Hub stand-in installed."""
    import peft_bitune.persistence.hub

    (tmp_path / "examples").symlink_to(EXAMPLES, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(peft_bitune.persistence.hub, "HfApi", LocalHubApi)
    return tmp_path


def shell_environment() -> dict[str, str]:
    environment = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", NO_MKDOCS_2_WARNING="1")
    environment["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), environment.get("PATH", "")])
    return environment


def run_shell(code: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", code], cwd=cwd, env=shell_environment(), capture_output=True,
        text=True, timeout=timeout,
    )


def runnable(path: Path) -> list[Block]:
    return [block for block in extract_blocks(path) if block.skip_reason is None and block.language not in NOT_CODE]


def require_miniature() -> None:
    assert MINIATURE_BASE.is_dir(), (
        f"The embedded miniature model ({MINIATURE_BASE}) is missing; the documentation's examples and the "
        "quickstart run on it. Build it with examples/miniature/pretrain.py or restore it from git."
    )


# ---------------------------------------------------------------------------------------------------- the blocks
def test_every_block_is_labelled_and_every_skipped_block_parses():
    blocks = all_blocks()
    assert len(blocks) > 20, "the documentation lost most of its code blocks"
    for block in blocks:
        known = PYTHON | SHELL | NOT_CODE
        assert block.language in known, (
            f"{block.where}: a code block needs a language, one of {sorted(known)}; got {block.language!r}."
        )
        if block.skip_reason is None:
            continue
        if block.language in PYTHON:
            compile(block.code, block.where, "exec")
        elif block.language in SHELL:
            result = subprocess.run(["bash", "-n", "-c", block.code], capture_output=True, text=True)
            assert result.returncode == 0, f"{block.where}: {result.stderr}"


def test_marker_parsing():
    """The extraction itself: indented fences, markers with and without reasons, unknown markers."""
    sample = REPO / "tests" / "_sample_docs.md"
    try:
        sample.write_text(
            "<!-- docs-test: skip (needs a GPU) -->\n```python\nx = 1\n```\n\n1. step\n\n    ```bash\n    echo hi\n"
            "    ```\n\n```text\nout\n```\n", encoding="utf-8",
        )
        blocks = extract_blocks(sample)
        assert [(b.language, b.code, b.skip_reason) for b in blocks] == [
            ("python", "x = 1\n", "needs a GPU"), ("bash", "echo hi\n", None), ("text", "out\n", None),
        ]
        sample.write_text("<!-- docs-test: skip -->\n```python\nx = 1\n```\n", encoding="utf-8")
        with pytest.raises(AssertionError, match="needs a reason"):
            extract_blocks(sample)
        sample.write_text("<!-- docs-test: run -->\n```python\nx = 1\n```\n", encoding="utf-8")
        with pytest.raises(AssertionError, match="unknown docs-test marker"):
            extract_blocks(sample)
    finally:
        sample.unlink(missing_ok=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "path",
    [p for p in DOCUMENTS if runnable(p) and p != README],  # the README's usage block runs as is, below
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_code_blocks_run(path, workspace):
    require_miniature()
    namespace = {"__name__": "__docs__"}
    for block in runnable(path):
        if block.language in PYTHON:
            try:
                exec(compile(block.code, block.where, "exec"), namespace)
            except Exception as error:
                raise AssertionError(f"{block.where}: the block failed: {error!r}") from error
        else:
            result = run_shell(block.code, workspace)
            assert result.returncode == 0, f"{block.where}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"


def readme_usage() -> str:
    (block,) = [block for block in runnable(README) if block.language in PYTHON]
    return block.code


@pytest.mark.slow
def test_readme_usage_runs_as_is_offline_without_a_token(tmp_path):
    """As a reader runs it: a fresh Python, offline, no Hub token configured, nothing faked."""
    require_miniature()
    (tmp_path / "examples").symlink_to(EXAMPLES, target_is_directory=True)
    (tmp_path / "usage.py").write_text(readme_usage(), encoding="utf-8")
    environment = {key: value for key, value in shell_environment().items() if key != "HF_TOKEN"}
    environment.update(HF_HOME=str(tmp_path / "hf_home"), PYTHONPATH=os.pathsep.join([str(REPO), environment.get(
        "PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "usage.py"], cwd=tmp_path, env=environment, capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "'keys': tensor([" in result.stdout
    assert (tmp_path / "out" / "readme" / "adapter" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "your-name").exists()


def test_readme_usage_pushes_only_when_a_token_is_configured(workspace, monkeypatch):
    """The usage block's save/push/load lines, on an untrained adapter: with a token (and the Hub on) they push to
    the user's repo (the local stand-in) and load from there; without one they load from the saved folder."""
    import huggingface_hub
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    import peft_bitune

    code = readme_usage()
    tail = code[code.index('location = "out/readme/adapter"'):]
    for token, expected in ((None, "out/readme/adapter"), ("hf_test", "your-name/miniature-bitune")):
        monkeypatch.setattr(huggingface_hub, "get_token", lambda: token)
        monkeypatch.setattr(huggingface_hub, "whoami", lambda: {"name": "your-name"})
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        base_id = str(MINIATURE_BASE)
        namespace = {
            "base_id": base_id,
            "huggingface_hub": huggingface_hub,
            "peft_bitune": peft_bitune,
            "PeftModel": PeftModel,
            "AutoModelForCausalLM": AutoModelForCausalLM,
            "model": get_peft_model(AutoModelForCausalLM.from_pretrained(base_id), peft_bitune.BituneConfig()),
        }
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(tail, "README.md (usage block)", "exec"), namespace)
        assert namespace["location"] == expected
        assert (workspace / expected / "adapter_model.safetensors").is_file()
        assert (workspace / "your-name").exists() == (token is not None)


def test_readme_keeps_the_two_setup_commands():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "pip install torch==2.13.0 && pip install -e" in readme and "python examples/quickstart.py" in readme
    assert "bash .ci/run" in readme
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r'"\$python" -m pytest -q "\$\{PARALLEL\[@\]\}" &&\n', ci)  # the whole suite, in the newest job
    assert "PARALLEL=(-n auto --maxprocesses 4)" in ci and "pytest -q -n auto --maxprocesses 4" in readme
    assert "lower_bound" in ci and "OLDEST_SUBSET" in ci  # the oldest declared versions, a subset


# ---------------------------------------------------------------------------------------------------- the site
def test_how_long_an_example_runs_is_a_measured_figure():
    """Issue 55, item 15: docs/preference-and-rl.md said its DPO example runs "in a few seconds" on a CPU; it took
    47 s. No page says "a few seconds" of an example; that one states what was measured."""
    vague = [path.name for path in DOCUMENTS if "a few seconds" in path.read_text(encoding="utf-8")]
    assert vague == []
    page = " ".join((REPO / "docs" / "preference-and-rl.md").read_text(encoding="utf-8").split())
    assert "47 s on a fresh clone (issue 55)" in page and "14 s for SFT and 53 s for DPO" in page


@pytest.mark.slow
def test_mkdocs_build_is_strict_clean(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, env=shell_environment(), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "reference" / "index.html").read_text(encoding="utf-8").count("mix_init") > 0


def test_every_page_is_in_the_navigation():
    config = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    navigation = set(re.findall(r"^\s*-\s+[^:\n]+:\s+(\S+\.md)\s*$", config, flags=re.M))
    pages = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    assert pages == navigation, (
        f"pages not in the nav: {sorted(pages - navigation)}; missing: {sorted(navigation - pages)}"
    )


# ---------------------------------------------------------------------------------------------------- the examples
def load_example(name: str):
    """Import examples/<name>.py (registered in `sys.modules`, as its dataclasses need)."""
    module_name = f"example_{name}"
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    """The quickstart with its defaults (the embedded model and data), three steps instead of its full training."""
    require_miniature()

    output_dir = tmp_path_factory.mktemp("quickstart") / "adapter"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        load_example("quickstart").main(
            ["--output_dir", str(output_dir), "--max_steps", "3", "--num_prompts", "2", "--max_new_tokens", "8"]
        )
    return output_dir, stdout.getvalue()


@pytest.mark.slow
def test_quickstart_trains_saves_reloads_generates_and_plots(quickstart_run):
    from peft_bitune.visualize import mixing_coefficients

    output_dir, printed = quickstart_run
    config = json.loads((output_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "BITUNE" and config["mix_init"] == 0.01
    assert config["adapter_config"]["r"] == 8 and config["adapter_config"]["lora_alpha"] == 16
    assert (output_dir / "adapter_model.safetensors").is_file()
    assert "## Bitune adapter" in (output_dir / "README.md").read_text()  # the card that says how to load it
    assert printed.count("reference:") == 2 and printed.count("answer:") == 2
    # The coefficients printed are those of the reloaded model, which must equal the saved ones.
    saved = mixing_coefficients(str(output_dir))
    rows = re.findall(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)$", printed, flags=re.M)
    assert [int(layer) for layer, _, _ in rows] == list(range(saved["keys"].numel()))
    assert torch.allclose(torch.tensor([float(k) for _, k, _ in rows]), saved["keys"], atol=5e-5)
    assert torch.allclose(torch.tensor([float(v) for _, _, v in rows]), saved["values"], atol=5e-5)
    assert not torch.allclose(saved["keys"], torch.full_like(saved["keys"], 0.5)), "three steps moved no alpha"
    with open(output_dir / "mixing_coefficients.png", "rb") as file:
        header = file.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", header[16:24]) > (100, 100)


@pytest.mark.slow
def test_quickstart_adapter_serves_as_is_with_the_commands_it_prints(quickstart_run):
    """
    Issue 55, item 12: `bitune-serve` refused the quickstart's adapter without `--chat-template`, and the quickstart
    named no next command. Its tokenizer now carries a template that renders a chat as training read a row (the prompt,
    then the completion and EOS), and it ends with a serve and an eval command: the serve command passes the server's
    startup checks, and the server answers a held-out prompt exactly as the quickstart did.
    """
    pytest.importorskip("fastapi", reason="bitune-serve needs the `serve` extra (part of the dev extra)")
    from transformers import AutoTokenizer

    from peft_bitune.serving import cli
    from peft_bitune.serving.app import ChatCompletions

    output_dir, printed = quickstart_run
    assert 'pip install -e ".[serve]"' in printed and 'pip install -e ".[eval]"' in printed
    commands = {line.split()[0]: shlex.split(line) for line in printed.splitlines() if line.startswith("    bitune-")}
    evaluate = commands["bitune-eval"]
    assert evaluate[1:3] == ["--model", "bitune"] and evaluate[evaluate.index("--tasks") + 1] == "bitune_piqa"
    base, adapter = (arg.split("=", 1)[1] for arg in evaluate[evaluate.index("--model_args") + 1].split(","))
    assert os.path.samefile(base, MINIATURE_BASE) and os.path.samefile(adapter, output_dir)

    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    assert tokenizer.chat_template == (EXAMPLES / "prompt_completion_template.jinja").read_text()
    serve = commands["bitune-serve"]
    assert "--chat-template" not in serve and os.path.samefile(serve[serve.index("--adapter") + 1], output_dir)
    engine = cli.load_engine(cli.parse_args(serve[1:]))  # the startup checks, then the model and adapter
    try:
        shown = re.search(r"\[1\] prompt:\s+(.*)\n\s+reference:\s+(.*)\n\s+answer:\s+(.*)\n", printed)
        prompt, reference, answer = (ast.literal_eval(value) for value in shown.groups())
        # A one-turn chat is the prompt as TRL tokenized it; with its answer, the whole training row.
        user = {"role": "user", "content": prompt}
        assert engine.prompts.build([user]).token_ids == tokenizer(prompt).input_ids
        row = engine.prompts.build([user, {"role": "assistant", "content": reference}])
        assert row.token_ids == tokenizer(prompt + reference + tokenizer.eos_token).input_ids
        assert row.segment_ends == (len(tokenizer(prompt).input_ids), len(row.token_ids))
        name = serve[serve.index("--adapter") + 1]
        request = ChatCompletions(engine, name).chat_request(
            {"model": name, "messages": [user], "max_tokens": 8, "temperature": 0}
        )
        assert engine.run(request).content == answer
    finally:
        engine.close()


def test_quickstart_refuses_bad_arguments_before_any_work(tmp_path, capsys, monkeypatch):
    quickstart = load_example("quickstart")
    for arguments, message in (
        (["--max_steps", "0"], "--max_steps must be positive"),
        (["--lora_r", "0"], "--lora_r must be at least 1"),
        (["--dtype", "float8"], "--dtype must be"),
    ):
        with pytest.raises(SystemExit):
            quickstart.main(["--output_dir", str(tmp_path / "out"), *arguments])
        assert message in capsys.readouterr().err
    monkeypatch.setattr(quickstart, "MINIATURE_BASE", str(tmp_path / "missing"))
    with pytest.raises(SystemExit):
        quickstart.main(["--output_dir", str(tmp_path / "out")])
    assert "The embedded miniature model is missing" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_chat_example_continues_from_the_cache_as_multi_turn_training_predicts(quickstart_run):
    """The chat's greedy answers are what the training forward on the whole conversation predicts (alternating)."""
    output_dir, _ = quickstart_run
    chat = load_example("chat")
    turns = chat.main(["--adapter", str(output_dir), "--max_new_tokens", "6"])
    assert len(turns) == chat.DEFAULT_TURNS
    assert [turn.cache_length for turn in turns] == sorted(turn.cache_length for turn in turns)
    model, _ = chat.load(str(output_dir), None)
    ids = torch.tensor([sum((t.instruction_ids + t.answer_ids for t in turns), [])])
    labels = torch.tensor([sum(([-100] * len(t.instruction_ids) + t.answer_ids for t in turns), [])])
    with torch.no_grad():
        logits = model(input_ids=ids, labels=labels).logits
    targets = (labels[0] != -100).nonzero().flatten()
    assert logits[0, targets - 1].argmax(-1).tolist() == labels[0, targets].tolist()


@pytest.mark.slow
def test_chat_example_reads_typed_turns_until_an_empty_line(quickstart_run, monkeypatch, capsys):
    output_dir, _ = quickstart_run
    chat = load_example("chat")
    typed = (
        "Story: Ana has 2 hats. Bo has 5 hats.\\nAsk: How many hats do they have?\\nAnswer:\n"
        "Ask: And Bo?\\nAnswer:\n"
        "\n"
    )
    monkeypatch.setattr(sys, "stdin", io.StringIO(typed))
    turns = chat.main(["--adapter", str(output_dir), "--interactive", "--max_new_tokens", "4"])
    assert [turn.instruction for turn in turns] == [
        "Story: Ana has 2 hats. Bo has 5 hats.\nAsk: How many hats do they have?\nAnswer:", "Ask: And Bo?\nAnswer:",
    ]
    assert capsys.readouterr().out.count("bitune>") == 2
