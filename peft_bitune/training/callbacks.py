"""`BituneMixingCallback`: the mixing coefficients of a Bitune adapter in the training logs of any
`transformers.Trainer`.

The mixing scalars move a lot early in training (layer-0 keys fell from 0.5 to 0.02 in 9 steps in one run), so they are
worth watching. A callback rather than a trainer override, so that a plain `Trainer` gets them too;
`BituneSFTTrainer` adds one by default. `peft_bitune.visualize.plot_mixing_history` draws them from
`trainer.state.log_history`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from ..tuner.find_tuner import require_bitune_tuner
from ..tuner.model import BituneModel

LOG_PREFIX = "bitune/"


def mean_log_key(kind: str) -> str:
    """Log key of the mean alpha of `kind` ("keys" or "values") over layers."""
    return f"{LOG_PREFIX}alpha_{kind}_mean"


def layer_log_key(kind: str, layer: int) -> str:
    """Log key of the alpha of `kind` ("keys" or "values") of one layer."""
    return f"{LOG_PREFIX}alpha_{kind}/layer_{layer}"


class BituneMixingCallback(TrainerCallback):
    """
    Add the mixing coefficients (alpha, the weight of the bidirectional cache) of the trained Bitune adapter to every
    training log: the mean over layers of keys and of values at every log (`bitune/alpha_keys_mean`,
    `bitune/alpha_values_mean`), and every layer's alpha (`bitune/alpha_keys/layer_<i>`,
    `bitune/alpha_values/layer_<i>`) at the first log and then at the first log after at least `per_layer_steps`
    optimizer steps since the last per-layer log.

    The values go into the log dict that later callbacks report (progress bar, W&B, TensorBoard...) and into
    `trainer.state.log_history`. Reporting callbacks that run *before* this one do not see them: `BituneSFTTrainer`
    puts it first; with a plain `Trainer`, do the same with `trainer.callback_handler.callbacks.insert(0, callback)` if
    you report to such a service (`Trainer(callbacks=[...])` appends it after the `report_to` integrations).

    Under sharded training the scalars are gathered first: FSDP2 and DeepSpeed ZeRO-3 are recognised from the
    parameters; FSDP1 shards them inside a wrapper the callback is not given, so pass `gather` (`BituneSFTTrainer`
    does).

    Args:
        per_layer_steps (`int`, *optional*, defaults to 100): the interval of the per-layer values; `None` or 0 logs
            the means only.
        gather (`Callable[[BituneModel], ContextManager]`, *optional*): a context manager factory under which the whole
            mixing scalars can be read on every process; by default, the one that recognises DeepSpeed ZeRO-3.

    Example:

    ```python
    >>> from transformers import Trainer
    >>> from peft_bitune import BituneMixingCallback
    >>> trainer = Trainer(model=peft_model, args=args, train_dataset=dataset, callbacks=[BituneMixingCallback()])
    ... # doctest: +SKIP
    ```
    """

    def __init__(
        self,
        per_layer_steps: int | None = 100,
        gather: Callable[[BituneModel], contextlib.AbstractContextManager] | None = None,
    ) -> None:
        if per_layer_steps is not None and (not isinstance(per_layer_steps, int) or per_layer_steps < 0):
            raise ValueError(f"`per_layer_steps` must be a non-negative integer or None, got {per_layer_steps!r}.")
        self.per_layer_steps = per_layer_steps
        self.gather = gather or gathered_mixing_scalars
        self._last_per_layer_step: int | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._last_per_layer_step = None

    def on_log(
        self,
        args: Any,
        state: Any,
        control: Any,
        logs: dict[str, float] | None = None,
        model: Any = None,
        **kwargs: Any,
    ) -> None:
        # Only training logs: not the eval logs, not the end-of-training summary (which has `train_loss`).
        if logs is None or "loss" not in logs or model is None or not model.training:
            return
        values = self._mixing_logs(model, state.global_step)
        logs.update(values)
        # `Trainer.log` appends a copy of the logs to the history before calling the callbacks.
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step and last.get("loss") == logs["loss"]:
            last.update(values)

    def _mixing_logs(self, model: nn.Module, step: int) -> dict[str, float]:
        bitune = require_bitune_tuner(
            model,
            "for `BituneMixingCallback`, which logs the mixing coefficients of a Bitune adapter",
            "Train a model made with `get_peft_model(model, BituneConfig())`, or remove the callback.",
        )
        with self.gather(bitune):
            coefficients = {
                kind: _full_tensor(alpha).float().cpu() for kind, alpha in bitune.get_mixing_coefficients().items()
            }
        logs = {mean_log_key(kind): alpha.mean().item() for kind, alpha in coefficients.items()}
        last = self._last_per_layer_step
        if self.per_layer_steps and (last is None or step - last >= self.per_layer_steps):
            for kind, alpha in coefficients.items():
                logs.update({layer_log_key(kind, layer): value for layer, value in enumerate(alpha.tolist())})
            self._last_per_layer_step = step
        return logs


def check_warmup_fits(warmup_steps: int, total_steps: int) -> None:
    """A mixing warm-up must end within training (`total_steps`, if known: > 0), else the adapter is saved with its mix
    still held back. Checked when the config is made and again when training starts (a run given in epochs)."""
    if total_steps > 0 and warmup_steps > total_steps:
        raise ValueError(
            f"`mixing_warmup_steps`: the mixing warm-up ({warmup_steps} steps) is longer than training ({total_steps} "
            "steps), so the mixing would never be fully released. Choose at most the number of training steps, e.g. a "
            "tenth to a fifth of it."
        )


def check_warmup_steps(warmup_steps: Any, total_steps: int) -> None:
    """Refuse a `mixing_warmup_steps` that is not a non-negative integer (0: no warm-up) or does not fit training."""
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(
            f"`mixing_warmup_steps` must be a non-negative integer (0: no warm-up), got {warmup_steps!r}."
        )
    check_warmup_fits(warmup_steps, total_steps)


class BituneMixingWarmupCallback(TrainerCallback):
    """
    A mixing warm-up (`BituneSFTConfig.mixing_warmup_steps`): at the start of optimizer step `t` the learned alphas
    are scaled by `min(1, t / warmup_steps)`, so training starts from the causal cache (as plain LoRA reads the
    prompt) and the bidirectional read comes in linearly. Both weight sets and the mixing scalars train throughout
    (under Adam a scaled gradient gives the same step size). At the end of training the full mix is restored; an
    adapter saved before the warm-up ends is loaded with its full mix.

    Args:
        warmup_steps (`int`, *optional*): the length of the warm-up in optimizer steps; at most the number of training
            steps. `None` reads `args.mixing_warmup_steps` (a `BituneSFTConfig`) when each training run starts, so
            that a value set after the trainer was made is the one used, and checked (0: no warm-up);
            `BituneSFTTrainer` adds its warm-up this way.
    """

    def __init__(self, warmup_steps: int | None = None) -> None:
        if warmup_steps is not None and (
            isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1
        ):
            raise ValueError(f"`warmup_steps` must be a positive integer, got {warmup_steps!r}.")
        self.warmup_steps = warmup_steps
        self._steps_in_force = warmup_steps or 0

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        steps = self.warmup_steps if self.warmup_steps is not None else getattr(args, "mixing_warmup_steps", None)
        if steps is None:
            raise ValueError(
                "`BituneMixingWarmupCallback()` reads the warm-up from `args.mixing_warmup_steps`, which these "
                f"{type(args).__name__} do not have: pass `warmup_steps`, or train with a `BituneSFTConfig`."
            )
        check_warmup_steps(steps, state.max_steps)
        self._steps_in_force = steps
        self._release(model, state.global_step)

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._release(model, state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._mixer(model).set_release(1.0)

    def _release(self, model: nn.Module, step: int) -> None:
        steps = self._steps_in_force
        self._mixer(model).set_release(min(1.0, step / steps) if steps else 1.0)

    @staticmethod
    def _mixer(model: nn.Module) -> nn.Module:
        bitune = require_bitune_tuner(
            model,
            "for `BituneMixingWarmupCallback`, which releases the mixing of a Bitune adapter",
            "Train a model made with `get_peft_model(model, BituneConfig())`, or remove the callback.",
        )
        return bitune.mixer


def gathered_mixing_scalars(bitune: BituneModel) -> contextlib.AbstractContextManager:
    """
    Outside the forward, sharded training keeps only a shard of each parameter on a process. FSDP2 exposes the scalars
    as DTensors (gathered when read); DeepSpeed ZeRO-3 must gather them. Every process logs, so every process takes
    part.
    """
    parameters = list(bitune.mixer.parameters())
    if any(hasattr(parameter, "ds_id") for parameter in parameters):  # partitioned by DeepSpeed ZeRO-3
        import deepspeed

        return deepspeed.zero.GatheredParameters(parameters, modifier_rank=None)
    return contextlib.nullcontext()


def _full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on this process, also when FSDP2 holds it as a sharded DTensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
