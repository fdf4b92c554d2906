"""`BituneConfig`: which PEFT method builds the two weight sets, and how their KV caches are mixed."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from peft import LoraConfig, PeftConfig
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
from peft.utils import PeftType, TaskType

from ..constants import (
    BITUNE_TYPE_NAME,
    CAUSAL,
    WEIGHT_SETS,
    MultiTurnMode,
    SecondPassAttention,
    WeightSet,
    peft_type_name,
)
from ..persistence.config_files import BituneConfigFileMixin
from ..utils.field_types import check_field_types

# PEFT methods that cannot hold the two weight sets side by side in one model, with the reason a user needs.
_REFUSED_METHODS = {
    "ADALORA": "AdaLoRA supports only one trainable adapter per model, and Bitune trains two",
    "XLORA": "X-LoRA is itself a mixture of frozen LoRA experts, not a method that trains one weight set",
    BITUNE_TYPE_NAME: "a Bitune adapter cannot be nested inside another one",
}


# Options of other PEFT configs that train whole modules beside the adapter, and why Bitune refuses them.
_AUXILIARY_MODULES = ("modules_to_save", "trainable_token_indices")
_AUXILIARY_MODULES_REASON = (
    "such modules are not split into causal and bidirectional weight sets, and PEFT would leave them out of the "
    "checkpoint"
)


def _refuse_auxiliary_modules(where: str, values: dict[str, Any]) -> None:
    """Refuse `modules_to_save` and `trainable_token_indices`, set in `values` (a config's, or its keyword
    arguments)."""
    for name in _AUXILIARY_MODULES:
        if values.get(name) is not None:
            raise ValueError(f"`{where}` cannot use `{name}`: {_AUXILIARY_MODULES_REASON}. Leave it unset.")


# `init_lora_weights` values (or prefixes) with which LoRA changes the base layer's weights as it makes an adapter.
_INITS_CHANGING_THE_BASE = ("pissa", "olora", "corda", "loftq")


def check_mixed_layers(layers: list[int]) -> list[int]:
    """`mixed_layers` as a sorted list, refused if empty, negative or repeated (the type is checked already)."""
    if len(layers) == 0:
        raise ValueError(
            "`mixed_layers` is empty, so nothing would be mixed and the adapter would be plain LoRA with an unused "
            "second weight set. Name at least one layer, or leave it unset (None) to mix every layer."
        )
    if any(isinstance(layer, bool) or not isinstance(layer, int) for layer in layers):
        raise ValueError(f"`mixed_layers` must hold whole layer indices, got {layers}.")
    if min(layers) < 0:
        raise ValueError(f"`mixed_layers` must hold layer indices from 0 up, got {layers}.")
    if len(set(layers)) != len(layers):
        raise ValueError(f"`mixed_layers` names a layer more than once: {layers}. Name each layer once.")
    return sorted(layers)


def default_adapter_config() -> LoraConfig:
    """The paper's default weight sets: LoRA r=8, alpha=16 on every linear layer."""
    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type=TaskType.CAUSAL_LM)


