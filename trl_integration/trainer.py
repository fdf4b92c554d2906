"""`BituneSFTTrainer`: TRL's `SFTTrainer` training a Bitune adapter.

Data preparation, chat templates, collation, logging, evaluation, checkpointing and `push_to_hub` are TRL's own. The
instruction/answer boundaries reach the model through the labels TRL builds (each run of unsupervised tokens followed
by supervised ones is an instruction and its answer; several such runs make a multi-turn row), so the subclass only has
to:

- apply a Bitune `peft_config` (the default) and refuse any other;
- refuse, before any work, data and settings that carry no boundary or break the three-pass forward (`checks.py`);
- hand TRL's own `compute_loss` the instruction boundary for the forwards it makes without labels; the fused-head
  call it makes for the loss and its metrics (token accuracy, entropy) is answered by the Bitune forward itself;
- add the mixing coefficients to the training logs (a `BituneMixingCallback`, which a plain `Trainer` can use too).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import textwrap
import warnings
from typing import Any

import torch
from datasets import Dataset
from peft.utils import SAFETENSORS_WEIGHTS_NAME
from transformers import TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_optimizer import is_optimizer_factory
from transformers.trainer_utils import sort_checkpoints
from trl import SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from peft_bitune import BituneMixingCallback, BituneModel
from peft_bitune.constants import IGNORE_INDEX
from peft_bitune.persistence.config_files import read_json_object
from peft_bitune.persistence.weights_files import safetensors_problem
from peft_bitune.training.callbacks import BituneMixingWarmupCallback, gathered_mixing_scalars
from peft_bitune.training.optimizers import bitune_parameter_groups
from peft_bitune.tuner.find_tuner import find_bitune_tuner

from .checks import (
    FORMATS_THAT_WORK,
    RECIPE_DEFAULTS,
    as_bitune_config,
    bitune_peft_config,
    check_dataset_format,
    check_loss_type,
    check_prepared_labels,
    check_resumed_recipe,
    check_rows_kept,
    check_training_setup,
    named_eval_datasets,
)
from .config import BituneSFTConfig
from .model_cards import BituneModelCardMixin

OWN_OPTIMIZER_WITH_RATIOS = (
    "`bidirectional_lr_ratio` and `mixing_lr_ratio` set the learning rates of the optimizer the trainer creates, but "
    "`optimizers` gives one of your own. Build it with `peft_bitune.create_bitune_optimizer(model, ..., "
    "bidirectional_lr_ratio=..., mixing_lr_ratio=...)` and leave both ratios at 1 in the config."
)


class BituneSFTTrainer(BituneModelCardMixin, SFTTrainer):
    """
    Supervised fine-tuning of a Bitune adapter with TRL: an [`~trl.SFTTrainer`] whose model reads every instruction
    twice (causal and bidirectional weights), mixes the two key/value caches, and learns the answer.

    Every argument means what it means for [`~trl.SFTTrainer`], with these differences:

    - `peft_config` defaults to `BituneConfig()` (LoRA r=8 on all linear layers for both weight sets). Any other PEFT
      config, or a `PeftModel` holding a non-Bitune adapter, is refused.
    - `args` is a [`BituneSFTConfig`]; an `SFTConfig` or `TrainingArguments` is converted to one.
    - The dataset must mark which tokens are the instruction: prompt-completion rows, conversational rows with
      `assistant_only_loss=True` (every assistant turn is an answer, every run of other turns before it an
      instruction), or tokenized rows with labels that are -100 on the instruction. Plain-text language
      modelling data (a `text` column or a `formatting_func`) has no instruction and is refused, as are packing and
      padding-free batches.
    - Training logs gain `bitune/alpha_keys_mean` and `bitune/alpha_values_mean`, and the per-layer alphas every
      `args.mixing_logging_steps` steps, from a [`BituneMixingCallback`] added first to the callbacks (unless
      `callbacks` already holds one).

    Example:

    ```python
    >>> from trl_integration import BituneSFTConfig, BituneSFTTrainer
    >>> trainer = BituneSFTTrainer(
    ...     model="google/gemma-2b",
    ...     args=BituneSFTConfig(output_dir="out", per_device_train_batch_size=8, learning_rate=3e-4),
    ...     train_dataset=dataset,  # prompt-completion rows
    ... )  # doctest: +SKIP
    >>> trainer.train()  # doctest: +SKIP
    >>> trainer.save_model()  # doctest: +SKIP
    >>> # a Bitune adapter: load it with `import peft_bitune` and `PeftModel.from_pretrained`
    ```
    """

    _tag_names = ["trl", "sft", "bitune"]
    _name = "Bitune SFT"
    # TRL's model card cites the method's paper from this.
    _paper = {
        "title": "Bitune: Leveraging Bidirectional Attention to Improve Decoder-Only LLMs",
        "id": "2405.14862",
        "citation": textwrap.dedent("""\
            @misc{kopiczko2024bitune,
                title        = {{Bitune: Leveraging Bidirectional Attention to Improve Decoder-Only LLMs}},
                author       = {Dawid J. Kopiczko and Tijmen Blankevoort and Yuki M. Asano},
                year         = 2024,
                eprint       = {arXiv:2405.14862},
            }"""),
    }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # `SFTTrainer`'s own parameters, bound by its signature, so that one TRL adds reaches it unnamed here.
        bound = inspect.signature(super().__init__).bind(*args, **kwargs)
        arguments = bound.arguments
        model, data_collator = arguments["model"], arguments.get("data_collator")
        train_dataset, eval_dataset = arguments.get("train_dataset"), arguments.get("eval_dataset")
        args = arguments["args"] = as_bitune_config(arguments.get("args"), model)
        if arguments.get("optimizers", (None, None))[0] is not None and self._lr_ratios(args) != (1.0, 1.0):
            raise ValueError(OWN_OPTIMIZER_WITH_RATIOS)
        peft_config = arguments["peft_config"] = bitune_peft_config(model, arguments.get("peft_config"))
        check_training_setup(args, peft_config or model.peft_config[model.active_adapter])
        if arguments.get("formatting_func") is not None:
            raise ValueError(
                "`formatting_func` turns every row into plain text, which has no instruction/answer boundary for "
                f"Bitune to read. Format the rows into one of the formats that work instead: {FORMATS_THAT_WORK}."
            )
        rows_given = {}
        if train_dataset is not None:
            skip_prepare = bool((args.dataset_kwargs or {}).get("skip_prepare_dataset", False))
            named = {"train_dataset": train_dataset, **named_eval_datasets(eval_dataset)}
            for name, dataset in named.items():
                check_dataset_format(dataset, name, args, skip_prepare, custom_collator=data_collator is not None)
            rows_given = {name: len(dataset) for name, dataset in named.items() if isinstance(dataset, Dataset)}
        # The learning-rate multiples of the optimizer this trainer made (`create_optimizer`); `None` while its
        # optimizer is none or one of the user's: nothing else tells the two apart, or says what a made one used.
        self._optimizer_rates: tuple[float, float] | None = None
        super().__init__(*bound.args, **bound.kwargs)
        self._check_after_setup()
        prepared = {"train_dataset": self.train_dataset, **named_eval_datasets(self.eval_dataset)}
        check_rows_kept(rows_given, prepared, self.args)
        keep_mixing_scalars_in_float32(self.model)
        if not any(isinstance(callback, BituneMixingWarmupCallback) for callback in self.callback_handler.callbacks):
            # Reads `args.mixing_warmup_steps` when training starts: a value set after the trainer is made is used,
            # and checked against the number of steps.
            self.add_callback(BituneMixingWarmupCallback())
        if not any(isinstance(callback, BituneMixingCallback) for callback in self.callback_handler.callbacks):
            # First, so that the reporting integrations (`report_to`) see the values it adds to the logs.
            mixing = BituneMixingCallback(self.args.mixing_logging_steps, gather=self._whole_mixing_scalars)
            self.callback_handler.callbacks.insert(0, mixing)

    # ------------------------------------------------------------------ checks that need the built trainer
    def _check_after_setup(self) -> None:
        if self.aux_loss_enabled:
            raise ValueError(
                "The Mixture-of-Experts load-balancing loss is not supported by the Bitune forward, which does not "
                "return router logits from its three passes. Set `router_aux_loss_coef=0.0` in the config."
            )
        parallelism = self.accelerator.parallelism_config
        if parallelism is not None and (parallelism.cp_enabled or getattr(parallelism, "sp_enabled", False)):
            raise ValueError(
                "Context and sequence parallelism shard each row along the sequence, but the Bitune forward needs "
                "whole rows to split them into instruction and answer. Use data parallelism (DDP or FSDP) instead."
            )
        if isinstance(self.data_collator, DataCollatorForLanguageModeling):
            datasets = {"train_dataset": self.train_dataset, **named_eval_datasets(self.eval_dataset)}
            for name, dataset in datasets.items():
                check_prepared_labels(dataset, name)

    # ------------------------------------------------------------------ optimizer
    @staticmethod
    def _lr_ratios(args: BituneSFTConfig) -> tuple[float, float]:
        return (args.bidirectional_lr_ratio, args.mixing_lr_ratio)

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """[`~transformers.Trainer.create_optimizer`], which makes the optimizer once: learning-rate multiples that it
        would ignore (set since it was made, or set with an optimizer of one's own) are refused instead."""
        rates = self._lr_ratios(self.args)
        if self.optimizer is not None and self._optimizer_rates is None and rates != (1.0, 1.0):
            raise ValueError(OWN_OPTIMIZER_WITH_RATIOS)  # the ratios were set after the trainer was made
        if self.optimizer is not None and self._optimizer_rates not in (None, rates):
            raise ValueError(
                f"`bidirectional_lr_ratio` and `mixing_lr_ratio` are now {rates}, but this trainer's optimizer was "
                f"made with {self._optimizer_rates} (by an earlier `train()`), and a trainer makes its optimizer "
                "once: the new ratios would be ignored. Set `trainer.optimizer = None` before `train()` to make it "
                "again with the new ratios (its state starts afresh), or make a new trainer."
            )
        if self.optimizer is None and self.optimizer_cls_and_kwargs is not None and rates != (1.0, 1.0):
            raise ValueError(
                "`optimizer_cls_and_kwargs` makes the Trainer build the optimizer over its own parameter groups, so "
                "`bidirectional_lr_ratio` and `mixing_lr_ratio` cannot reach it. Choose the optimizer with `optim` "
                "and `optim_args` instead, or build it with `peft_bitune.create_bitune_optimizer(model, ..., "
                "bidirectional_lr_ratio=..., mixing_lr_ratio=...)` and pass `optimizers=(optimizer, None)`."
            )
        made_here = self.optimizer is None
        optimizer = super().create_optimizer(model)
        if made_here:
            self._optimizer_rates = rates
        return optimizer

    def get_optimizer_cls_and_kwargs(self, args: TrainingArguments, model: Any = None) -> tuple[Any, dict[str, Any]]:
        """
        The optimizer `args.optim` names, over the parameter groups of `peft_bitune.training.optimizers` (a learning
        rate per part of the adapter) when `args.bidirectional_lr_ratio` or `args.mixing_lr_ratio` differ from 1.
        The Trainer takes the groups from the `params` this returns, the hook it keeps for optimizers that group
        parameters themselves (GaLore). An instance method where the Trainer's is static: the Trainer calls it on
        itself, and the groups follow its `get_decay_parameter_names`.
        """
        optimizer_cls, optimizer_kwargs = super().get_optimizer_cls_and_kwargs(args, model)
        if model is None or self._lr_ratios(args) == (1.0, 1.0):
            return optimizer_cls, optimizer_kwargs
        if {"params", "model", "optimizer_dict"} & set(optimizer_kwargs) or is_optimizer_factory(optimizer_cls):
            raise ValueError(
                f"`optim={getattr(args.optim, 'value', args.optim)}` builds its own parameter groups, so the "
                "learning-rate multiples `bidirectional_lr_ratio` and `mixing_lr_ratio` cannot be applied to it. Use "
                "an optimizer such as `adamw_torch`, or leave both ratios at 1."
            )
        groups = bitune_parameter_groups(
            model, args.learning_rate, args.bidirectional_lr_ratio, args.mixing_lr_ratio, args.weight_decay,
            self.get_decay_parameter_names(model),
        )
        return optimizer_cls, {**optimizer_kwargs, "params": groups}

    # ------------------------------------------------------------------ the recipe of a resumed run
    # A checkpoint holds its recipe options in the arguments the Trainer saves with it, and a run resumed from it must
    # use the same (`check_resumed_recipe`): checked before the weights are loaded, and before the optimizer for
    # DeepSpeed, which loads the weights on its own.
    def _optimizer_is_given(self) -> bool:
        return self.optimizer is not None and self._optimizer_rates is None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        check_resumed_recipe(resume_from_checkpoint, self.args, self._optimizer_is_given())
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        check_resumed_recipe(checkpoint, self.args, self._optimizer_is_given())
        super()._load_optimizer_and_scheduler(checkpoint)

    # ------------------------------------------------------------------ loss and metrics
    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """
        TRL's own loss and metrics (`SFTTrainer.compute_loss`) on the Bitune forward, which answers TRL's fused-head
        call on its answer passes (`peft_bitune.tuner.fused_head`). The batch gains a `prompt_mask` read from its
        labels (1 where they are -100): the forwards TRL makes without labels, for `compute_loss_func`, label smoothing
        and `return_outputs`, then find the same instructions and answers as the fused call.
        """
        if "labels" not in inputs:
            raise ValueError(
                "The batch has no `labels`: Bitune finds each row's instructions and answers from them (-100 on "
                "instruction tokens), and TRL's loss and metrics need them. Make the data collator return labels."
            )
        check_loss_type(self.args)  # again: `args.loss_type` may have been changed after the trainer was made
        inputs = {**inputs, "prompt_mask": (inputs["labels"] == IGNORE_INDEX).long()}
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    # ------------------------------------------------------------------ model card
    def _bitune_recipe(self) -> dict[str, Any]:
        """The training options beyond the paper that differ from their defaults, for the model card."""
        return {name: getattr(self.args, name) for name, default in RECIPE_DEFAULTS.items()
                if getattr(self.args, name) != default}

    def _whole_mixing_scalars(self, bitune: BituneModel) -> contextlib.AbstractContextManager:
        """
        Outside the forward, sharded training keeps only a shard of each parameter on a process. FSDP2 exposes the
        scalars as DTensors (gathered when the callback reads them); FSDP1 and ZeRO-3 must gather them. FSDP1 shards
        them inside the wrapper only the trainer holds; ZeRO-3 is recognised from the parameters, as the callback's
        default does. Every process logs, so every process takes part.
        """
        if self.is_fsdp_enabled and getattr(self.accelerator.state.fsdp_plugin, "fsdp_version", 1) == 1:
            from torch.distributed.fsdp import FullyShardedDataParallel

            return FullyShardedDataParallel.summon_full_params(self.model_wrapped, writeback=False)
        return gathered_mixing_scalars(bitune)

    # ------------------------------------------------------------------ resuming
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """[`~transformers.Trainer.train`], resuming from the last *complete* checkpoint of `args.output_dir` when
        `resume_from_checkpoint=True`, and refusing a named checkpoint that is incomplete (see
        `_complete_checkpoint`). However training ends (finished, interrupted or failed), the mixing warm-up's release
        is lifted: it scales the mix during training only, and the model in memory must mix as its saved copy does."""
        try:
            return super().train(self._complete_checkpoint(resume_from_checkpoint), *args, **kwargs)
        finally:
            bitune = find_bitune_tuner(self.accelerator.unwrap_model(self.model))
            for mixer in bitune.bitune_mixers.values() if bitune is not None else ():
                mixer.set_release(1.0)

    def _complete_checkpoint(self, resume_from_checkpoint: str | bool | None) -> str | bool | None:
        """
        The checkpoint to resume from. The Trainer writes a checkpoint file by file, `trainer_state.json` last, and
        with `True` takes the highest `checkpoint-N` folder even when a crash stopped its writing, then fails on a raw
        `SafetensorError` or a missing `trainer_state.json`. Here an incomplete checkpoint is skipped with a warning
        that names it and the one used instead (the one before it is complete, and resuming from it repeats only the
        steps since; the incomplete folder is left as it is and rewritten when training reaches its step again). A
        checkpoint named by path is the user's choice: if incomplete, it is refused, naming what is wrong.
        """
        if resume_from_checkpoint is True and os.path.isdir(self.args.output_dir):
            skipped = []
            for checkpoint in reversed(sort_checkpoints(self.args.output_dir)):  # newest first
                problem = incomplete_checkpoint_problem(checkpoint)
                if problem is None:
                    if skipped and self.is_world_process_zero():
                        warnings.warn(
                            f"Resuming from '{checkpoint}', not from the later checkpoints {_skipped(skipped)}, whose "
                            "writing was interrupted. The steps since are trained again.",
                            stacklevel=3,
                        )
                    return checkpoint
                skipped.append((checkpoint, problem))
            if skipped:
                raise ValueError(
                    f"`resume_from_checkpoint=True` found no complete checkpoint in '{self.args.output_dir}': "
                    f"{_skipped(skipped)}. Their writing was interrupted. Train from the start "
                    "(`resume_from_checkpoint=None`), after removing them or with another `output_dir`."
                )
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)) and os.path.isdir(resume_from_checkpoint):
            problem = incomplete_checkpoint_problem(str(resume_from_checkpoint))
            if problem is not None:
                raise ValueError(
                    f"Cannot resume from '{resume_from_checkpoint}': {problem}. Its writing was interrupted: resume "
                    "from an earlier checkpoint, or pass `resume_from_checkpoint=True` to take the last complete one."
                )
        return resume_from_checkpoint


