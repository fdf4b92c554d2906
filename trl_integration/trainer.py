"""`BituneSFTTrainer`: TRL's `SFTTrainer` training a Bitune adapter.

Data preparation, chat templates, collation, logging, evaluation, checkpointing and `push_to_hub` are TRL's own. The
instruction/answer boundaries reach the model through the labels TRL builds (each run of unsupervised tokens followed
by supervised ones is an instruction and its answer; several such runs make a multi-turn row), so the subclass only has
to:

- apply a Bitune `peft_config` (the default) and refuse any other;
- refuse, before any work, data and settings that carry no boundary or break the three-pass forward;
- compute the loss through the Bitune forward. TRL's own `compute_loss` asks the model for a fused LM head over the
  whole input, which would read the instruction causally with one weight set, so it is replaced; TRL's metrics
  (token accuracy, entropy) are computed from the Bitune forward's logits instead;
- add the mixing coefficients to the training logs (a `BituneMixingCallback`, which a plain `Trainer` can use too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch
import transformers
from datasets import Dataset, IterableDataset
from packaging.version import Version
from peft import PeftConfig, PeftModel
from torch.nn import functional as F
from transformers import TrainingArguments
from trl import SFTTrainer
from trl.data_utils import is_conversational, is_conversational_from_value
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
from trl.trainer.utils import entropy_from_logits

from peft_bitune import BituneConfig, BituneMixingCallback, BituneModel, compat
from peft_bitune.callbacks import gathered_mixing_scalars
from peft_bitune.common import IGNORE_INDEX, format_rows
from peft_bitune.lookup import find_bitune_tuner

from .config import BituneSFTConfig, refuse_packing

_FORMATS_THAT_WORK = (
    "prompt-completion rows (`prompt` and `completion` columns, plain text or conversational) with "
    "`completion_only_loss` left at None or True; conversational rows (`messages`) with `assistant_only_loss=True`; "
    "or pre-tokenized rows with `input_ids` and `labels` that are -100 on the instruction"
)


class BituneSFTTrainer(SFTTrainer):
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
        args = _as_bitune_config(args, model)
        peft_config = _bitune_peft_config(model, peft_config)
        _check_training_setup(args, peft_config or model.peft_config[model.active_adapter])
        if formatting_func is not None:
            raise ValueError(
                "`formatting_func` turns every row into plain text, which has no instruction/answer boundary for "
                f"Bitune to read. Format the rows into one of the formats that work instead: {_FORMATS_THAT_WORK}."
            )
        if train_dataset is not None:
            skip_prepare = bool((args.dataset_kwargs or {}).get("skip_prepare_dataset", False))
            named = {"train_dataset": train_dataset, **_named_eval_datasets(eval_dataset)}
            for name, dataset in named.items():
                _check_dataset_format(dataset, name, args, skip_prepare, custom_collator=data_collator is not None)
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
        keep_mixing_scalars_in_float32(self.model)
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
            datasets = {"train_dataset": self.train_dataset, **_named_eval_datasets(self.eval_dataset)}
            for name, dataset in datasets.items():
                _check_prepared_labels(dataset, name)

    # ------------------------------------------------------------------ loss and metrics
    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """The Bitune forward's loss, with TRL's metrics (entropy, token accuracy, token count) from its logits."""
        mode = "train" if self.model.training else "eval"
        if "labels" not in inputs:
            raise ValueError(
                "The batch has no `labels`: Bitune finds each row's instructions and answers from them (-100 on "
                "instruction tokens), and TRL's metrics need them. Make the data collator return labels."
            )
        check_loss_type(self.args)  # again: `args.loss_type` may have been changed after the trainer was made
        labels = inputs["labels"]
        outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
        # The logits are aligned with the input (position t predicts token t + 1) and zero before the last instruction
        # token, where nothing is supervised.
        target_mask = labels[:, 1:] != IGNORE_INDEX
        targets = labels[:, 1:][target_mask]

        if self.compute_loss_func is not None:
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        elif self.label_smoother is not None and self.args.loss_type == "nll":
            kwargs = {}
            if Version(transformers.__version__) >= Version("5.15.0"):
                kwargs["num_items_in_batch"] = num_items_in_batch
            loss = self.label_smoother(outputs, labels, shift_labels=True, **kwargs)
        elif self.args.loss_type == "dft":
            # Dynamic Fine-Tuning (https://huggingface.co/papers/2508.05629): each token's NLL times its probability
            target_logits = outputs.logits[:, :-1][target_mask].float()  # (num_targets, vocab)
            log_probs = F.log_softmax(target_logits, dim=-1).gather(1, targets[:, None]).squeeze(1)
            num_tokens = target_mask.sum() if num_items_in_batch is None else num_items_in_batch
            loss = -(log_probs * log_probs.exp().detach()).sum() / torch.as_tensor(num_tokens).clamp(min=1)
        else:  # "nll"
            loss = outputs.loss
        # As in `Trainer.compute_loss`: `num_items_in_batch` counts every rank's tokens, and DDP averages gradients.
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())

        with torch.no_grad():
            # In the logits' dtype, as TRL's own metrics
            self._record_token_metrics(mode, outputs.logits[:, :-1][target_mask], targets, inputs)
        return (loss, outputs) if return_outputs else loss

    def _record_token_metrics(
        self, mode: str, target_logits: torch.Tensor, targets: torch.Tensor, inputs: dict[str, Any]
    ) -> None:
        """TRL's `entropy`, `mean_token_accuracy` and `num_tokens`, over the supervised next-token predictions."""
        entropy = entropy_from_logits(target_logits)  # chunked: no (num_targets, vocab) float32 softmax at once
        is_top1 = target_logits.argmax(dim=-1) == targets
        num_valid = self.accelerator.gather_for_metrics(torch.tensor(targets.numel(), device=targets.device)).sum()
        entropy_sum = self.accelerator.gather_for_metrics(entropy.sum()).sum()
        num_correct = self.accelerator.gather_for_metrics(is_top1.sum()).sum()
        self._metrics[mode]["entropy"].append((entropy_sum / num_valid).item() if num_valid > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append((num_correct / num_valid).item() if num_valid > 0 else 0.0)
        if mode == "train":
            num_tokens = self.accelerator.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
            self._total_train_tokens += num_tokens // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]

    # ------------------------------------------------------------------ model card
    def create_model_card(
        self, model_name: str | None = None, dataset_name: str | None = None, tags: str | list[str] | None = None
    ) -> None:
        """
        TRL's model card, made right for a Bitune adapter: it is named after the output (the Hub repo or the output
        folder) when `model_name` is not given, names the base model also when that is a local folder, and replaces
        TRL's `pipeline(...)` quick start (which cannot load a Bitune adapter) with the lines that do.
        """
        location = getattr(self, "hub_model_id", None) or self.args.hub_model_id or self.args.output_dir
        if model_name is None:
            model_name = os.path.basename(str(location).rstrip("/"))
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if self.is_world_process_zero():
            from peft_bitune.model_card import write_trl_model_card

            bitune = find_bitune_tuner(self.accelerator.unwrap_model(self.model))
            write_trl_model_card(self.args.output_dir, bitune.peft_config[bitune.active_adapter], location)

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


# ---------------------------------------------------------------------- argument checks
def _as_bitune_config(args: TrainingArguments | None, model: Any) -> BituneSFTConfig:
    """`BituneSFTConfig` as given, or built from the other configs the way `SFTTrainer` converts
    `TrainingArguments`."""
    if isinstance(args, BituneSFTConfig):
        return args
    if args is None:
        name = model if isinstance(model, str) else getattr(model.config, "name_or_path", "model") or "model"
        return BituneSFTConfig(f"{os.path.basename(str(name).rstrip('/'))}-Bitune-SFT")
    if not isinstance(args, TrainingArguments):
        raise TypeError(f"`args` must be a `BituneSFTConfig`, got {type(args).__name__}.")
    # Field by field: `to_dict` would replace every `*_token` value (also `eos_token`, `pad_token`) with a placeholder.
    known = BituneSFTConfig.__dataclass_fields__
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init and f.name in known}
    return BituneSFTConfig(**values)


