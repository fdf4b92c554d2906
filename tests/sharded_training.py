"""A few optimizer steps of the Bitune loss on a tiny Llama, sharded with FSDP across processes or in one process.

Run under `torchrun --nproc_per_node 2 tests/sharded_training.py OUTPUT_DIR CASES_JSON` (CPU, gloo): for each case,
every process trains on its half of each batch, the full state dict is gathered, and the main process saves the
trainable weights (or the error) and FSDP2's warnings about returned views to OUTPUT_DIR/<case>.pt, and with
`"save": true` the adapter to OUTPUT_DIR/<case>/.
`reference_training` runs the same steps in one process (the loss of a step is the mean of the per-process losses, as
data parallelism averages gradients). Nothing is downloaded.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import peft_bitune
from peft_bitune import compat

PROCESSES = 2
STEPS = 3
ROWS_PER_PROCESS = 2
NUM_LAYERS = 2
LEARNING_RATE = 0.5  # plain SGD: a gradient error shows as the same error in the weights


def build_base(multi_head: bool = False) -> LlamaForCausalLM:
    """The same tiny random Llama in every process; `multi_head`: as many key/value heads as query heads, so that a
    checkpointed step recomputes the prompt's keys/values from its layer inputs (`tuner/layer_inputs.py`)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
        num_key_value_heads=4 if multi_head else 2, max_position_embeddings=64, pad_token_id=0,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def build_model(gradient_checkpointing: bool = False, multi_head: bool = False, mixed_layers: list[int] | None = None):
    """The same tiny Bitune model (LoRA r=4 on every linear layer, both weight sets; the mixer mixes `mixed_layers`,
    every layer by default) in every process."""
    model = get_peft_model(
        build_base(multi_head),
        peft_bitune.BituneConfig(adapter_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
                                 mixed_layers=mixed_layers),
    )
    if gradient_checkpointing:
        compat.enable_checkpointing(model, use_reentrant=False)
    return model.train()


def batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`STEPS` global batches of right-padded rows (input_ids, attention_mask, labels) with instructions and answers
    of different lengths; process `rank` trains on rows `rank * ROWS_PER_PROCESS` onwards."""
    generator = torch.Generator().manual_seed(1)
    rows, width = PROCESSES * ROWS_PER_PROCESS, 12
    result = []
    for _ in range(STEPS):
        ids = torch.randint(3, 64, (rows, width), generator=generator)
        mask = torch.ones(rows, width, dtype=torch.long)
        labels = ids.clone()
        for row in range(rows):
            prompt = int(torch.randint(3, 7, (1,), generator=generator))
            length = prompt + int(torch.randint(2, width - prompt + 1, (1,), generator=generator))
            labels[row, :prompt] = -100
            mask[row, length:] = 0
            ids[row, length:] = 0
            labels[row, length:] = -100
        result.append((ids, mask, labels))
    return result


def trainable_names(model) -> list[str]:
    return [name for name, parameter in model.named_parameters() if parameter.requires_grad]


def loss_after_in_place_op(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The Bitune loss recomputed from the returned logits after an in-place op on them, as a callback or a user's own
    loss may do; dividing by a temperature of 1 leaves the values, and so the gradients, as they were."""
    logits.div_(1.0)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def packed(input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Right-padded rows as one padding-free row, as TRL's collator makes it: positions restart at 0 per row."""
    real = attention_mask.bool()
    positions = (attention_mask.cumsum(dim=1) - 1)[real]
    return dict(input_ids=input_ids[real][None], labels=labels[real][None], position_ids=positions[None])


def train(model, rows: slice, in_place_on_logits: bool = False, fused_head: bool = False,
          packed_rows: bool = False) -> None:
    """SGD steps on the rows `rows` of every batch (packed into one padding-free row if `packed_rows`); the loss is
    the model's own (through TRL's fused LM head if `fused_head`), or recomputed from its logits after an in-place op
    on them."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    for ids, mask, labels in batches():
        head = {"fused_lm_head": True} if fused_head else {}
        batch = dict(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows])
        output = model(**(packed(**batch) if packed_rows else batch), **head)
        loss = loss_after_in_place_op(output.logits, labels[rows]) if in_place_on_logits else output.loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def reference_training(
    multi_head: bool = False, mixed_layers: list[int] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The same steps in one process (not checkpointed); returns the trainable weights before and after."""
    model = build_model(multi_head=multi_head, mixed_layers=mixed_layers)
    before = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    for ids, mask, labels in batches():
        for rank in range(PROCESSES):
            rows = slice(rank * ROWS_PER_PROCESS, (rank + 1) * ROWS_PER_PROCESS)
            loss = model(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows]).loss
            (loss / PROCESSES).backward()
        optimizer.step()
        optimizer.zero_grad()
    after = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    return before, after