# ---------------------------------------------------------------------- model helpers
def keep_mixing_scalars_in_float32(model: torch.nn.Module) -> None:
    """
    Restore float32 mixing scalars. TRL casts every trainable parameter of a quantized (QLoRA) model to bf16, but bf16
    cannot represent the small steps the scalars take (see `BituneKVMixer`).
    """
    bitune = find_bitune_tuner(model)
    for parameter in bitune.bitune_mixers.parameters() if bitune is not None else ():
        if parameter.dtype != torch.float32:
            parameter.data = parameter.data.float()


# ---------------------------------------------------------------------- checkpoints
def incomplete_checkpoint_problem(checkpoint: str) -> str | None:
    """What is missing or broken in a Trainer checkpoint folder, or `None` if it is complete: its
    `trainer_state.json`, written last, must be a whole JSON object, and its adapter weights a whole safetensors
    file."""
    state = os.path.join(checkpoint, TRAINER_STATE_NAME)
    if not os.path.isfile(state):
        return f"it has no {TRAINER_STATE_NAME}, which the Trainer writes last"
    try:
        read_json_object(state)
    except ValueError:
        return f"its {TRAINER_STATE_NAME} is not a complete JSON object"
    weights = os.path.join(checkpoint, SAFETENSORS_WEIGHTS_NAME)
    problem = safetensors_problem(weights) if os.path.lexists(weights) else None
    if problem is not None:
        return f"its {SAFETENSORS_WEIGHTS_NAME} is not a complete safetensors file ({problem})"
    return None


def _skipped(skipped: list[tuple[str, str]]) -> str:
    return "; ".join(f"'{checkpoint}' ({problem})" for checkpoint, problem in skipped)
