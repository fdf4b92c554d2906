"""`BituneSFTConfig`: TRL's `SFTConfig` plus the few settings a Bitune run needs, checked before any work is done."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments
from trl import SFTConfig

from peft_bitune import compat
from peft_bitune.training.callbacks import check_warmup_steps
from peft_bitune.training.optimizers import check_lr_ratio


@dataclass
class BituneSFTConfig(SFTConfig):
    r"""
    Configuration of the [`BituneSFTTrainer`]: every [`~trl.SFTConfig`] field keeps its meaning, and Bitune adds the
    settings below.

    Parameters:
        mixing_logging_steps (`int` or `None`, *optional*, defaults to `100`):
            The mean mixing coefficient (alpha) of keys and of values is added to every training log, as
            `bitune/alpha_keys_mean` and `bitune/alpha_values_mean`. Every layer's alphas
            (`bitune/alpha_keys/layer_<i>`, `bitune/alpha_values/layer_<i>`) are added to the first training log and
            then to the first log after at least this many optimizer steps since the last per-layer log. `None` or `0`
            never logs per-layer values.

    > [!NOTE]
    > Defaults that differ from [`~trl.SFTConfig`]:
    > - `activation_checkpointing_kwargs` (`gradient_checkpointing_kwargs` before transformers 5.23): `use_reentrant`
    >   defaults to `False`. Bitune runs three passes that share the key/value projections through the mixed cache,
    >   and reentrant checkpointing silently drops their gradients, so `use_reentrant=True` is refused.
    > - `activation_checkpointing` defaults to `True` (TRL's default) under that name, where transformers has it, so
    >   that the default does not go through the deprecated `gradient_checkpointing` (which still works).

        bidirectional_lr_ratio (`float`, *optional*, defaults to `1.0`):
            The bidirectional weight set trains at `learning_rate` times this (the causal set at `learning_rate`), in
            the spirit of LoRA+; see `peft_bitune.training.optimizers`. Must be finite and positive.
        mixing_lr_ratio (`float`, *optional*, defaults to `1.0`):
            The mixing scalars train at `learning_rate` times this. Under Adam a step of the base rate can move an
            alpha by up to `learning_rate / mix_scale`; a ratio below 1 slows them. Must be finite and positive.
        mixing_warmup_steps (`int`, *optional*, defaults to `0`):
            A mixing warm-up: for this many optimizer steps the learned alphas are scaled by a factor that grows
            linearly from 0 (the causal cache, as plain LoRA reads the prompt) to 1, so that the answer pass first
            learns over a cache it knows and the bidirectional read comes in gradually. Both weight sets and the
            scalars train throughout. At most `max_steps`; 0 turns it off.

    `bidirectional_lr_ratio`, `mixing_lr_ratio` and `mixing_warmup_steps` are read when training starts, so values
    assigned after the trainer is made are used (and checked). A run resumed from a checkpoint must use the values it
    was trained with, which the checkpoint records: other values are refused, naming the checkpoint's.

    Packing (`packing`, `eval_packing`, with TRL's `"bfd"` or `"bfd_split"`) and `padding_free` batches are read
    example by example, computing no padding. Refused (with the reason in the error): `packing_strategy="wrapped"`,
    which cuts examples mid-instruction.
    """

    mixing_logging_steps: int | None = field(
        default=100,
        metadata={
            "help": "Log every layer's mixing coefficient with the first training log after at least this many "
            "optimizer steps since the last per-layer log (and with the first log). The means are logged at every "
            "log. None or 0 turns the per-layer values off."
        },
    )

    bidirectional_lr_ratio: float = field(
        default=1.0,
        metadata={"help": "The bidirectional weight set trains at learning_rate times this (LoRA+-style)."},
    )
    mixing_lr_ratio: float = field(
        default=1.0, metadata={"help": "The mixing scalars train at learning_rate times this."}
    )
    mixing_warmup_steps: int = field(
        default=0,
        metadata={
            "help": "Optimizer steps over which the mixing is released linearly from the causal cache (0) to the "
            "learned mix (1). 0: no warm-up."
        },
    )

    if compat.CHECKPOINTING_ARGUMENT == "activation_checkpointing":
        # TRL sets its default (True) on the deprecated alias, which makes transformers warn about every config; the
        # default goes to the new name in `__post_init__` instead, so an explicit alias value still takes effect.
        activation_checkpointing: bool | None = field(
            default=None,
            metadata={
                **TrainingArguments.__dataclass_fields__["activation_checkpointing"].metadata,
                "help": "Enable activation checkpointing to trade compute for memory. Defaults to True (TRL's "
                "default).",
            },
        )
        gradient_checkpointing: bool | None = field(
            default=None, metadata=TrainingArguments.__dataclass_fields__["gradient_checkpointing"].metadata
        )

    def __post_init__(self) -> None:
        if compat.CHECKPOINTING_ARGUMENT == "activation_checkpointing":
            if self.activation_checkpointing is None and self.gradient_checkpointing is None:
                self.activation_checkpointing = True
        super().__post_init__()
        if self.mixing_logging_steps is not None and self.mixing_logging_steps < 0:
            raise ValueError(
                f"`mixing_logging_steps` must be a positive integer or None, got {self.mixing_logging_steps}."
            )
        refuse_wrapped_packing(self)
        check_recipe_options(self)
        self._default_to_non_reentrant_checkpointing()

    def _default_to_non_reentrant_checkpointing(self) -> None:
        """Make `use_reentrant=False` explicit (whatever the library default), and refuse `True`."""
        if not getattr(self, compat.CHECKPOINTING_ARGUMENT):
            return
        kwargs = dict(getattr(self, compat.CHECKPOINTING_KWARGS_ARGUMENT) or {})
        if kwargs.get("use_reentrant", False):
            raise ValueError(
                "Bitune needs non-reentrant gradient checkpointing: reentrant checkpointing drops the gradients of "
                "the key/value projections that flow through the mixed prompt cache. Remove `use_reentrant` from "
                f"`{compat.CHECKPOINTING_KWARGS_ARGUMENT}` (it defaults to False here) or set it to False."
            )
        kwargs["use_reentrant"] = False
        for name in compat.CHECKPOINTING_KWARGS_ARGUMENTS:  # an alias mirrors the new name, as in transformers
            setattr(self, name, kwargs)


def check_recipe_options(args: Any) -> None:
    """Refuse learning-rate multiples and a mixing warm-up that make no sense, before any work (the trainer checks the
    warm-up against the number of steps again when training starts, for runs given in epochs)."""
    for name in ("bidirectional_lr_ratio", "mixing_lr_ratio"):
        check_lr_ratio(name, getattr(args, name))
    check_warmup_steps(args.mixing_warmup_steps, args.max_steps)


# The `SFTConfig` values Bitune refuses, and why: told in the error, and in `bitune-sft --help`.
REFUSED_VALUES = {
    "packing_strategy": {
        "wrapped": "it cuts examples anywhere, mid-instruction or mid-answer, and Bitune reads each packed example as "
        "an instruction followed by its answer. Use \"bfd\" (the default, which truncates an example longer than "
        "`max_length`) or \"bfd_split\" (which splits it; a piece that begins inside an answer is refused at its "
        "batch)",
    },
}


def refuse_wrapped_packing(args: Any) -> None:
    """Refuse packing strategies whose rows are not whole examples (checked when the config is made, and again by the
    trainer, since the fields can be set afterwards). `"bfd"`, `"bfd_split"` and `padding_free` batches are read
    example by example (`peft_bitune.tuner.packing`)."""
    packs = args.packing or args.eval_packing
    reason = REFUSED_VALUES["packing_strategy"].get(args.packing_strategy)
    if packs and reason is not None:
        raise ValueError(f"`packing_strategy={args.packing_strategy!r}` is not supported by Bitune: {reason}.")
