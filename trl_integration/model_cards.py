"""The model card every Bitune trainer writes: rendered from the project's own template with TRL's card data, so that
it names the base model (also a local folder), shows the lines that load a Bitune adapter, and does not depend on the
wording of TRL's card."""

from __future__ import annotations

import contextlib
import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from huggingface_hub import ModelCard

from peft_bitune.persistence.model_card import CARD_NAME, bitune_section, write_model_card
from peft_bitune.tuner.find_tuner import find_bitune_tuner

# The Bitune section (what the adapter is, and the lines that load it) is the one `save_pretrained`'s card has.
CARD_TEMPLATE = """---
{{ card_data }}
---

# Model Card for {{ model_name }}

This model is a fine-tuned version of {% if base_model and not base_model_is_local -%}
[{{ base_model }}](https://huggingface.co/{{ base_model }})
{%- elif base_model %}`{{ base_model }}`{% else %}an unrecorded base model{% endif %}
{%- if dataset_name %} on the [{{ dataset_name }}](https://huggingface.co/datasets/{{ dataset_name }}) dataset
{%- endif %}. It has been trained using [TRL](https://github.com/huggingface/trl).

{{ bitune_section }}

## Training procedure

This model was trained with {{ trainer_name }}
{%- if paper.id %}, a method introduced in [{{ paper.title }}](https://huggingface.co/papers/{{ paper.id }})
{%- endif %}.
{%- for name, url in run_links.items() if url %}
- Logs: [{{ name }}]({{ url }})
{%- endfor %}
{% if recipe %}
### Bitune training recipe

Trained with options beyond the paper's recipe: `{{ recipe | join("`, `") }}`.
{% endif %}
### Framework versions
{% for name, installed in versions.items() %}
- {{ name }}: {{ installed }}
{%- endfor %}

## Citations

{% if paper.citation %}Cite {{ trainer_name }} as:

```bibtex
{{ paper.citation }}
```

{% endif %}For TRL, see [its citation](https://github.com/huggingface/trl#citation).
"""

# The libraries whose versions the card lists, by distribution name.
_FRAMEWORKS = {"peft-bitune": "peft-bitune", "PEFT": "peft", "TRL": "trl", "Transformers": "transformers",
               "PyTorch": "torch", "Datasets": "datasets", "Tokenizers": "tokenizers"}


class BituneModelCardMixin:
    """`create_model_card` of the Bitune trainers; mixed in before the TRL trainer class."""

    def _bitune_recipe(self) -> dict[str, Any]:
        """The training options beyond the paper that differ from their defaults, for the card (none by default)."""
        return {}

    def create_model_card(
        self, model_name: str | None = None, dataset_name: str | None = None, tags: str | list[str] | None = None
    ) -> None:
        """The model card of a Bitune adapter trained with TRL: TRL's card data, named after the output (the Hub repo
        or the output folder) unless `model_name` is given, with the base model as the adapter config records it and
        the lines that load the adapter, where TRL's card has a `pipeline(...)` quick start that cannot load it."""
        location = getattr(self, "hub_model_id", None) or self.args.hub_model_id or self.args.output_dir
        if model_name is None:
            model_name = os.path.basename(str(location).rstrip("/"))
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)  # TRL's card data
        if not self.is_world_process_zero():
            return
        bitune = find_bitune_tuner(self.accelerator.unwrap_model(self.model))
        config = bitune.peft_config[bitune.active_adapter]
        path = os.path.join(self.args.output_dir, CARD_NAME)
        base_model = config.base_model_name_or_path
        card = ModelCard.from_template(
            ModelCard.load(path).data,
            template_str=CARD_TEMPLATE,
            model_name=model_name,
            base_model=base_model,
            base_model_is_local=bool(base_model) and os.path.isdir(base_model),
            dataset_name=dataset_name,
            bitune_section=bitune_section(config, location),
            trainer_name=self._name,
            paper=self._paper,
            run_links=_run_links(),
            recipe=[f"{name}={value!r}" for name, value in self._bitune_recipe().items()],
            versions=_installed_versions(),
        )
        card.save(path)
        write_model_card(self.args.output_dir, config, location)


def _run_links() -> dict[str, str | None]:
    """Where the run's logs are, found as TRL's card finds them."""
    from transformers import is_wandb_available
    from trl.trainer.utils import get_comet_experiment_url, get_trackio_space_url

    wandb_url = None
    if is_wandb_available():
        import wandb

        wandb_url = wandb.run.url if wandb.run is not None else None
    return {"Weights & Biases": wandb_url, "Trackio": get_trackio_space_url(), "Comet": get_comet_experiment_url()}


def _installed_versions() -> dict[str, str]:
    installed = {}
    for name, distribution in _FRAMEWORKS.items():
        with contextlib.suppress(PackageNotFoundError):  # e.g. peft-bitune run from a source checkout
            installed[name] = version(distribution)
    return installed
