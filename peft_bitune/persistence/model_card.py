"""The model card (README.md) of a saved Bitune adapter: what it is, and the lines that load it.

PEFT writes a generic card before the weights; this adds what a reader of a Bitune adapter needs: the `bitune` tag, and
a short section saying that the adapter only loads after `import peft_bitune` (PEFT has no plugin discovery, so without
it loading fails with `KeyError: 'BITUNE'`). The section sits between markers, so saving again replaces it and keeps
whatever else the card says.
"""

from __future__ import annotations

import os
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from ..constants import peft_type_name

CARD_NAME = "README.md"
TAGS = ("bitune", "peft")
PAPER_URL = "https://arxiv.org/abs/2405.14862"
_START = "<!-- bitune:start -->"
_END = "<!-- bitune:end -->"


def write_model_card(
    directory: str | os.PathLike, config: Any, location: str, subfolder: str | None = None
) -> str:
    """
    Create or update `directory/README.md` for the Bitune adapter described by `config`.

    Args:
        directory (`str` or `os.PathLike`): the folder the adapter is saved in.
        config (`BituneConfig`): the adapter's configuration.
        location (`str`): what a reader passes to `from_pretrained`: the Hub repo id or the local path.
        subfolder (`str`, *optional*): the adapter's folder inside `location` (adapters other than "default").

    Returns:
        The path of the card.
    """
    path = os.path.join(directory, CARD_NAME)
    card = ModelCard.load(path) if os.path.exists(path) else ModelCard.from_template(ModelCardData())
    card.data.library_name = "peft"
    card.data.pipeline_tag = card.data.pipeline_tag or "text-generation"
    # PEFT records the base model as loaded, which may be a local folder; the Hub only accepts repo ids there.
    base_model = _hub_id(config.base_model_name_or_path)
    tags = [tag for tag in card.data.tags or [] if not tag.startswith("base_model:adapter:")]
    extra = [*TAGS, f"base_model:adapter:{base_model}"] if base_model else list(TAGS)
    card.data.tags = tags + [tag for tag in extra if tag not in tags]
    card.data.base_model = base_model
    card.text = _with_section(card.text, bitune_section(config, location, subfolder))
    card.save(path)
    return path


def bitune_section(config: Any, location: str, subfolder: str | None = None) -> str:
    """The card's Bitune section: what the adapter is and how to load it."""
    method = _method_name(config.adapter_config)
    weight_sets = (
        f"one {method} weight set shared by both prompt passes (ablation `shared_weights=True`)"
        if config.shared_weights
        else f"two {method} weight sets, one for the causal and one for the bidirectional prompt pass"
    )
    base = f" for `{config.base_model_name_or_path}`" if config.base_model_name_or_path else ""
    if getattr(config, "mixed_layers", None) is not None:
        weight_sets += f" (the caches of layers {config.mixed_layers} only are mixed; the others stay causal)"
    if subfolder is None:
        # AutoPeftModel loads the base model recorded in the adapter config.
        load = f'model = peft.AutoPeftModelForCausalLM.from_pretrained("{location}")'
        other = f'Or, on a base model you already loaded: `peft.PeftModel.from_pretrained(base_model, "{location}")`.'
    else:
        # AutoPeftModel would pass `subfolder` on to the base model too, so this one is loaded onto a base model.
        load = f'model = peft.PeftModel.from_pretrained(base_model, "{location}", subfolder="{subfolder}")'
        other = f"`base_model` is `{config.base_model_name_or_path}`, loaded with `AutoModelForCausalLM`."
    return f"""{_START}
## Bitune adapter

A [Bitune]({PAPER_URL}) (bidirectional instruction tuning) adapter{base}, saved with `peft-bitune`. It holds
{weight_sets}, and learned per-layer scalars that mix the key/value caches of the two passes. It needs the
`peft_bitune` plugin (`pip install peft-bitune`), which registers the `BITUNE` adapter type with PEFT:

```python
import peft, peft_bitune  # peft_bitune registers the BITUNE adapter type
{load}
```

{other} Generation works as usual (`model.generate`, left-padded prompts). A Bitune adapter cannot be merged into
the base model.
{_END}"""


def _hub_id(base_model: str | None) -> str | None:
    """The base model's Hub repo id, or `None` if it is unknown or a local folder."""
    if not base_model or os.path.isdir(base_model):
        return None
    return base_model


def _method_name(adapter_config: Any) -> str:
    peft_type = peft_type_name(adapter_config.peft_type)
    if peft_type == "LORA" and getattr(adapter_config, "use_dora", False):
        return "DoRA"
    return {"LORA": "LoRA", "IA3": "IA3"}.get(peft_type, peft_type)


def _with_section(text: str, section: str) -> str:
    """`text` with the Bitune section replaced, or inserted after the title (or at the top)."""
    if _START in text and _END in text:
        before, rest = text.split(_START, 1)
        after = rest.split(_END, 1)[1]
        return before + section + after
    lines = text.splitlines()
    title = next((i for i, line in enumerate(lines) if line.startswith("# ")), None)
    if title is None:
        return f"{section}\n\n{text}"
    return "\n".join([*lines[: title + 1], "", section, *lines[title + 1 :]])
