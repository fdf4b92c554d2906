"""What `BituneSFTTrainer` refuses, and converts, before any work: its arguments, the PEFT config, and the datasets
(from their first row, before TRL prepares them, and from their labels after).

Bitune reads each row's instructions from the labels TRL builds, so data that carries no instruction/answer boundary
(plain text, a formatting function, conversations without `assistant_only_loss`) is refused, as are settings that break
the three-pass forward ("wrapped" packing, reentrant or FSDP's own checkpointing, DeepSpeed ZeRO-3 with checkpointing)
and a `loss_type` the trainer does not implement. Resuming from a checkpoint with recipe options other than those it
was trained with is refused too. Each refusal says what works instead.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import warnings
import zipfile
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch
from datasets import Dataset, IterableDataset
from peft import PeftConfig, PeftModel
from transformers import TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, TRAINING_ARGS_NAME
from trl.data_utils import is_conversational, is_conversational_from_value

from peft_bitune import BituneConfig, BituneModel, compat
from peft_bitune.constants import IGNORE_INDEX, MIXERS_ATTRIBUTE, WEIGHT_SETS, inner_adapter_name
from peft_bitune.utils.messages import format_rows

from .config import BituneSFTConfig, refuse_wrapped_packing

FORMATS_THAT_WORK = (
    "prompt-completion rows (`prompt` and `completion` columns, plain text or conversational) with "
    "`completion_only_loss` left at None or True; conversational rows (`messages`) with `assistant_only_loss=True`; "
    "or pre-tokenized rows with `input_ids` and `labels` that are -100 on the instruction"
)


def as_bitune_config(args: TrainingArguments | None, model: Any) -> BituneSFTConfig:
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


def bitune_peft_config(
    model: Any, peft_config: PeftConfig | None, trainer: str = "BituneSFTTrainer"
) -> PeftConfig | None:
    """`BituneConfig()` by default; the model's own adapter when it already is a Bitune `PeftModel`. `trainer` names
    the Bitune trainer in the refusals (TRL's own trainer is its name without "Bitune")."""
    plain = "trl." + trainer.replace("Bitune", "", 1)
    if isinstance(model, PeftModel):
        if not isinstance(model.base_model, BituneModel):
            raise ValueError(
                f"`model` is a PeftModel with a {type(model.peft_config[model.active_adapter]).__name__} adapter; "
                f"{trainer} trains Bitune adapters. Pass the base model (and optionally a `BituneConfig`), or "
                f"use `{plain}` for other PEFT methods."
            )
        check_adapter_trains(model, trainer)
        return peft_config  # the TRL trainer refuses a second config on a PeftModel with its own message
    if peft_config is None:
        return BituneConfig()
    if not isinstance(peft_config, BituneConfig):
        raise ValueError(
            f"`peft_config` must be a `BituneConfig`, got {type(peft_config).__name__}. To train Bitune with this "
            f"method, wrap it: `BituneConfig(adapter_config={type(peft_config).__name__}(...))`; to train it alone, "
            f"use `{plain}`."
        )
    return peft_config


def check_adapter_trains(model: PeftModel, trainer: str) -> None:
    """Refuse a Bitune `PeftModel` whose active adapter has no trainable weight: it would train to nothing, silently
    (a loaded adapter is frozen unless loaded with `is_trainable=True`)."""
    adapter = model.active_adapter
    own = [f".{inner_adapter_name(adapter, weight_set)}." for weight_set in WEIGHT_SETS]
    own.append(f".{MIXERS_ATTRIBUTE}.{adapter}.")
    # A name ends with the inner adapter's name where the weight is a tensor of a `ParameterDict` (IA3's vectors).
    weights = [parameter for name, parameter in model.named_parameters() if any(part in f"{name}." for part in own)]
    if not any(parameter.requires_grad for parameter in weights):
        raise ValueError(
            f"The Bitune adapter `{adapter}` of `model` has no trainable weights, so {trainer} would train nothing: "
            "an adapter loaded with `PeftModel.from_pretrained` is frozen unless loaded with `is_trainable=True`. "
            "Load it with `PeftModel.from_pretrained(base, path, is_trainable=True)` to train it further."
        )


# The `loss_type`s that TRL's `SFTTrainer.compute_loss` computes. TRL checks the value only when the trainer is made,
# after the model has loaded, and computes any other value set later as "nll" without a word.
IMPLEMENTED_LOSS_TYPES = ("nll", "dft")


def check_loss_type(args: TrainingArguments) -> None:
    """Refuse a `loss_type` that TRL's `compute_loss` does not compute, before the model loads and at every step."""
    if args.loss_type not in IMPLEMENTED_LOSS_TYPES:
        raise ValueError(
            f"`loss_type={args.loss_type!r}` is not implemented by BituneSFTTrainer, whose loss is TRL's "
            f"`SFTTrainer` loss and knows {list(IMPLEMENTED_LOSS_TYPES)}. Use one of those; for another loss, "
            "pass a `compute_loss_func` (with `loss_type='nll'`)."
        )


def check_training_setup(args: BituneSFTConfig, bitune_config: BituneConfig) -> None:
    refuse_wrapped_packing(args)  # again: `args.packing_strategy` may have been set after the config was made
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


def named_eval_datasets(eval_dataset: Any) -> dict[str, Any]:
    if eval_dataset is None:
        return {}
    if isinstance(eval_dataset, dict):
        return {f"eval_dataset[{key!r}]": dataset for key, dataset in eval_dataset.items()}
    return {"eval_dataset": eval_dataset}


def check_dataset_format(
    dataset: Dataset | IterableDataset, name: str, args: BituneSFTConfig, skip_prepare: bool, custom_collator: bool
) -> None:
    """Refuse, from the first row, data whose labels will not mark an instruction before the answer."""
    sample = next(iter(dataset), None)
    if sample is None:
        raise ValueError(f"`{name}` is empty: give it at least one row (check the data files or the split).")
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
                f"read. Add labels that are -100 on the instruction. Formats that work: {FORMATS_THAT_WORK}."
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
        f"{FORMATS_THAT_WORK}."
    )