def _bitune_peft_config(model: Any, peft_config: PeftConfig | None) -> PeftConfig | None:
    """`BituneConfig()` by default; the model's own adapter when it already is a Bitune `PeftModel`."""
    if isinstance(model, PeftModel):
        if not isinstance(model.base_model, BituneModel):
            raise ValueError(
                f"`model` is a PeftModel with a {type(model.peft_config[model.active_adapter]).__name__} adapter; "
                "BituneSFTTrainer trains Bitune adapters. Pass the base model (and optionally a `BituneConfig`), or "
                "use `trl.SFTTrainer` for other PEFT methods."
            )
        return peft_config  # SFTTrainer refuses a second config on a PeftModel with its own message
    if peft_config is None:
        return BituneConfig()
    if not isinstance(peft_config, BituneConfig):
        raise ValueError(
            f"`peft_config` must be a `BituneConfig`, got {type(peft_config).__name__}. To train Bitune with this "
            f"method, wrap it: `BituneConfig(adapter_config={type(peft_config).__name__}(...))`; to train it alone, "
            "use `trl.SFTTrainer`."
        )
    return peft_config


# The `loss_type`s that `compute_loss` implements (TRL's own, which it replaces, is not called).
IMPLEMENTED_LOSS_TYPES = ("nll", "dft")


