"""What happens when a `BituneConfig` is read from or written to `adapter_config.json`. Mixed into `BituneConfig`.

- Reading follows PEFT's rule for the inner method's config (`adapter_config`): fields this PEFT does not know are
  dropped with PEFT's warning, so that an adapter saved by a newer PEFT loads in an older one. Bitune's own fields that
  this version does not know are refused: each one changes the forward pass (a newer peft-bitune writes an option only
  when it is used, off its default), and dropping it would silently run the adapter differently.
- Reading names the file when it is not a JSON object, and refuses an adapter whose weights PEFT would then fail to
  read, or refuse to read (a pickle that would run code), before PEFT adds the adapter to a model (see
  `weights_files.py`).
- Writing warns when the folder holds both weights files, of which PEFT loads only `adapter_model.safetensors`, and
  writes the model card (see `model_card.py`), since PEFT writes the config of every adapter it saves, each in its own
  folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any

from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

from .. import compat
from ..constants import is_bitune_type, peft_type_name
from .checkpoint_keys import mark_added_to_load
from .model_card import write_model_card
from .weights_files import check_adapter_weights, warn_if_two_weights_files

_UPGRADE = "It was probably written by a newer version; upgrade with `pip install -U {package}`."


class BituneConfigFileMixin:
    """Checks on reading and writing `adapter_config.json`, and the model card written next to it.

    A mixin, not code in `tuner/config.py`: these are `PeftConfig`'s own file hooks (`from_pretrained`,
    `save_pretrained`, ...), which PEFT calls on the config class, and they belong with the rest of what is on disk;
    the method's config module then reads as the settings alone."""

    @classmethod
    def check_kwargs(cls, **kwargs: Any) -> dict[str, Any]:
        """Refuse fields of `adapter_config.json` unknown to this peft-bitune; drop those of `adapter_config`
        unknown to this PEFT, with PEFT's warning."""
        peft_type = kwargs.get("peft_type")
        if peft_type is not None and not is_bitune_type(peft_type):
            # Another method's fields would otherwise be listed as unknown, with advice to upgrade peft-bitune.
            name = peft_type_name(peft_type)
            raise ValueError(
                f"This adapter_config.json holds a {name} adapter (\"peft_type\": \"{name}\"), not a Bitune one: "
                f"read it with `PeftConfig.from_pretrained` (or {name}'s own config class), and load the adapter with "
                "`PeftModel.from_pretrained`, which picks the class from its type."
            )
        unknown = _unknown_fields(cls, kwargs)
        if unknown:
            # This version cannot tell what a field it does not know does; every Bitune field changes the forward pass.
            raise ValueError(
                f"adapter_config.json has fields that {cls.__name__} of this installation does not know: {unknown}. "
                "Ignoring them could change how the adapter runs, so it is not loaded. "
                + _UPGRADE.format(package="peft-bitune")
            )
        inner = kwargs.get("adapter_config")
        if isinstance(inner, dict) and inner.get("peft_type") in PEFT_TYPE_TO_CONFIG_MAPPING:
            inner_cls = PEFT_TYPE_TO_CONFIG_MAPPING[inner["peft_type"]]
            if unknown := _unknown_fields(inner_cls, inner):
                # PEFT's rule and words for its own configs (`PeftConfigMixin.from_peft_type` in peft/config.py).
                warnings.warn(
                    f"Unexpected keyword arguments {unknown} for class {inner_cls.__name__} in `adapter_config`, "
                    "these are ignored. " + _UPGRADE.format(package="peft"),
                    stacklevel=2,
                )
                kwargs["adapter_config"] = {key: value for key, value in inner.items() if key not in unknown}
        return super().check_kwargs(**kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, subfolder: str | None = None, **kwargs: Any) -> Any:
        """The config, read after checking that adapter_config.json is a JSON object and that the weights next to it
        can be read (see `check_adapter_weights`), and marked so that an adapter PEFT adds for it is removed again if
        its weights are refused (see `checkpoint_keys.mark_added_to_load`)."""
        config = super().from_pretrained(pretrained_model_name_or_path, subfolder=subfolder, **kwargs)
        check_adapter_weights(str(pretrained_model_name_or_path), subfolder, **compat.hub_kwargs(cls, kwargs))
        mark_added_to_load(config)
        return config

    @classmethod
    def from_json_file(cls, path_json_file: str, **kwargs: Any) -> dict[str, Any]:
        """The fields in `path_json_file`; a file that is not a JSON object is refused with its path (PEFT's reading
        would fail with a bare `JSONDecodeError` or `TypeError`)."""
        try:
            read_json_object(path_json_file)
        except ValueError as error:
            raise ValueError(
                f"Cannot read the Bitune adapter config '{path_json_file}': {error}. Save (or download) the adapter "
                "again, or restore the file."
            ) from None
        return super().from_json_file(path_json_file, **kwargs)

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> None:
        """Write `adapter_config.json` and the model card. PEFT calls this after it has written the weights, so a
        weights file left next to them by an earlier save is found here."""
        super().save_pretrained(save_directory, **kwargs)
        write_model_card(save_directory, self, location=str(save_directory))
        warn_if_two_weights_files(str(save_directory))


def read_json_object(path: str) -> dict[str, Any]:
    """The JSON object in the file at `path` (an adapter_config.json, a trainer_state.json); a `ValueError` says why
    the file holds none, and an `OSError` why it cannot be read."""
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            "the file is empty" if os.path.getsize(path) == 0 else f"the file is not valid JSON ({error})"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(
            f"it must hold a JSON object of config fields ({{\"peft_type\": \"BITUNE\", ...}}), but holds "
            f"`{json.dumps(data)[:40]}`"
        )
    return data


def _unknown_fields(config_cls: type, data: dict[str, Any]) -> list[str]:
    return sorted(set(data) - {field.name for field in dataclasses.fields(config_cls)})
