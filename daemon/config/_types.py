"""Types of TOML values, checked against a config dataclass's defaults before it is built.

A value of the wrong type (``lease = "30"``, ``allowed_uids = 5``) would otherwise fail
deep inside validation with a message that names no setting. The expected type of each
key is read from the dataclass field's default, so settings added later are checked
without a change here; a field whose default is not a plain TOML type is left to its
own validation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..base._errors import ConfigError

__all__ = ["check_types"]

_KINDS: dict[type, str] = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    tuple: "an array",
}

_PLURALS: dict[type, str] = {
    bool: "booleans",
    int: "integers",
    float: "numbers",
    str: "strings",
    tuple: "arrays",
}

_TOML_NAMES: dict[type, str] = {
    bool: "boolean",
    int: "integer",
    float: "float",
    str: "string",
    list: "array",
    dict: "table",
}


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _expected(value: Any) -> type | None:
    if isinstance(value, bool):
        return bool
    for kind in (int, float, str, tuple):
        if isinstance(value, kind):
            return kind
    return None


def _fits(kind: type, value: Any) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False  # True is an int to Python, never a number to a config file
    if kind is float:
        return isinstance(value, int | float)
    if kind is tuple:
        return isinstance(value, list)
    return isinstance(value, kind)


def check_types(cls: type, table: dict[str, Any], where: str) -> None:
    """Check each value in ``table`` against the type of ``cls``'s field of that name.

    Args:
        cls: A dataclass (``Config``, ``RootConfig``).
        table: Keys and values as TOML gave them.
        where: Where the table is, for the message (``ckptd.toml``, ``[[roots]] /ckpt``).

    Raises:
        ConfigError: naming the key, the type it needs and the value it has.
    """
    for f in dataclasses.fields(cls):
        if f.name not in table:
            continue
        value = table[f.name]
        default = _default(f)
        # A field whose default is None, a table or anything else TOML has no plain type
        # for (a nested options table) is left to its own validation.
        kind = _expected(default)
        if kind is None or _fits(kind, value):
            if kind is tuple and default:
                inner = _expected(default[0])
                if inner is not None and any(not _fits(inner, v) for v in value):
                    raise ConfigError(
                        f"{f.name} in {where} must be an array of {_PLURALS[inner]} "
                        f"(e.g. {list(default)}), got {value!r}"
                    )
            continue
        got = _TOML_NAMES.get(type(value), type(value).__name__)
        raise ConfigError(f"{f.name} in {where} must be {_KINDS[kind]}, got {got} {value!r}")
