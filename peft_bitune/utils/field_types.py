"""Type checks of config fields against their annotations, so that a value of the wrong type is refused by name.

A config read from `adapter_config.json` takes whatever the JSON holds: `"train_mixing": "no"` is a non-empty string,
so truthy, and would mean yes; `"mix_scale": Infinity` parses as a float; `"r": "8"` fails deep inside PEFT with
`TypeError: '<=' not supported`. The dataclass configs (Bitune's and PEFT's) declare each field's type, so the check
reads it from there. Only simple annotations are checked: `bool`, `int`, `float`, `str`, `None`, `Literal`, enums,
`dict`, lists of simple types, and unions of these; a field with any other annotation is left to its config's own
checks.
"""

from __future__ import annotations

import functools
import math
import numbers
import types
import typing
from collections.abc import Mapping
from enum import Enum
from typing import Any

# What `_expected` returns for an annotation this module does not check.
_UNCHECKED = None


def check_field_types(config_cls: type, values: Mapping[str, Any], prefix: str = "") -> None:
    """
    Raise a `ValueError` naming the first field of `values` whose value does not match its annotation on
    `config_cls`: booleans must be booleans, numbers finite numbers (not booleans or strings), a `Literal` one of its
    values. `prefix` goes before the field name in the message (e.g. `"adapter_config."`).
    """
    hints = _type_hints(config_cls)
    for name, value in values.items():
        if name not in hints:
            continue
        expected = _expected(hints[name], value)
        if expected is not _UNCHECKED:
            raise ValueError(
                f"`{prefix}{name}` must be {expected}, got {value!r} (a {type(value).__name__}). Fix it where the "
                "config is made, or in adapter_config.json."
            )


@functools.cache
def _type_hints(config_cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(config_cls)
    except Exception:  # an annotation that does not resolve: nothing to check it against
        return {}


def _expected(hint: Any, value: Any) -> str | None:
    """What `value` should be, in words, if it does not match `hint`; `_UNCHECKED` if it matches or `hint` is not one
    this module checks."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        arms = typing.get_args(hint)
        descriptions = []
        for arm in arms:
            description = _expected(arm, value)
            if description is _UNCHECKED:
                return _UNCHECKED  # the value matches this arm, or the arm cannot be checked
            descriptions.append(description)
        return " or ".join(descriptions)
    if origin is typing.Literal:
        allowed = typing.get_args(hint)
        if any(value == option and type(value) is type(option) for option in allowed):
            return _UNCHECKED
        return f"one of {list(allowed)}"
    if origin in (list, tuple, set, frozenset):
        if not isinstance(value, (list, tuple)):
            return "a list"
        element = (typing.get_args(hint) or (Any,))[0]
        if element in _SIMPLE:
            wrong = [item for item in value if _expected(element, item) is not _UNCHECKED]
            if wrong:
                return f"a list of {_SIMPLE[element]}"
        return _UNCHECKED
    if origin is dict or hint is dict:
        return _UNCHECKED if isinstance(value, dict) else "a mapping (a JSON object)"
    if hint is type(None):
        return _UNCHECKED if value is None else "null (None)"
    if isinstance(hint, type) and issubclass(hint, Enum):
        if isinstance(value, hint) or value in {member.value for member in hint}:
            return _UNCHECKED
        return f"one of {[member.value for member in hint]}"
    if hint in _SIMPLE:
        return _UNCHECKED if _MATCHES[hint](value) else _SIMPLE[hint]
    return _UNCHECKED


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


# Simple annotations: how a value of each is described, and the test it must pass. An `int` field takes any finite
# number: PEFT's configs annotate e.g. `lora_alpha` as `int` but are used with floats too.
_SIMPLE = {bool: "true or false", int: "a finite number", float: "a finite number", str: "a string"}
_MATCHES = {
    bool: lambda value: isinstance(value, bool),
    int: _is_finite_number,
    float: _is_finite_number,
    str: lambda value: isinstance(value, str),
}