def check_loss_type(args: TrainingArguments) -> None:
    """Refuse a `loss_type` that `compute_loss` does not implement: one that a later TRL accepts would otherwise be
    trained as plain NLL without a word."""
    if args.loss_type not in IMPLEMENTED_LOSS_TYPES:
        raise ValueError(
            f"`loss_type={args.loss_type!r}` is not implemented by BituneSFTTrainer, which computes the loss from the "
            f"Bitune forward itself and knows {list(IMPLEMENTED_LOSS_TYPES)}. Use one of those; for another loss, "
            "pass a `compute_loss_func` (with `loss_type='nll'`)."
        )


def _check_training_setup(args: BituneSFTConfig, bitune_config: BituneConfig) -> None:
    refuse_packing(args)  # again: `args.packing = True` may have been set after the config was made
    check_loss_type(args)
    if args.ddp_find_unused_parameters is False and not bitune_config.shared_weights:
        raise ValueError(
            "`ddp_find_unused_parameters=False` makes DDP fail at the second step: the bidirectional weights of the "
            "last layer outside its key/value projections never receive a gradient (the bidirectional pass is used "
            "only for the keys/values it writes). Leave `ddp_find_unused_parameters` unset (PEFT models default to "
            "True) or set it to True."
        )
    plugin = args.deepspeed_plugin
    checkpointing = compat.CHECKPOINTING_ARGUMENT
    if plugin is not None and getattr(plugin, "zero_stage", None) == 3 and getattr(args, checkpointing):
        raise ValueError(
            "DeepSpeed ZeRO-3 with gradient checkpointing is not supported: TRL forces reentrant checkpointing for "
            "PEFT models under ZeRO-3, and reentrant checkpointing drops the gradients that flow through Bitune's "
            f"mixed prompt cache. Set `{checkpointing}=False`, or use ZeRO stage 2 or FSDP."
        )
    fsdp_config = args.fsdp_config if isinstance(args.fsdp_config, dict) else {}
    fsdp_checkpointing = str(fsdp_config.get("activation_checkpointing", "false")).lower() == "true" or (
        os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true"
    )
    if fsdp_checkpointing:
        raise ValueError(
            "FSDP's own activation checkpointing (`fsdp_config['activation_checkpointing']` or "
            "`--fsdp_activation_checkpointing`) recomputes the decoder layers during backward under whichever weight "
            "set is active then, which is wrong for Bitune's bidirectional pass. Turn it off and keep "
            f"`{checkpointing}=True`, which Bitune routes correctly."
        )
    path = args.chat_template_path
    if path is not None and not (os.path.isfile(path) and path.endswith((".jinja", ".j2"))):
        raise ValueError(
            f"`chat_template_path={path!r}` clones another tokenizer's chat template, which can add tokens whose "
            "embeddings must then be trained; a Bitune adapter trains only its two weight sets and mixing scalars. "
            "Pass a .jinja template that uses the tokenizer's existing tokens, or set `tokenizer.chat_template`."
        )


