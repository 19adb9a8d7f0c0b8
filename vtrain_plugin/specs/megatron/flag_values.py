"""Values of Megatron-LM flags as the readers check them: one-line errors that name the flag.

Shared by the model, attention and hybrid readers of :mod:`vtrain_plugin.specs.megatron`.
"""

from __future__ import annotations

from typing import Any

from vtrain_plugin.core.errors import ConfigError


def positive_int(flag: str, text: Any) -> int:
    """``text`` as a positive integer, or a ConfigError naming ``flag``."""
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise ConfigError(f"{flag} must be a positive integer, got {value}")
    return value


def non_negative_int(flag: str, text: Any) -> int:
    """``text`` as an integer of at least 0, or a ConfigError naming ``flag``."""
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} must be a non-negative integer, got {text!r}") from None
    if value < 0:
        raise ConfigError(f"{flag} must be a non-negative integer, got {value}")
    return value
