"""TRL's DPO, KTO, GRPO and RLOO trainers for Bitune adapters: `BituneDPOTrainer`, `BituneKTOTrainer`,
`BituneGRPOTrainer` and `BituneRLOOTrainer`.

The Bitune forward answers TRL's fused-head call (`peft_bitune.tuner.fused_head`), so TRL's own trainers run a Bitune
adapter. They would train it against the wrong reference, without a word:

- given a trained adapter and no `ref_model`, TRL adds a "ref" adapter and copies the parameters whose names hold
  `.default.`; a Bitune adapter's weight sets are `default__causal` and `default__bidirectional`, so only the mixing
  scalars are copied, and the reference is a fresh adapter;
- given a fresh adapter (`peft_config`), the reference is the model with its adapters disabled: for LoRA that is the
  starting policy (B = 0), for Bitune it is not (the bidirectional read of the base weights is mixed in at alpha_0).

Each subclass therefore makes the "ref" adapter an exact, frozen copy of the policy's adapter
(`copy_policy_to_reference`) before the first reference log-probability is computed; TRL's own code then uses it for
every reference forward (`trl.trainer.utils.use_adapter`). Everything else is TRL's. Subclasses, because nothing else
can act between TRL making the adapter and TRL using the reference. They also refuse, before any work, the options a
Bitune adapter cannot run, naming the option and why, and what TRL would fail on without saying why (a Bitune
`ref_model`, an adapter not named "default", a frozen adapter, a dataset whose every row is dropped).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from datasets import Dataset
from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
from trl import DPOTrainer, GRPOTrainer, KTOTrainer, RLOOTrainer

from peft_bitune.tuner.find_tuner import find_bitune_tuner
from peft_bitune.utils.messages import format_rows

from .checks import bitune_peft_config, check_rows_kept, named_eval_datasets
from .model_cards import BituneModelCardMixin
from .trainer import keep_mixing_scalars_in_float32

# The adapter name TRL's trainers look for when they compute reference log-probabilities.
REFERENCE_ADAPTER = "ref"

# Options of TRL's configs that cannot work with a Bitune adapter, and why; refused when set (truthy).
_OPTIONS_BITUNE_CANNOT_RUN = {
    "use_vllm": "vLLM generates with its own model runner, which reads each prompt once, causally, with merged "
    "weights; a Bitune adapter cannot be merged and must read the prompt twice. Generation goes through "
    "`model.generate`, which does: leave `use_vllm=False`",
    "use_transformers_continuous_batching": "transformers' continuous batching fills its own paged cache, without "
    "Bitune's two prompt passes and mixing. Generation goes through `model.generate`, which has them: leave it False",
    "padding_free": "TRL's DPOTrainer turns it off (\"temporarily unavailable after a refactor\") and pads instead, "
    "so it would be set but unused. Leave it False (the Bitune forward itself reads padding-free rows, as "
    "BituneSFTTrainer's packing does)",
    "use_liger_kernel": "Liger's kernels replace the model's forward and loss, which the Bitune forward runs in three "
    "passes of its own. Leave it False (the fused LM head already keeps the logits out of memory)",
    "sync_ref_model": "the reference is a frozen copy of the policy's adapter; TRL keeps no separate reference model "
    "to synchronise for an adapter. Leave it False",
}

# Arguments of the trainers' own that cannot work with a Bitune adapter, and why; refused when given (not None).
_ENTER_AS_INSTRUCTIONS = ("enter the completion as new instruction tokens, which generation reads as a fresh prompt "
                          "(twice) but the scoring forward would read as part of the answer; the two would not agree")
_ARGUMENTS_BITUNE_CANNOT_RUN = {
    "tools": f"a tool's outputs {_ENTER_AS_INSTRUCTIONS}",
    "environment_factory": f"an environment's replies {_ENTER_AS_INSTRUCTIONS}",
}


class BituneReferenceMixin(BituneModelCardMixin):
    """Train a Bitune adapter with a TRL trainer (mixed in before its class) whose reference is the policy as training
    starts (see the module's docstring), and write a Bitune adapter's model card. Every argument means what it means
    for the TRL trainer, but `peft_config` defaults to `BituneConfig()` and must be a `BituneConfig`, `model` may be a
    `PeftModel` only with a Bitune adapter, and what a Bitune adapter cannot run is refused before the model loads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(super().__init__).bind(*args, **kwargs)
        arguments = bound.arguments
        model = arguments["model"]
        trainer = type(self).__name__
        arguments["peft_config"] = bitune_peft_config(model, arguments.get("peft_config"), trainer)
        _refuse_what_bitune_cannot_run(arguments)
        _refuse_a_bitune_ref_model(arguments.get("ref_model"), trainer)
        if arguments.get("ref_model") is None and self._reference_asked(arguments.get("args")):
            _check_adapter_name(model, trainer)
        given = {"train_dataset": arguments.get("train_dataset"), **named_eval_datasets(arguments.get("eval_dataset"))}
        rows_given = {name: len(dataset) for name, dataset in given.items() if isinstance(dataset, Dataset)}
        self._bitune_reference_ready = False
        super().__init__(*bound.args, **bound.kwargs)
        datasets = {"train_dataset": self.train_dataset, **named_eval_datasets(self.eval_dataset)}
        # DPO and KTO drop the rows whose prompt leaves no room for an answer; GRPO and RLOO have no `max_length`.
        if getattr(self.args, "max_length", None) is not None:
            cause = (f"each one's prompt alone fills `max_length={self.args.max_length}` tokens, which leaves no room "
                     "for its answer, and TRL drops such rows")
            check_rows_kept(rows_given, datasets, self.args, cause)
        for name, dataset in datasets.items():
            _check_no_empty_segments(dataset, name)
        keep_mixing_scalars_in_float32(self.model)  # TRL casts a quantized model's trainable parameters to bf16
        self._prepare_reference()

    @staticmethod
    def _reference_asked(args: Any) -> bool:
        """Whether a trainer of this config (`None`: TRL's default one) computes reference log-probabilities at all
        (GRPO and RLOO only when `beta` != 0)."""
        return True

    def _prepare_reference(self) -> None:
        """Make the "ref" adapter an exact copy of the policy's adapter, once, unless a `ref_model` was given."""
        if self._bitune_reference_ready:
            return
        self._bitune_reference_ready = True
        if getattr(self, "ref_model", None) is not None or not self._reference_asked(self.args):
            return
        copy_policy_to_reference(self.accelerator.unwrap_model(self.model))


def copy_policy_to_reference(model: PeftModel) -> None:
    """Make the "ref" adapter of a Bitune `PeftModel` an exact, frozen copy of its active adapter: the same config,
    and PEFT's state dict of the adapter put in by PEFT as it loads one, each tensor with its dtype (TRL casts a
    quantized model's trainable weights to bf16; a float32 copy would compute other log-probabilities); checked
    against the state dicts. It never trains, even while TRL makes it the active adapter."""
    policy = model.active_adapter
    if REFERENCE_ADAPTER in model.peft_config:
        # TRL adds "ref" from the config of the adapter named "default", which is not the policy's when another
        # adapter is active (its scaling, rank and mixing settings would stay default's): made again from the policy's.
        model.delete_adapter(REFERENCE_ADAPTER)
    config = copy.deepcopy(model.peft_config[policy])
    config.inference_mode = True
    model.add_adapter(REFERENCE_ADAPTER, config, low_cpu_mem_usage=True)
    policy_state = get_peft_model_state_dict(model, adapter_name=policy)
    copies = {key: value.detach().clone() for key, value in policy_state.items()}
    set_peft_model_state_dict(model, copies, adapter_name=REFERENCE_ADAPTER, low_cpu_mem_usage=True)
    find_bitune_tuner(model).set_requires_grad(REFERENCE_ADAPTER, requires_grad=False)
    reference_state = get_peft_model_state_dict(model, adapter_name=REFERENCE_ADAPTER)
    differing = sorted(key for key, value in policy_state.items() if key not in reference_state
                       or value.dtype != reference_state[key].dtype or not torch.equal(value, reference_state[key]))
    meta = sorted(name for name, parameter in model.named_parameters() if parameter.is_meta)
    if differing or policy_state.keys() != reference_state.keys() or meta:
        raise RuntimeError(
            f"The reference adapter is not an exact copy of `{policy}` (first differing weights: {differing[:3]}; "
            f"left on the meta device: {meta[:3]}); please report this with the PEFT method of the adapter."
        )


# The token columns of TRL's prepared preference rows (DPO: prompt, chosen, rejected; KTO: prompt, completion).
_SEGMENT_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids", "completion_ids")


def _check_no_empty_segments(dataset: Any, name: str) -> None:
    """Refuse, before training, a prepared row whose prompt or completion tokenised to nothing: Bitune reads an
    instruction before every answer, and scores an answer of at least one token. (An `IterableDataset` is checked
    batch by batch instead, by the Bitune forward.)"""
    if not isinstance(dataset, Dataset):
        return
    for column in [column for column in _SEGMENT_COLUMNS if column in dataset.column_names]:
        if empty := [index for index, ids in enumerate(dataset[column]) if len(ids) == 0]:
            raise ValueError(
                f"Rows {format_rows(empty)} of {name} have an empty {column.removesuffix('_ids')} once tokenised "
                "(rows counted after TRL's preparation, which drops rows whose prompt alone fills `max_length`). "
                "Bitune reads an instruction before each answer and scores at least one answer token: give every row "
                "a non-empty prompt and completion (or a tokenizer that adds a BOS token)."
            )


def _refuse_a_bitune_ref_model(ref_model: Any, trainer: str) -> None:
    """Refuse a Bitune `PeftModel` as `ref_model`: TRL gives a reference model its fused LM head, whose forward calls
    the model without the labels that hold each row's instruction/answer boundary (a Bitune forward needs them)."""
    if isinstance(ref_model, PeftModel) and find_bitune_tuner(ref_model) is not None:
        raise ValueError(
            f"`ref_model` cannot be a Bitune adapter: TRL wraps a reference model in its fused LM head, which calls "
            f"it without the labels a Bitune forward reads each row's instruction from. Leave `ref_model=None`: "
            f"{trainer} then makes the reference an exact, frozen copy of the policy's adapter as training starts."
        )


def _check_adapter_name(model: Any, trainer: str) -> None:
    """Refuse a Bitune `PeftModel` without an adapter named "default": TRL's trainers add their reference adapter from
    `peft_config["default"]`, and fail on a raw `KeyError` without one."""
    if isinstance(model, PeftModel) and "default" not in model.peft_config:
        raise ValueError(
            f"The model's Bitune adapter is named `{model.active_adapter}` (adapters: {sorted(model.peft_config)}), "
            f"but the TRL trainer under {trainer} adds its reference adapter from the one named `default`, which "
            "this model lacks. Load the adapter under that name: `PeftModel.from_pretrained(base, path, "
            "is_trainable=True)` without `adapter_name`."
        )


def _refuse_what_bitune_cannot_run(arguments: dict[str, Any]) -> None:
    """Refuse, by name and before any work, the options and arguments a Bitune adapter cannot run."""
    for option, reason in _OPTIONS_BITUNE_CANNOT_RUN.items():
        if getattr(arguments.get("args"), option, None):  # no `args`: TRL's defaults, all off
            raise ValueError(f"`{option}=True` cannot be used with a Bitune adapter: {reason}.")
    for name, reason in _ARGUMENTS_BITUNE_CANNOT_RUN.items():
        if arguments.get(name) is not None:
            raise ValueError(f"`{name}` cannot be used with a Bitune adapter: {reason}.")


class _PrecomputedReferenceMixin(BituneReferenceMixin):
    """DPO and KTO may compute the reference log-probabilities of the whole dataset while the trainer is made
    (`precompute_ref_log_probs=True`), before `__init__` returns: the reference is prepared first."""

    def _precompute_ref_logps(self, *args: Any, **kwargs: Any) -> Any:
        self._prepare_reference()
        return super()._precompute_ref_logps(*args, **kwargs)


class _KLPenaltyMixin(BituneReferenceMixin):
    """GRPO and RLOO compute reference log-probabilities only for their KL penalty (`beta` != 0)."""

    @staticmethod
    def _reference_asked(args: Any) -> bool:
        return getattr(args, "beta", 0.0) != 0.0  # TRL's default configs have `beta=0.0`


class BituneDPOTrainer(_PrecomputedReferenceMixin, DPOTrainer):
    """[`~trl.DPOTrainer`] for a Bitune adapter, against the policy as training starts (see `BituneReferenceMixin`)."""

    _tag_names = [*DPOTrainer._tag_names, "bitune"]


class BituneKTOTrainer(_PrecomputedReferenceMixin, KTOTrainer):
    """[`~trl.KTOTrainer`] for a Bitune adapter, against the policy as training starts (see `BituneReferenceMixin`)."""

    _tag_names = [*KTOTrainer._tag_names, "bitune"]


class BituneGRPOTrainer(_KLPenaltyMixin, GRPOTrainer):
    """[`~trl.GRPOTrainer`] for a Bitune adapter: completions from the Bitune `generate`, the KL penalty (`beta` != 0)
    against the policy as training starts (see `BituneReferenceMixin`)."""

    _tag_names = [*GRPOTrainer._tag_names, "bitune"]


class BituneRLOOTrainer(_KLPenaltyMixin, RLOOTrainer):
    """[`~trl.RLOOTrainer`] for a Bitune adapter: completions from the Bitune `generate`, the KL penalty (`beta` != 0)
    against the policy as training starts (see `BituneReferenceMixin`)."""

    _tag_names = [*RLOOTrainer._tag_names, "bitune"]