def _named_eval_datasets(eval_dataset: Any) -> dict[str, Any]:
    if eval_dataset is None:
        return {}
    if isinstance(eval_dataset, dict):
        return {f"eval_dataset[{key!r}]": dataset for key, dataset in eval_dataset.items()}
    return {"eval_dataset": eval_dataset}


def _check_dataset_format(
    dataset: Dataset | IterableDataset, name: str, args: BituneSFTConfig, skip_prepare: bool, custom_collator: bool
) -> None:
    """Refuse, from the first row, data whose labels will not mark an instruction before the answer."""
    sample = next(iter(dataset))
    if "image" in sample or "images" in sample:
        raise ValueError(
            f"`{name}` holds images. Bitune supports text-only causal language models; vision-language training is "
            "not supported."
        )
    if "input_ids" in sample or skip_prepare:
        has_mask = "labels" in sample or "assistant_masks" in sample or (
            "completion_mask" in sample and args.completion_only_loss is not False
        )
        if not has_mask and not custom_collator:
            raise ValueError(
                f"`{name}` is tokenized but has no `labels` column (nor `completion_mask` / `assistant_masks` for TRL "
                "to build it from), so every token would be supervised and no instruction would be left for Bitune to "
                f"read. Add labels that are -100 on the instruction. Formats that work: {_FORMATS_THAT_WORK}."
            )
        return
    if "prompt" in sample and "completion" in sample:
        if args.completion_only_loss is False:
            raise ValueError(
                "`completion_only_loss=False` supervises the prompt too, so the labels no longer show where the "
                "instruction ends. Leave `completion_only_loss` at None (or True) for prompt-completion data."
            )
        return
    if is_conversational(sample) or is_conversational_from_value(sample):
        if not args.assistant_only_loss:
            raise ValueError(
                f"`{name}` is conversational, and without `assistant_only_loss=True` every token is supervised, so no "
                "instruction is left for Bitune to read. Set `assistant_only_loss=True` (the chat template needs "
                "`{% generation %}` markers, which TRL adds for known templates), or use prompt-completion rows."
            )
        return
    columns = sorted(sample)
    raise ValueError(
        f"`{name}` has columns {columns}: plain-text language modelling data has no instruction/answer boundary, and "
        f"Bitune reads the instruction bidirectionally before training on the answer. Formats that work: "
        f"{_FORMATS_THAT_WORK}."
    )


def _check_prepared_labels(dataset: Any, name: str) -> None:
    """After TRL's preparation: every row must start with an unsupervised instruction and supervise something."""
    if not isinstance(dataset, Dataset) or "labels" not in dataset.column_names:
        return  # an IterableDataset cannot be scanned up front; the Bitune forward checks every batch
    no_instruction, no_answer = [], []
    offset = 0
    for batch in dataset.select_columns(["labels"]).with_format("arrow").iter(batch_size=10_000):
        labels = batch.column("labels").combine_chunks()
        lengths = pc.list_value_length(labels).fill_null(0).to_numpy(zero_copy_only=False)
        values = pc.list_flatten(labels).to_numpy(zero_copy_only=False)
        rows = pc.list_parent_indices(labels).to_numpy(zero_copy_only=False)
        supervised = values != IGNORE_INDEX
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        non_empty = lengths > 0
        first_supervised = np.zeros(len(lengths), dtype=bool)
        first_supervised[non_empty] = supervised[starts[non_empty]]
        counts = np.bincount(rows[supervised], minlength=len(lengths)) if len(values) else np.zeros(len(lengths))
        no_instruction += (np.flatnonzero(first_supervised) + offset).tolist()
        no_answer += (np.flatnonzero(counts == 0) + offset).tolist()
        offset += len(lengths)
    if no_instruction:
        raise ValueError(
            f"Rows {format_rows(no_instruction)} of the prepared `{name}` have no instruction: their first token is "
            "already supervised. Bitune reads an instruction before the answer; make sure each prompt is non-empty "
            "(a BOS token or a template counts) and that truncation keeps the start of each row "
            "(`truncation_mode='keep_start'`)."
        )
    if no_answer:
        raise ValueError(
            f"Rows {format_rows(no_answer)} of the prepared `{name}` have no supervised token (all labels are -100), "
            "so there is no answer to train on. Remove them, or raise `max_length` if truncation cut the answers off."
        )


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
