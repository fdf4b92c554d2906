"""A pytest plugin that runs PEFT's own decoder-model suite (tests/test_decoder_models.py of the PyPI sdist of the
installed peft) on Bitune, as PEFT tests a method of its own. From the sdist's root folder:

    PYTHONPATH=<repo>/tests/peft_suite python -m pytest -p bitune_peft_suite -o addopts= --import-mode=importlib \
        -o consider_namespace_packages=true tests/test_decoder_models.py

(the sdist's tests/ has no __init__.py, and its modules import each other relatively: hence importlib mode with
namespace packages; `addopts` of PEFT's pyproject.toml asks for pytest-cov).

- Bitune joins the suite as PEFT adds a method: an entry appended to the suite's `ALL_CONFIGS` (inner LoRA r=8 on
  q_proj/v_proj, alpha and dropout as PEFT's LoRA entry), before pytest parametrizes the tests with it.
- Only the Bitune tests on the models of `HUB_MODELS` run; every other test is deselected.
- Those models are tiny random models (the configs of this repository's tests/tiny_models.py), saved under the Hub ids
  the suite uses into a temporary Hugging Face cache, laid out as huggingface_hub lays out a download, and read with
  HF_HUB_OFFLINE=1.
- A test that fails with a refusal of bitune_refusals.py (the list docs/faq.md shows) passes, once the plugin has
  checked the exception; any other failure fails. The summary counts passes, documented refusals and failures.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from bitune_refusals import ADAPTER_DTYPE, DOCUMENTED_REFUSALS, Refusal, documented_refusal

TINY_MODELS_FILE = Path(__file__).resolve().parents[1] / "tiny_models.py"

# The Hub ids of PEFT's decoder suite that Bitune runs on, and the tests/tiny_models.py architecture saved under each.
HUB_MODELS = {
    "trl-internal-testing/tiny-random-LlamaForCausalLM": "llama",
    "peft-internal-testing/tiny-dummy-qwen2": "qwen2",
    "hf-internal-testing/tiny-random-Gemma3ForCausalLM": "gemma3",
}

# Bitune's entry in ALL_CONFIGS: inner LoRA r=8 on q_proj/v_proj, alpha, dropout and bias as PEFT's LoRA entry.
BITUNE_KWARGS = {
    "task_type": "CAUSAL_LM",
    "adapter_config": {
        "peft_type": "LORA",
        "r": 8,
        "lora_alpha": 32,
        "target_modules": ["q_proj", "v_proj"],
        "lora_dropout": 0.05,
        "bias": "none",
    },
}


def _use_temporary_hub_cache() -> str:
    """Point the Hugging Face cache at a new temporary folder and switch the Hub off. huggingface_hub reads these
    variables once, when it is imported: this runs when pytest loads the plugin (`-p`), before anything imports it."""
    if "huggingface_hub" in sys.modules:
        raise pytest.UsageError(
            "bitune_peft_suite must be loaded before huggingface_hub is imported: pass it as `-p bitune_peft_suite` "
            "on the command line."
        )
    home = tempfile.mkdtemp(prefix="bitune-peft-suite-hf-")
    os.environ.update(HF_HOME=home, HF_HUB_CACHE=os.path.join(home, "hub"), HF_HUB_OFFLINE="1")
    return home


HF_HOME = _use_temporary_hub_cache()


def _save_tiny_models(hub_cache: Path) -> None:
    """Save each tiny model under its Hub id: models--org--name/snapshots/<commit>/ and refs/main, as huggingface_hub
    lays out a download, so that `from_pretrained(<id>)` finds it offline."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = importlib.util.spec_from_file_location("bitune_tiny_models", TINY_MODELS_FILE)
    tiny_models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny_models)
    configs = tiny_models.model_configs()
    for model_id, architecture in HUB_MODELS.items():
        repo = hub_cache / ("models--" + model_id.replace("/", "--"))
        commit = hashlib.sha1(model_id.encode()).hexdigest()
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(configs[architecture]).save_pretrained(repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(commit)


def _suite_config_class() -> type:
    """`BituneConfig` as the suite builds it. PEFT's tests make a method's adapter non-trivial with
    `set_init_weights_false`, which passes `init_weights=False` to every method it has no branch for (LoRA gets
    `init_lora_weights=False`). For Bitune the equivalent is the inner LoRA's `init_lora_weights=False`: this subclass
    is that branch, as PEFT adds one for a method whose option has another name. Nothing else differs, and its saved
    config is a plain BituneConfig's."""
    from peft_bitune import BituneConfig

    @dataclass
    class BituneConfig(BituneConfig):  # the name PEFT's test ids and messages show
        init_weights: bool = True

        def __post_init__(self) -> None:
            if not self.init_weights:
                self.adapter_config = {**self.adapter_config, "init_lora_weights": False}
            super().__post_init__()

        def to_dict(self):
            config = super().to_dict()
            config.pop("init_weights")
            return config

    return BituneConfig


def _check_adapter_dtype(error: AssertionError) -> None:
    """The adapter dtype refusal: with `autocast_adapter_dtype=False`, only the mixing scalars may differ from the base
    model's dtype (they stay float32 by design); every other adapter weight must have it."""
    import torch

    from peft_bitune import BituneKVMixer

    frame = error.__traceback__
    while frame.tb_next is not None:
        frame = frame.tb_next
    model, expected = frame.tb_frame.f_locals["model"], frame.tb_frame.f_locals["expected_dtype"]
    mixers = [module for module in model.modules() if isinstance(module, BituneKVMixer)]
    mixers = {id(param) for mixer in mixers for param in mixer.parameters()}
    wrong = [
        (name, param.dtype)
        for name, param in model.named_parameters()
        if "default" in name and param.is_floating_point()
        and (param.dtype != torch.float32 if id(param) in mixers else param.dtype not in expected)
    ]
    if wrong or not mixers:
        raise AssertionError(f"Not the documented float32 mixing scalars: {wrong or 'no mixing scalars'}") from error


# Checks beyond the exception's type and text, for refusals that PEFT's test reports as a bare assertion.
FURTHER_CHECKS = {ADAPTER_DTYPE: _check_adapter_dtype}


class _BituneSuite:
    """Adds Bitune to the suite, selects its tests, turns documented refusals into passes and counts the outcomes."""

    def __init__(self) -> None:
        self.config_cls = _suite_config_class()
        self.refused: dict[str, Refusal] = {}
        self.outcomes: dict[str, str] = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Append Bitune to the suite's ALL_CONFIGS before pytest parametrizes the first test with it (the parametrize
        marks hold the list itself), and count the tiny models as fetched once already for the suite's
        `hub_online_once`, which would otherwise switch the Hub on for a model's first use."""
        module = metafunc.module
        if not hasattr(module, "ALL_CONFIGS") or any(cls is self.config_cls for cls, _ in module.ALL_CONFIGS):
            return
        module.ALL_CONFIGS.append((self.config_cls, BITUNE_KWARGS))
        accesses = sys.modules[module.hub_online_once.__module__]._HUB_MODEL_ACCESSES
        for model_id in HUB_MODELS:
            accesses.setdefault(model_id, 1)

    def _is_bitune_test(self, item: pytest.Item) -> bool:
        params = getattr(getattr(item, "callspec", None), "params", {})
        return params.get("config_cls") is self.config_cls and params.get("model_id") in HUB_MODELS

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        selected = [item for item in items if self._is_bitune_test(item)]
        if not selected:
            raise pytest.UsageError("No Bitune test was collected: run it on PEFT's tests/test_decoder_models.py.")
        config.hook.pytest_deselected(items=[item for item in items if not self._is_bitune_test(item)])
        items[:] = selected

    @pytest.hookimpl(wrapper=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function):
        """A documented refusal is a pass, once its exception is checked; any other error propagates."""
        try:
            return (yield)
        except Exception as error:
            refusal = documented_refusal(pyfuncitem.originalname, error)
            if refusal is None:
                raise
            if refusal.message in FURTHER_CHECKS:
                FURTHER_CHECKS[refusal.message](error)
            self.refused[pyfuncitem.nodeid] = refusal
            return True

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # A test's outcome: that of the first phase that did not pass, else that of its call.
        if report.nodeid not in self.outcomes and (report.when == "call" or report.outcome != "passed"):
            self.outcomes[report.nodeid] = report.outcome

    def pytest_terminal_summary(self, terminalreporter) -> None:
        import peft

        counts = {outcome: [node for node, seen in self.outcomes.items() if seen == outcome]
                  for outcome in ("passed", "failed", "skipped")}
        passed = [node for node in counts["passed"] if node not in self.refused]
        write = terminalreporter.write_line
        terminalreporter.section(f"Bitune in PEFT {peft.__version__}'s decoder-model suite")
        write(
            f"{len(passed)} passed, {len(self.refused)} refused as documented (docs/faq.md), "
            f"{len(counts['failed'])} failed, {len(counts['skipped'])} skipped (by PEFT's tests)"
        )
        for node in counts["failed"]:
            write(f"FAILED, not a documented refusal: {node}")
        for refusal in DOCUMENTED_REFUSALS:
            if refusal not in self.refused.values():
                write(f"documented refusal that no test met here: {refusal.error}: {refusal.message}")


def pytest_configure(config: pytest.Config) -> None:
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE or Path(constants.HF_HUB_CACHE) != Path(HF_HOME) / "hub":
        raise pytest.UsageError("huggingface_hub was imported before bitune_peft_suite set up its offline cache.")
    _save_tiny_models(Path(constants.HF_HUB_CACHE))
    # PEFT 0.21's own `PeftModel.__init__` reads this deprecated transformers property (docs/faq.md lists the warning),
    # and PEFT's settings make transformers' FutureWarnings errors: on transformers >= 5.23 every test would fail.
    config.addinivalue_line("filterwarnings", "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
    config.pluginmanager.register(_BituneSuite(), "bitune_peft_suite_tests")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(HF_HOME, ignore_errors=True)