def shard_fsdp2(model):
    """As accelerate's FSDP2 does: `fully_shard` on every decoder layer, then on the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def shard_fsdp2_root_resharded(model):
    """`fully_shard` on every decoder layer, then on the root with `reshard_after_forward=True`: the root's own
    parameters (embeddings, final norm, LM head, mixing scalars) are freed after the forward, and gathered again for
    backward only by FSDP's hooks on the root's outputs."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    return fully_shard(model, reshard_after_forward=True)


def shard_fsdp2_as_accelerate(model):
    """accelerate's own FSDP2 preparation (`fsdp_version: 2`, TRANSFORMER_BASED_WRAP): the embeddings, every decoder
    layer, the final norm with the LM head, then the root. accelerate only runs it on accelerators, so it is called
    directly here with the settings its launcher would give."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        reshard_after_forward=True, state_dict_type="FULL_STATE_DICT", cpu_ram_efficient_loading=False,
    )
    accelerator = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin), is_main_process=dist.get_rank() == 0, device=torch.device("cpu"),
        mixed_precision="no", parallelism_config=None,
    )
    return fsdp2_prepare_model(accelerator, model)


def shard_fsdp2_layers_only(model):
    """`fully_shard` on the decoder layers but not on the root, which leaves the mixing scalars out of the sharding."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    return model


def shard_fsdp1(model):
    """The FSDP1 wrapper, one unit per decoder layer (accelerate's TRANSFORMER_BASED_WRAP), on CPU."""
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    return FullyShardedDataParallel(
        model, auto_wrap_policy=policy, use_orig_params=True, device_id=torch.device("cpu")
    )


SHARDINGS = {
    "fsdp2": shard_fsdp2,
    "fsdp2_root_resharded": shard_fsdp2_root_resharded,
    "fsdp2_accelerate": shard_fsdp2_as_accelerate,
    "fsdp2_layers_only": shard_fsdp2_layers_only,
    "fsdp1": shard_fsdp1,
}


def gather_weights(model, sharding: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The full (unsharded) values of the parameters `names`, on every process."""
    if sharding == "fsdp1":
        # FSDP1's full state dict crashes on CPU (segmentation fault in its state-dict hooks, torch 2.13).
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            full = {
                name.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for name, p in model.named_parameters()
            }
        return {name: full[name] for name in names}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {name: state[name] for name in names}


def save_adapter(model, directory: Path) -> None:
    """Save the adapter as `Trainer.save_model` does under FSDP2 with FULL_STATE_DICT: every process gathers the full
    state dict, the main process writes it with `save_pretrained(state_dict=...)`."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0:
        model.save_pretrained(str(directory), state_dict=state)
    dist.barrier()


def fsdp2_units(model) -> list[str]:
    """The names of the modules `fully_shard` made into FSDP2 units."""
    from torch.distributed.fsdp import FSDPModule

    return [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]


def run_case(case: dict, output_dir: Path) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    model = build_model(case.get("gradient_checkpointing", False), case.get("multi_head", False),
                        case.get("mixed_layers"))
    names = trainable_names(model)
    sharded = SHARDINGS[case["sharding"]](model)
    # Whether a prompt pass may end at the last layer's keys/values, as seen under this sharding.
    outcome: dict = {
        "stops_early": model.base_model._router.prompt_passes_may_stop_early(),
        "fsdp2_units": fsdp2_units(model),
    }
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(sharded, slice(rank * ROWS_PER_PROCESS, (rank + 1) * ROWS_PER_PROCESS),
                  case.get("in_place_on_logits", False), case.get("fused_head", False), case.get("packed", False))
        # FSDP2 warns when a unit returns a view: an in-place op on it would drop FSDP's backward hook.
        outcome["view_warnings"] = [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]
        outcome["weights"] = gather_weights(sharded, case["sharding"], names)
        if case.get("save"):
            save_adapter(model, output_dir / case["name"])
    except Exception as error:  # reported to the test, which checks the message
        outcome["error"] = f"{type(error).__name__}: {error}"
    if rank == 0:
        torch.save(outcome, output_dir / f"{case['name']}.pt")


if __name__ == "__main__":
    import torch.distributed as dist

    torch.set_num_threads(1)
    output_dir, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    try:
        for case in cases:
            run_case(case, output_dir)
    finally:
        dist.destroy_process_group()
