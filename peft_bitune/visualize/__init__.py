"""
Pictures of what a Bitune adapter learned (paper, appendix A.12): the attention of the two prompt passes, the
per-layer mixing coefficients of their caches, and how those coefficients moved during training.

- `attention_capture.py`: the attention of the two prompt passes, captured as they run (`attention_maps`).
- `mixing_records.py`: the mixing coefficients of a model, a saved adapter or a training log (`mixing_coefficients`,
  `mixing_history`).
- `plots.py`: the drawings, which need matplotlib (`pip install peft-bitune[viz]`); the other two need only torch.

`import peft_bitune` never imports this package; the method (`peft_bitune.tuner`) never imports it either.
"""

from .attention_capture import AttentionMaps, attention_maps
from .mixing_records import MixingHistory, mixing_coefficients, mixing_history
from .plots import plot_attention_maps, plot_mixing_coefficients, plot_mixing_history, plot_prompt_attention

__all__ = [
    "AttentionMaps",
    "MixingHistory",
    "attention_maps",
    "mixing_coefficients",
    "mixing_history",
    "plot_attention_maps",
    "plot_mixing_coefficients",
    "plot_mixing_history",
    "plot_prompt_attention",
]
