"""A small keyed registry: duplicate keys are rejected, unknown keys name the valid ones.

Schedules, software stacks and cluster presets are each one ``Registry``; keys are StrEnum members
or plain names, and lookups accept either spelling.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Generic, TypeVar

from vtrain_plugin.core.errors import ConfigError

V = TypeVar("V")


class Registry(Generic[V]):
    def __init__(self, what: str, *, plural: str, key_type: type[StrEnum] | None = None) -> None:
        self.what = what  # "schedule"
        self.plural = plural  # "schedules": in "valid schedules are ..."
        self.key_type = key_type
        self._entries: dict[str, V] = {}

    def add(self, key: str, value: V) -> V:
        name = str(key)
        if name in self._entries:
            raise ConfigError(f"{self.what} {name!r} is already registered")
        self._entries[name] = value
        return value

    def register(self, key: str) -> Callable[[V], V]:
        """Decorator form of :meth:`add`."""
        def decorate(value: V) -> V:
            return self.add(key, value)
        return decorate

    def get(self, key: str) -> V:
        try:
            return self._entries[str(key)]
        except KeyError:
            raise ConfigError(f"unknown {self.what} {str(key)!r}; valid {self.plural} are "
                              f"{', '.join(self.names())}") from None

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def values(self) -> tuple[V, ...]:
        """The entries in the order they were added."""
        return tuple(self._entries.values())
