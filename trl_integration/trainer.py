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
import json
import os
import re
import textwrap
import warnings
from collections.abc import Callable
from typing import Any

import torch
import transformers
from datasets import Dataset, IterableDataset
from peft import PeftConfig, PeftModel
from peft.utils import SAFETENSORS_WEIGHTS_NAME
from transformers import TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from peft_bitune import BituneMixingCallback, BituneModel
from peft_bitune.constants import IGNORE_INDEX
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
    write_recipe,
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

    def __init__(
        self,
        model: str | transformers.PreTrainedModel | PeftModel,
        args: BituneSFTConfig | TrainingArguments | None = None,
        data_collator: Any = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_loss_func: Callable | None = None,
        compute_metrics: Callable | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        optimizer_cls_and_kwargs: tuple | None = None,
        preprocess_logits_for_metrics: Callable | None = None,
        quantization_config: Any = None,
        peft_config: PeftConfig | None = None,
        formatting_func: Callable[[dict], str] | None = None,
    ) -> None:
        args = as_bitune_config(args, model)
        if optimizers[0] is not None and (args.bidirectional_lr_ratio != 1.0 or args.mixing_lr_ratio != 1.0):
            raise ValueError(OWN_OPTIMIZER_WITH_RATIOS)
        self._given_optimizer = optimizers[0]
        peft_config = bitune_peft_config(model, peft_config)
        check_training_setup(args, peft_config or model.peft_config[model.active_adapter])
        if formatting_func is not None:
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
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            quantization_config=quantization_config,
            peft_config=peft_config,
            formatting_func=formatting_func,
        )
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
    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer, with the learning rate of each part of the adapter when
        `args.bidirectional_lr_ratio` or `args.mixing_lr_ratio` differ from 1 (`peft_bitune.training.optimizers`)."""
        rates = (self.args.bidirectional_lr_ratio, self.args.mixing_lr_ratio)
        default_rates = rates == (1.0, 1.0)
        if self.optimizer is not None and self.optimizer is self._given_optimizer and not default_rates:
            raise ValueError(OWN_OPTIMIZER_WITH_RATIOS)  # the ratios were set after the trainer was made
        made_with = self.__dict__.get("_optimizer_rates")  # the ratios of the optimizer this method made, if any
        if self.optimizer is not None and made_with is not None and rates != made_with:
            raise ValueError(
                f"`bidirectional_lr_ratio` and `mixing_lr_ratio` are now {rates}, but this trainer's optimizer was "
                f"made with {made_with} (by an earlier `train()`), and a trainer makes its optimizer once: the new "
                "ratios would be ignored. Set `trainer.optimizer = None` before `train()` to make it again with the "
                "new ratios (its state starts afresh), or make a new trainer."
            )
        if self.optimizer is not None or default_rates:
            if self.optimizer is None:
                self._optimizer_rates = rates
            return super().create_optimizer(model) if model is not None else super().create_optimizer()
        opt_model = self.model if model is None else model
        if self.optimizer_cls_and_kwargs is not None:
            optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
        else:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        optimizer_kwargs = dict(optimizer_kwargs)
        own_groups = {"params", "model", "optimizer_dict"} & set(optimizer_kwargs)
        if own_groups or not isinstance(optimizer_cls, type) or not issubclass(optimizer_cls, torch.optim.Optimizer):
            raise ValueError(
                f"`optim={self.args.optim}` builds its own parameter groups, so the learning-rate multiples "
                "`bidirectional_lr_ratio` and `mixing_lr_ratio` cannot be applied to it. Use an optimizer such as "
                "`adamw_torch`, or leave both ratios at 1."
            )
        groups = bitune_parameter_groups(
            opt_model, self.args.learning_rate, self.args.bidirectional_lr_ratio, self.args.mixing_lr_ratio,
            self.args.weight_decay, self.get_decay_parameter_names(opt_model),
        )
        self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        self._optimizer_rates = rates
        return self.optimizer

    # ------------------------------------------------------------------ the recipe of a resumed run
    # A checkpoint records its recipe options next to the optimizer and scheduler, and a run resumed from it must use
    # the same (`check_resumed_recipe`): checked before the weights are loaded, and before the optimizer for DeepSpeed,
    # which loads the weights on its own.
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            write_recipe(output_dir, self.args)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        check_resumed_recipe(resume_from_checkpoint, self.args, self._given_optimizer is not None)
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        check_resumed_recipe(checkpoint, self.args, self._given_optimizer is not None)
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
            for checkpoint in _checkpoints_newest_first(self.args.output_dir):
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
_CHECKPOINT_FOLDER = re.compile(rf"^{re.escape(PREFIX_CHECKPOINT_DIR)}-(\d+)$")


def _checkpoints_newest_first(output_dir: str) -> list[str]:
    """The `checkpoint-N` folders of `output_dir`, highest step first (the ones the Trainer resumes from)."""
    steps = {}
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_FOLDER.match(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            steps[os.path.join(output_dir, name)] = int(match.group(1))
    return sorted(steps, key=steps.get, reverse=True)


def incomplete_checkpoint_problem(checkpoint: str) -> str | None:
    """What is missing or broken in a Trainer checkpoint folder, or `None` if it is complete: its
    `trainer_state.json`, written last, must be a whole JSON object, and its adapter weights a whole safetensors
    file."""
    state = os.path.join(checkpoint, TRAINER_STATE_NAME)
    if not os.path.isfile(state):
        return f"it has no {TRAINER_STATE_NAME}, which the Trainer writes last"
    try:
        with open(state, encoding="utf-8") as file:
            is_object = isinstance(json.load(file), dict)
    except (json.JSONDecodeError, UnicodeDecodeError):
        is_object = False
    if not is_object:
        return f"its {TRAINER_STATE_NAME} is not a complete JSON object"
    weights = os.path.join(checkpoint, SAFETENSORS_WEIGHTS_NAME)
    problem = safetensors_problem(weights) if os.path.lexists(weights) else None
    if problem is not None:
        return f"its {SAFETENSORS_WEIGHTS_NAME} is not a complete safetensors file ({problem})"
    return None


def _skipped(skipped: list[tuple[str, str]]) -> str:
    return "; ".join(f"'{checkpoint}' ({problem})" for checkpoint, problem in skipped)