@dataclass
class BituneConfig(BituneConfigFileMixin, PeftConfig):
    """
    Configuration of a Bitune adapter: two sets of weights of one PEFT method (causal and bidirectional), and the
    per-layer scalars that mix the key/value caches of the two prompt passes (Bitune, Kopiczko et al., 2025).

    Args:
        adapter_config (`PeftConfig` or `dict`, *optional*):
            The PEFT method used for both weight sets, e.g. `LoraConfig(r=8, ...)`, `LoraConfig(use_dora=True)` or
            `IA3Config(...)`. Both sets use the same method and hyper-parameters and are initialised independently.
            Defaults to LoRA r=8, alpha=16 on all linear layers.
        mix_init (`float`, defaults to `0.01`):
            Initial value of every mixing scalar `w`. With the default `mix_scale`, alpha starts at 0.5.
        mix_scale (`float`, defaults to `0.01`):
            The constant `s` in `alpha = |w| / (|w| + s)`; must be positive.
        shared_weights (`bool`, defaults to `False`):
            Ablation: one weight set serves both prompt passes (the causal one); no bidirectional set is created.
        second_pass_attention (`str`, defaults to `"bidirectional"`):
            Ablation: `"causal"` reads the prompt a second time with the causal mask instead of the bidirectional one.
        train_mixing (`bool`, defaults to `True`):
            Ablation: `False` freezes the mixing scalars at `mix_init` (a fixed mixing ratio).
        mixed_layers (`list[int]`, *optional*):
            The decoder layers (0-based) whose caches are mixed; every other layer keeps the causal pass's keys and
            values exactly, as plain LoRA would. Defaults to every layer (the paper). For example
            `list(range(num_layers // 2))` mixes the lower half only, where the alphas learned on the paper's tasks are
            highest (docs/paper_tasks.md). Checked against the model's depth when the adapter is created.
        multi_turn (`str`, defaults to `"alternating"`):
            How rows with several instruction/answer segments are trained (paper A.8). `"alternating"`: each
            instruction segment is read twice over the cache so far and mixed, each answer runs causally, in order,
            without re-reading earlier segments. `"history"`: for each answer, everything before it is read as one
            instruction (simple, but re-encodes the history for every answer).
        base_model_vocab_size (`int`, *optional*):
            The vocabulary size of the base model, recorded when the adapter is created on it (like PEFT's
            `base_model_name_or_path`) and saved with it: loading the adapter onto a base model of another vocabulary
            size is refused. Not a setting: leave it unset.
        base_model_num_hidden_layers (`int`, *optional*):
            The base model's number of decoder layers, recorded and checked the same way.

    Example:

    ```py
    >>> from peft import LoraConfig, get_peft_model
    >>> from peft_bitune import BituneConfig
    >>> config = BituneConfig(task_type="CAUSAL_LM", adapter_config=LoraConfig(r=8, target_modules="all-linear"))
    >>> model = get_peft_model(base_model, config)  # doctest: +SKIP
    ```
    """

    adapter_config: PeftConfig | dict | None = field(
        default=None,
        metadata={
            "help": "The PEFT method used for both weight sets. Defaults to LoRA r=8, alpha=16, all linear layers."
        },
    )
    mix_init: float = field(default=0.01, metadata={"help": "Initial value of every mixing scalar `w`."})
    mix_scale: float = field(default=0.01, metadata={"help": "The constant `s` in alpha = |w| / (|w| + s)."})
    shared_weights: bool = field(
        default=False, metadata={"help": "Ablation: one weight set (the causal one) serves both prompt passes."}
    )
    second_pass_attention: SecondPassAttention = field(
        default="bidirectional",
        metadata={"help": "Mask of the second prompt pass; 'causal' is the paper's ablation."},
    )
    train_mixing: bool = field(
        default=True, metadata={"help": "Ablation: False freezes the mixing scalars at `mix_init`."}
    )
    mixed_layers: list[int] | None = field(
        default=None,
        metadata={"help": "Decoder layers (0-based) whose caches are mixed; the others stay causal. Default: all."},
    )
    multi_turn: MultiTurnMode = field(
        default="alternating",
        metadata={
            "help": "Training on rows with several instruction/answer segments: 'alternating' or whole 'history'."
        },
    )
    # Recorded from the base model when the adapter is created, not settings: loading refuses a base of another shape
    # (see `persistence/base_model_records.py`). Adapters saved before these records existed have none.
    base_model_vocab_size: int | None = field(
        default=None, metadata={"help": "Vocabulary size of the base model (recorded).", "recorded": True}
    )
    base_model_num_hidden_layers: int | None = field(
        default=None, metadata={"help": "Number of decoder layers of the base model (recorded).", "recorded": True}
    )

    def __new__(cls, *args: Any, **kwargs: Any) -> BituneConfig:
        # Before the generated `__init__`, which would fail on these with a bare "unexpected keyword argument".
        _refuse_auxiliary_modules("BituneConfig", kwargs)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        # Before anything reads a value: e.g. `train_mixing="no"` would be truthy.
        self._check_field_types()
        super().__post_init__()
        self.peft_type = PeftType[BITUNE_TYPE_NAME]
        if self.task_type is None:
            self.task_type = TaskType.CAUSAL_LM
        self.check()

    def check(self) -> None:
        """
        Check every setting, and normalise those that have a normal form (`adapter_config` as a PEFT config,
        `mixed_layers` sorted). Run when the config is made (also from `adapter_config.json`) and again when an adapter
        is built from it (`check_depth`): a field can be assigned, or a list edited in place, after the config is
        made, and `config.mixed_layers = [-1]` must not reach the tuner unchecked.
        """
        self._check_field_types()
        _refuse_auxiliary_modules("BituneConfig", vars(self))  # assigned later: PEFT reads them with `getattr`
        if self.task_type != TaskType.CAUSAL_LM:
            raise ValueError(
                f"Bitune tunes decoder-only language models: `task_type` must be 'CAUSAL_LM', got '{self.task_type}'."
            )
        self.adapter_config = self._build_adapter_config(self.adapter_config)
        self.adapter_config.task_type = self.task_type
        if not self.mix_scale > 0:
            raise ValueError(f"`mix_scale` must be positive, got {self.mix_scale}.")
        if self.mix_init < 0:
            raise ValueError(f"`mix_init` must be non-negative (alpha uses |w|), got {self.mix_init}.")
        if self.mixed_layers is not None:
            self.mixed_layers = check_mixed_layers(self.mixed_layers)

    def _check_field_types(self) -> None:
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "adapter_config"}
        check_field_types(type(self), values)

    @staticmethod
    def _build_adapter_config(adapter_config: PeftConfig | dict | None) -> PeftConfig:
        if adapter_config is None:
            return default_adapter_config()
        if isinstance(adapter_config, dict):
            peft_type = adapter_config.get("peft_type")
            if peft_type not in PEFT_TYPE_TO_CONFIG_MAPPING:
                raise ValueError(
                    f"`adapter_config` must name a known PEFT method in its 'peft_type', got {peft_type!r}."
                )
            config_cls = PEFT_TYPE_TO_CONFIG_MAPPING[peft_type]
            check_field_types(config_cls, adapter_config, prefix="adapter_config.")
            adapter_config = config_cls(**adapter_config)
        if not isinstance(adapter_config, PeftConfig):
            raise TypeError(
                "`adapter_config` must be a PEFT config such as `LoraConfig(...)`, got "
                f"{type(adapter_config).__name__}."
            )
        peft_type = peft_type_name(adapter_config.peft_type)
        if adapter_config.is_prompt_learning or adapter_config.is_adaption_prompt:
            raise ValueError(
                f"`adapter_config` of type {peft_type} is a prompt-learning method: it adds virtual tokens instead of "
                "weights on the layers, so it cannot give the two prompt passes different weights. Use a method that "
                "adapts layers, e.g. LoRA, DoRA (`LoraConfig(use_dora=True)`) or IA3."
            )
        _refuse_auxiliary_modules("adapter_config", {name: getattr(adapter_config, name, None) or None
                                                     for name in _AUXILIARY_MODULES})
        init = getattr(adapter_config, "init_lora_weights", None)
        if (isinstance(init, str) and init.startswith(_INITS_CHANGING_THE_BASE)) or getattr(
            adapter_config, "kasa_config", None
        ):
            what = f"`init_lora_weights={init!r}`" if isinstance(init, str) else "KaSA (`kasa_config`)"
            raise ValueError(
                f"`adapter_config` with {what} cannot be used: it changes the base model's weights when a weight set "
                "is made, and a Bitune adapter makes two, so the second would change them again and neither set "
                "would start from the base model (PEFT refuses such adapters next to others too). Use another "
                "`init_lora_weights`, e.g. the default (True) or 'gaussian'."
            )
        if peft_type in _REFUSED_METHODS:
            raise ValueError(
                f"`adapter_config` of type {peft_type} cannot be used: {_REFUSED_METHODS[peft_type]}. Use LoRA, DoRA "
                "(`LoraConfig(use_dora=True)`) or IA3."
            )
        if adapter_config.peft_type not in PEFT_TYPE_TO_TUNER_MAPPING:
            raise ValueError(f"`adapter_config` of type {peft_type} has no tuner registered in PEFT.")
        return adapter_config

    def check_depth(self, num_layers: int) -> None:
        """Refuse, before any adapter layer is made, a config that does not pass `check` (settings assigned after it
        was made) or whose `mixed_layers` name a layer the model does not have."""
        self.check()
        if self.mixed_layers is not None and max(self.mixed_layers) >= num_layers:
            outside = [layer for layer in self.mixed_layers if layer >= num_layers]
            lower_half_end = max(num_layers // 2, 1) - 1
            raise ValueError(
                f"`mixed_layers` names layers {outside}, but the model has {num_layers} decoder layers (0 to "
                f"{num_layers - 1}). Choose layers in that range (the lower half is 0 to {lower_half_end})."
            )

    @property
    def weight_sets(self) -> tuple[WeightSet, ...]:
        """The weight sets this adapter creates: both, or only the causal one with `shared_weights`."""
        return (CAUSAL,) if self.shared_weights else WEIGHT_SETS

    def __getattr__(self, name: str) -> Any:
        """Name what a Bitune config lacks where PEFT asks it of every config, e.g. `target_modules` (PEFT's
        `convert_to_lora` does): the inner method's modules are under `adapter_config`."""
        if name == "target_modules":
            raise AttributeError(
                "A `BituneConfig` has no `target_modules`: its two weight sets target "
                "`adapter_config.target_modules`. "
                "(PEFT's `convert_to_lora` asks for it: a Bitune adapter cannot be converted to LoRA, since no LoRA "
                "of the base model reads the prompt twice and mixes the two caches; `supports_lora_conversion()` is "
                "False.)"
            )
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON-ready data, with the inner method's config nested as its own dict."""
        data = super().to_dict()
        if data.get("mixed_layers") is None:  # left out at its default, so that earlier versions load the adapter
            data.pop("mixed_layers", None)
        data["adapter_config"] = self.adapter_config.to_dict()
        for key, value in data["adapter_config"].items():
            if isinstance(value, set):
                data["adapter_config"][key] = sorted(value)
        return data