def check_rows_kept(
    rows_given: dict[str, int], prepared: dict[str, Any], args: TrainingArguments, cause: str | None = None
) -> None:
    """
    TRL drops the rows that truncation to `max_length` leaves without a supervised token (the answer was cut off):
    refuse a dataset that lost every row (training would fail later with "num_samples=0"), and warn about the rows
    lost from one that kept some. `cause` says why the trainer drops rows (SFT's reason by default).
    """
    if cause is None:
        cause = (
            f"truncating to `max_length={args.max_length}` tokens left them no supervised (answer) token, and TRL "
            "drops such rows"
        )
    for name, given in rows_given.items():
        dataset = prepared.get(name)
        if not isinstance(dataset, Dataset):
            continue
        kept = examples_in(dataset)
        if kept >= given:  # more: `"bfd_split"` packing cut examples into pieces
            continue
        if kept == 0:
            raise ValueError(
                f"Every row of `{name}` ({given}) was dropped while TRL prepared it: {cause}. Raise `max_length` "
                "(`--max_length`) above the prompt lengths, or shorten the prompts."
            )
        warnings.warn(
            f"{given - kept} of the {given} rows of `{name}` were dropped while TRL prepared it: {cause}. "
            "Raise `max_length` (`--max_length`) to train on them.",
            stacklevel=3,
        )


def examples_in(dataset: Dataset) -> int:
    """How many examples a prepared dataset holds: one per row, or in a packed one (TRL's `seq_lengths` column) the
    examples packed into its rows, which are fewer rows than examples."""
    if "seq_lengths" not in dataset.column_names:
        return len(dataset)
    batches = dataset.select_columns(["seq_lengths"]).with_format("arrow").iter(batch_size=10_000)
    return sum(int(pc.sum(pc.list_value_length(batch.column("seq_lengths"))).as_py() or 0) for batch in batches)


def check_prepared_labels(dataset: Any, name: str) -> None:
    """After TRL's preparation: every row must start with an unsupervised instruction and supervise something; in a
    packed dataset (TRL's `seq_lengths` column), every packed example must (a `"bfd_split"` piece that begins inside
    an answer has no instruction)."""
    if not isinstance(dataset, Dataset) or "labels" not in dataset.column_names:
        return  # an IterableDataset cannot be scanned up front; the Bitune forward checks every batch
    packed = "seq_lengths" in dataset.column_names
    no_instruction, no_answer = [], []
    offset = 0
    columns = ["labels", "seq_lengths"] if packed else ["labels"]
    for batch in dataset.select_columns(columns).with_format("arrow").iter(batch_size=10_000):
        labels = batch.column("labels").combine_chunks()
        lengths = pc.list_value_length(labels).fill_null(0).to_numpy(zero_copy_only=False)
        supervised = pc.list_flatten(labels).to_numpy(zero_copy_only=False) != IGNORE_INDEX
        names = [str(row + offset) for row in range(len(lengths))]
        if packed:  # one unit per packed example, named "row:example"
            pieces = batch.column("seq_lengths").combine_chunks()
            rows = pc.list_parent_indices(pieces).to_numpy(zero_copy_only=False)
            lengths = pc.list_flatten(pieces).to_numpy(zero_copy_only=False)
            number = np.arange(len(rows)) - np.searchsorted(rows, rows)
            names = [f"{row + offset}:{index}" for row, index in zip(rows, number)]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        non_empty = lengths > 0
        first_supervised = np.zeros(len(lengths), dtype=bool)
        first_supervised[non_empty] = supervised[starts[non_empty]]
        unit = np.repeat(np.arange(len(lengths)), lengths)
        counts = np.bincount(unit[supervised], minlength=len(lengths)) if len(unit) else np.zeros(len(lengths))
        no_instruction += [names[index] for index in np.flatnonzero(first_supervised)]
        no_answer += [names[index] for index in np.flatnonzero(counts == 0)]
        offset += batch.num_rows
    units = "Packed examples (row:example)" if packed else "Rows"
    if no_instruction:
        raise ValueError(
            f"{units} {format_rows(no_instruction)} of the prepared `{name}` have no instruction: their first token "
            "is already supervised. Bitune reads an instruction before the answer; make sure each prompt is non-empty "
            "(a BOS token or a template counts) and that truncation keeps the start of each row "
            "(`truncation_mode='keep_start'`)" + ("; with `packing_strategy=\"bfd_split\"`, a piece of an example "
            "longer than `max_length` that begins inside the answer has none: raise `max_length`, or use \"bfd\", "
            "which truncates instead." if packed else ".")
        )
    if no_answer:
        raise ValueError(
            f"{units} {format_rows(no_answer)} of the prepared `{name}` have no supervised token (all labels are "
            "-100), so there is no answer to train on. Remove them, or raise `max_length` if truncation cut the "
            "answers off."
        )


