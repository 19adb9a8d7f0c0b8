"""Small validation helpers shared by the spec dataclasses; each raises ConfigError naming the field."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from vtrain_plugin.core.errors import ConfigError


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{name} must be positive, got {value}")
    return value


def non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def positive_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a positive number, got {value!r}")
    if not value > 0:
        raise ConfigError(f"{name} must be positive, got {value}")
    return float(value)


def positive_finite_number(name: str, value: Any) -> float:
    """A count given as a number, as large counts are written (``270e9`` tokens): positive, not inf or nan."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a positive number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        number = math.inf
    if not (number > 0 and math.isfinite(number)):
        raise ConfigError(f"{name} must be positive and finite, got {value}")
    return number


def non_negative_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"{name} must be a non-negative number, got {value!r}")
    return float(value)


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


def one_of(name: str, value: Any, choices: Iterable[str]) -> str:
    choices = list(choices)
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def divides(divisor_name: str, divisor: int, dividend_name: str, dividend: int) -> None:
    if dividend % divisor:
        raise ConfigError(
            f"{divisor_name} ({divisor}) must divide {dividend_name} ({dividend})"
        )


def no_unknown_keys(where: str, data: Mapping[str, Any], allowed: Iterable[str]) -> None:
    allowed = set(allowed)
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {unknown[0]!r}; allowed keys are {', '.join(sorted(allowed))}"
        )


def mapping(where: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a mapping, got {type(value).__name__}")
    return value
