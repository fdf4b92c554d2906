"""Type checks of config fields against their annotations, so that a value of the wrong type is refused by name.

A config read from `adapter_config.json` takes whatever the JSON holds: `"train_mixing": "no"` is a non-empty string,
so truthy, and would mean yes; `"mix_scale": Infinity` parses as a float; `"r": "8"` fails deep inside PEFT with
`TypeError: '<=' not supported`. The dataclass configs (Bitune's and PEFT's) declare each field's type, so pydantic's
`TypeAdapter` checks the value against it, strictly (no "8" for 8, no 1 for true) and with finite numbers only. Only
plain annotations are checked: `bool`, `int`, `float`, `str`, `None`, `Literal`, enums, and lists, dicts and unions of
these; a field annotated with any other class (e.g. PEFT's sub-config dataclasses) is left to its config's own checks.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Mapping
from enum import Enum
from typing import Annotated, Any

from pydantic import ConfigDict, Strict, TypeAdapter, ValidationError

_STRICT = ConfigDict(strict=True, allow_inf_nan=False)
# How a value is described when pydantic refuses it, by pydantic's error type.
_EXPECTED = {"bool_type": "true or false", "float_type": "a finite number", "finite_number": "a finite number",
             "string_type": "a string", "none_required": "null (None)", "dict_type": "a mapping (a JSON object)",
             "list_type": "a list"}


def check_field_types(config_cls: type, values: Mapping[str, Any], prefix: str = "") -> None:
    """
    Raise a `ValueError` naming the first field of `values` whose value does not match its annotation on
    `config_cls`: booleans must be booleans, numbers finite numbers (not booleans or strings), a `Literal` one of its
    values. `prefix` goes before the field name in the message (e.g. `"adapter_config."`).
    """
    adapters, nullable = _adapters(config_cls)
    for name, value in values.items():
        if name not in adapters:
            continue
        try:
            adapters[name].validate_python(value)
        except ValidationError as error:
            expected = _expected(error) + (" or null (None)" if name in nullable else "")  # pydantic omits that arm
            raise ValueError(
                f"`{prefix}{name}` must be {expected}, got {value!r} (a {type(value).__name__}). Fix it where "
                "the config is made, or in adapter_config.json."
            ) from None


@functools.cache
def _adapters(config_cls: type) -> tuple[dict[str, TypeAdapter], set[str]]:
    """A checker per annotated field, and the fields that may be None."""
    try:
        hints = typing.get_type_hints(config_cls)
    except Exception:  # an annotation that does not resolve: nothing to check it against
        return {}, set()
    nullable = {name for name, hint in hints.items() if type(None) in typing.get_args(hint)}
    return {name: TypeAdapter(_checked(hint), config=_STRICT) for name, hint in hints.items()}, nullable


def _checked(hint: Any) -> Any:
    """The annotation as it is checked: an `int` as any finite number (PEFT's configs annotate e.g. `lora_alpha` as
    `int` and are used with floats), an enum by its values too, a list, tuple or set as any sequence, and any other
    class as anything (left to its config)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal or hint in (bool, float, str, type(None), dict, list):
        return hint
    if hint is int:
        return float
    if isinstance(hint, type) and issubclass(hint, Enum):
        return Annotated[hint, Strict(False)]
    if origin is typing.Union or origin is types.UnionType:
        return typing.Union[tuple(_checked(arm) for arm in args)]  # noqa: UP007 (built from a tuple)
    if origin in (list, tuple, set, frozenset):
        return Annotated[list[_checked(args[0]) if args else Any], Strict(False)]
    if origin is dict:
        return dict[tuple(_checked(arg) for arg in args)] if args else dict
    return Any


def _expected(error: ValidationError) -> str:
    """What the refused value should be, in words: each arm of a union that refused it, in order."""
    described = []
    for detail in error.errors(include_url=False):
        if detail["type"] in ("literal_error", "enum"):  # pydantic writes the values as "'a', 'b' or 'c'"
            words = f"one of [{detail['ctx']['expected'].replace(' or ', ', ')}]"
        else:
            words = _EXPECTED.get(detail["type"], detail["msg"])
        if any(isinstance(place, int) for place in detail["loc"]):  # refused inside a list
            words = f"a list of {words}"
        if words not in described:
            described.append(words)
    return " or ".join(described)
