"""
What Bitune needs of a quantized base model (QLoRA): which inner PEFT methods it accepts over quantized layers, and
how bitsandbytes' 4-bit layers must run for training to be right on a CPU.

Bitune itself is indifferent to how the frozen base weights are stored: its passes route PEFT's layers to a weight set
and mix key/value caches, which are float tensors whatever the weights are. What can go wrong is below it, in PEFT:
many PEFT methods wrap a quantized layer as if it held a float weight matrix, and then either fail at the first forward
with a shape error (LoHa, LoKr, HRA over a 4-bit layer read its packed weight as the matrix) or compute with the raw
integers and no scale (HRA over an 8-bit layer, silently). So over a quantized base only the inner methods whose
quantized layers are checked in tests/test_quantized.py are accepted, and any other is refused before a weight is
created, naming the quantization and the method.
"""

from __future__ import annotations

import torch
from peft import PeftConfig
from torch import nn

from .. import compat
from ..constants import peft_type_name

# The inner PEFT methods whose layers over quantized base layers are checked in tests/test_quantized.py, against the
# per-row reference on the same quantized base and against float layers holding the de-quantized weights. (DoRA is
# LoRA with `use_dora=True`.)
QUANTIZED_BASE_METHODS = ("LORA", "IA3")

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def quantization_name(model: nn.Module) -> str | None:
    """
    How the model's weights are quantized, in words ("bitsandbytes 4-bit (nf4)", "bitsandbytes 8-bit", "gptq", ...),
    or `None` when every parameter is stored in a float dtype. A model that transformers de-quantized while loading it
    (from a GGUF file) has float weights, and is not quantized in this sense.
    """
    stored = next((p.dtype for p in model.parameters() if p.dtype not in _FLOAT_DTYPES), None)
    if stored is None:
        return None
    quantizer = getattr(model, "hf_quantizer", None)
    config = getattr(quantizer, "quantization_config", None)
    if config is None:
        return f"an unnamed quantization (weights stored as {stored})"
    method = str(getattr(config.quant_method, "value", config.quant_method))
    if getattr(config, "load_in_4bit", False):
        return f"{method} 4-bit ({config.bnb_4bit_quant_type})"
    if getattr(config, "load_in_8bit", False):
        return f"{method} 8-bit"
    return method


def check_quantized_base(model: nn.Module, adapter_config: PeftConfig) -> None:
    """Refuse, before any weight is created, an inner PEFT method whose layers over this model's quantized layers are
    not checked here, and 4-bit layers that bitsandbytes has already repacked for CPU inference (see
    `prepare_quantized_layers`)."""
    repacked = [layer for layer in compat.bitsandbytes_4bit_layers(model.modules())
                if compat.is_repacked_for_cpu_inference(layer)]
    if repacked:
        raise ValueError(
            f"{len(repacked)} of the base model's 4-bit layers were repacked by bitsandbytes for its bf16 CPU kernel, "
            "which it does the first time a 4-bit layer runs on a CPU in eval mode without gradients (e.g. "
            "`generate` on the base model). A repacked layer passes no gradient to its input and breaks DoRA, and "
            "bitsandbytes cannot restore the usual layout exactly. Load the base model again and wrap it "
            "(`get_peft_model`, `PeftModel.from_pretrained`) before running it; Bitune then keeps its 4-bit layers "
            "out of that layout."
        )
    quantization = quantization_name(model)
    method = peft_type_name(adapter_config.peft_type)
    if quantization is None or method in QUANTIZED_BASE_METHODS:
        return
    accepted = " or ".join(QUANTIZED_BASE_METHODS)
    raise ValueError(
        f"The base model is quantized with {quantization}, and Bitune over a quantized base accepts only {accepted} "
        f"as `adapter_config`, not {method}: several PEFT methods wrap a quantized layer as if it held a float weight "
        "matrix, and then fail at the first forward or silently compute with the packed integers. Use LoRA "
        "(`LoraConfig`, also with `use_dora=True`) or IA3, whose quantized layers are checked against float layers "
        f"with the same weights; or train {method} on a base loaded without quantization."
    )


def prepare_quantized_layers(model: nn.Module) -> None:
    """
    Keep bitsandbytes' 4-bit layers in the layout that training and PEFT need, also on a CPU.

    On a CPU with AVX512-BF16, bitsandbytes (0.50 here) repacks a 4-bit layer's weight for a bf16 inference kernel the
    first time the layer runs in eval mode without gradients (in `generate`, or a Trainer's evaluation). From then on
    the layer passes no gradient to its input, so the adapters of every earlier layer would silently train on wrong
    gradients; PEFT's DoRA, which de-quantizes the weight itself, reads the repacked layout as garbage; and the layer
    computes in bf16 whatever `bnb_4bit_compute_dtype` says. So the repacking is turned off for every 4-bit layer of a
    Bitune model: inference on a CPU runs the de-quantizing path that training runs (slower than the bf16 kernel).
    GPUs are not affected.
    """
    for layer in compat.bitsandbytes_4bit_layers(model.modules()):
        compat.keep_out_of_cpu_inference_layout(layer)
