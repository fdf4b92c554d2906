"""Whether the quantized-base tests can run here: bitsandbytes' 4-bit layers on this CPU."""

from __future__ import annotations

import os

import pytest
import torch


def why_bitsandbytes_cannot_run() -> str | None:
    """Why bitsandbytes' 4-bit layers cannot run on this machine's CPU (not installed, or failing), or None if they
    can: the quantized-base tests skip with this reason, and only then. CI installs bitsandbytes and sets
    BITUNE_REQUIRE_BITSANDBYTES, so that a missing install fails there instead."""
    try:
        import bitsandbytes
    except ImportError as error:
        if os.environ.get("BITUNE_REQUIRE_BITSANDBYTES"):
            pytest.fail(f"BITUNE_REQUIRE_BITSANDBYTES is set but bitsandbytes is not installed ({error}): "
                        "pip install -e '.[qlora]'")
        return f"bitsandbytes is not installed ({error}); `pip install -e '.[dev]'` (or '.[qlora]') installs it"
    try:
        layer = bitsandbytes.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32)
        layer.weight = bitsandbytes.nn.Params4bit(torch.randn(64, 64), requires_grad=False, quant_type="nf4")
        layer.to("cpu")(torch.randn(2, 64))
    except Exception as error:  # any failure means the same here: no 4-bit layers on this CPU
        return f"bitsandbytes {bitsandbytes.__version__} cannot run a 4-bit layer on this CPU: {error!r}"
    return None