# ---------------------------------------------------------------------- resuming keeps the recipe
# The training options beyond the paper, at their defaults (the paper's recipe). A checkpoint holds their values in
# the arguments the Trainer saves with it (`training_args.bin`), next to the optimizer and scheduler they shape.
RECIPE_DEFAULTS = {"bidirectional_lr_ratio": 1.0, "mixing_lr_ratio": 1.0, "mixing_warmup_steps": 0}


class _Fields:
    """Whatever object the saved arguments hold, as its plain fields: no class of the file is looked up, so reading
    it runs no code of the checkpoint's (the Trainer pickles its arguments whole)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class _FieldsUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        return _Fields

    def persistent_load(self, pid: Any) -> None:  # a tensor: none of the recipe options is one
        return None


def saved_recipe(checkpoint: str) -> dict[str, Any] | None:
    """The recipe options among the arguments the Trainer saved in `checkpoint`; `None` if it saved none (another
    trainer's arguments, or no file)."""
    try:
        with zipfile.ZipFile(os.path.join(checkpoint, TRAINING_ARGS_NAME)) as archive:
            pickled = next(name for name in archive.namelist() if name.endswith("/data.pkl"))
            fields = vars(_FieldsUnpickler(io.BytesIO(archive.read(pickled))).load())
    except (OSError, zipfile.BadZipFile, StopIteration, pickle.UnpicklingError, TypeError, EOFError):
        return None
    if not all(name in fields for name in RECIPE_DEFAULTS):
        return None
    return {name: fields[name] for name in RECIPE_DEFAULTS}


def check_resumed_recipe(checkpoint: str | None, args: BituneSFTConfig, optimizer_given: bool = False) -> None:
    """
    Refuse to resume from `checkpoint` with recipe options other than those it was trained with. The Trainer restores
    the saved optimizer and scheduler, which keep the checkpoint's learning rate of each part (a new ratio would be
    ignored, or a switched one fail in torch on the number of parameter groups), and the warm-up is a schedule over
    the whole run: a resumed run continues the one it was saved from, as it was. A checkpoint whose saved arguments
    lack the options (another trainer's) shows its learning-rate multiples in its optimizer's parameter groups (its
    warm-up, nowhere), unless that optimizer was the user's own (`optimizer_given`), whose rates the options do not
    set.
    """
    if checkpoint is None:
        return
    recorded = _recorded_recipe(checkpoint, read_optimizer=not optimizer_given)
    if recorded is None:
        return
    current = {name: getattr(args, name) for name in recorded}
    changed = [
        f"`{name}={current[name]!r}` is set, but it was trained with `{name}={recorded[name]!r}`"
        for name in recorded if current[name] != recorded[name]
    ]
    if changed:
        raise ValueError(
            f"Cannot resume from '{checkpoint}' with another recipe: {'; '.join(changed)}. A resumed run continues "
            "the one it was saved from (its saved optimizer and scheduler keep its learning rates), so resume with "
            "the checkpoint's values; to train on with the new ones, start a new run from its adapter "
            "(`PeftModel.from_pretrained(base, checkpoint, is_trainable=True)`) without `resume_from_checkpoint`."
        )


def _recorded_recipe(checkpoint: str, read_optimizer: bool) -> dict[str, Any] | None:
    """The recipe options a checkpoint's saved arguments hold, or what its optimizer shows of them; `None` if
    neither is there."""
    recorded = saved_recipe(checkpoint)
    if recorded is not None:
        return recorded
    path = os.path.join(checkpoint, OPTIMIZER_NAME)
    if not read_optimizer or not os.path.isfile(path):
        return None
    rates = {}  # the base rate of each part with its own group (`bitune_<part>`, `bitune_<part>_no_decay`)
    for group in torch.load(path, map_location="cpu", weights_only=True).get("param_groups", []):
        name = str(group.get("name", ""))
        if name.startswith("bitune_"):
            rates[name.removeprefix("bitune_").removesuffix("_no_decay")] = group.get("initial_lr", group["lr"])
    if not rates:
        return {"bidirectional_lr_ratio": 1.0, "mixing_lr_ratio": 1.0}  # the Trainer's own groups: both at 1
    base = rates.get("causal")
    if not base:
        return None
    return {f"{part}_lr_ratio": float(f"{rates.get(part, base) / base:.6g}") for part in ("bidirectional", "mixing")}
