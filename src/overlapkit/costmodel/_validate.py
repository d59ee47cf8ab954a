"""Validation shared by the cost model's configs: one-line errors that name the field.

Nothing here overlaps anything; it keeps bad sizes (heads that don't split over TP ranks,
layers that don't split over pipeline stages) from reaching the arithmetic that predicts
how much communication the GEMMs can hide.
"""

from __future__ import annotations

import math

from ..vocabulary import is_int_at_least


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field and the value."""


def positive(owner: str, field: str, value, *, allow_zero: bool = False) -> None:
    """Fail unless `value` is a number > 0 (or >= 0 when `allow_zero`)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value > 0 or (allow_zero and value == 0)):
        return
    bound = ">= 0" if allow_zero else "> 0"
    raise ConfigError(f"{owner}.{field}={value!r}: must be a finite number {bound}")


def finite(owner: str, field: str, value, *, allow_zero: bool = False) -> None:
    """Fail unless `value` is a finite number > 0 (>= 0 when `allow_zero`): no NaN, no Infinity."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value > 0 or (allow_zero and value == 0)):
        return
    bound = ">= 0" if allow_zero else "> 0"
    raise ConfigError(f"{owner}.{field}={value!r}: must be a finite number {bound}")


def boolean(owner: str, field: str, value) -> None:
    """Fail unless `value` is a real bool (a JSON "no" or 0 must not read as a setting)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{owner}.{field}={value!r}: must be true or false")


def positive_int(owner: str, field: str, value) -> None:
    """Fail unless `value` is an int >= 1."""
    if is_int_at_least(value, 1):
        return
    raise ConfigError(f"{owner}.{field}={value!r}: must be an integer >= 1")


def fraction(owner: str, field: str, value) -> None:
    """Fail unless 0 < value <= 1."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1:
        return
    raise ConfigError(f"{owner}.{field}={value!r}: must be in (0, 1]")


def one_of(owner: str, field: str, value, allowed) -> None:
    """Fail unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ConfigError(f"{owner}.{field}={value!r}: must be one of {', '.join(map(str, allowed))}")


def divides(owner: str, field: str, value: int, by_field: str, by: int) -> None:
    """Fail unless `by` divides `value`."""
    if by <= 0 or value % by != 0:
        raise ConfigError(f"{owner}.{field}={value} is not divisible by {by_field}={by}")


def from_dict(cls, data: dict, owner: str):
    """Build a dataclass from a dict, rejecting unknown keys by name."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls) if f.init}
    if not isinstance(data, dict):
        raise ConfigError(f"{owner}: must be a JSON object with keys {', '.join(sorted(names))}, "
                          f"not {type(data).__name__}")
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{owner}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in data and f.init
                     and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    if missing:
        raise ConfigError(f"{owner}: missing key(s) {', '.join(missing)}")
    return cls(**data)
