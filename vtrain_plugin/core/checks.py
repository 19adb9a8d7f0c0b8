"""Small validation helpers shared by the spec dataclasses; each raises ConfigError naming the field.

Messages show the offending value through :func:`show`, so a hostile value (a 4,000-digit integer,
a megabyte string, a deeply nested list) still makes a short, one-line message.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from collections.abc import Iterable, Mapping
from typing import Any

from vtrain_plugin.core.errors import ConfigError

_EXACT_BELOW = 10**18  # integers below this are shown digit by digit


def show(value: Any) -> str:
    """A short, one-line rendering of ``value`` for an error message.

    Integers of 19 digits or more are shown by their power of ten (``10**30``, ``1.234e+30``):
    Python refuses to convert an integer of more than 4,300 digits to text, and such a value would
    not make a readable message anyway. Strings and containers are cut by :mod:`reprlib`.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        return _SHORT.repr(value)
    if abs(value) < _EXACT_BELOW:
        return str(value)
    sign, magnitude = ("-" if value < 0 else ""), abs(value)
    exponent = int(math.log10(magnitude))  # within one of the true exponent: corrected below
    while 10**exponent > magnitude:
        exponent -= 1
    while 10**(exponent + 1) <= magnitude:
        exponent += 1
    if magnitude == 10**exponent:
        return f"{sign}10**{exponent}"
    return f"{sign}{magnitude // 10**(exponent - 3) / 1000:.3f}e+{exponent}"


class _ShortRepr(reprlib.Repr):
    """:class:`reprlib.Repr` with small limits, and integers inside containers shown by :func:`show`."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxtuple, self.maxdict, self.maxset = 3, 4, 4, 4, 4
        self.maxstring = self.maxother = 60

    def repr_int(self, x: int, level: int) -> str:
        return show(x)


_SHORT = _ShortRepr()


def as_float(value: int | float) -> float:
    """``float(value)``, an integer beyond the float range becoming an infinity (for range checks to reject)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be a positive integer, got {show(value)}")
    if value <= 0:
        raise ConfigError(f"{name} must be positive, got {show(value)}")
    return value


def non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be a non-negative integer, got {show(value)}")
    return value


def positive_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a positive number, got {show(value)}")
    if not value > 0:
        raise ConfigError(f"{name} must be positive, got {show(value)}")
    return as_float(value)


def positive_finite_number(name: str, value: Any) -> float:
    """A count given as a number, as large counts are written (``270e9`` tokens): positive, not inf or nan."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a positive number, got {show(value)}")
    number = as_float(value)
    if not (number > 0 and math.isfinite(number)):
        raise ConfigError(f"{name} must be positive and finite, got {show(value)}")
    return number


def non_negative_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"{name} must be a non-negative number, got {show(value)}")
    return as_float(value)


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {show(value)}")
    return value


def string(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {show(value)}")
    return value


def one_of(name: str, value: Any, choices: Iterable[str]) -> str:
    choices = list(choices)
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {show(value)}")
    return value


def divides(divisor_name: str, divisor: int, dividend_name: str, dividend: int) -> None:
    if dividend % divisor:
        raise ConfigError(
            f"{divisor_name} ({show(divisor)}) must divide {dividend_name} ({show(dividend)})"
        )


def no_unknown_keys(where: str, data: Mapping[str, Any], allowed: Iterable[str]) -> None:
    """Keys of a parsed file may be of any type (YAML reads ``1:`` and ``null:`` as keys), so the
    unknown ones are ordered by their text."""
    allowed = set(allowed)
    unknown = sorted((k for k in data if not (isinstance(k, str) and k in allowed)), key=show)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {show(unknown[0])}; allowed keys are {', '.join(sorted(allowed))}"
        )


def mapping(where: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a mapping, got {type(value).__name__}")
    return value


def settings_of(cls: type, where: str, value: Any, *, required: Iterable[str] = ()) -> Any:
    """A settings dataclass given as itself, as a plan file's mapping of its fields, or as None
    (``where`` names it in errors; ``required`` fields must be in the mapping)."""
    if value is None or isinstance(value, cls):
        return value
    given = mapping(where, value)
    no_unknown_keys(where, given, [f.name for f in dataclasses.fields(cls)])
    for name in required:
        if name not in given:
            raise ConfigError(f"{where}.{name} is required")
    return cls(**given)
