"""The commands of ``vtrain``, each declared once: its name, help line, arguments and handler.

A command module ends with ``COMMANDS``, a tuple of :class:`Command`; :data:`MODULES` in
``vtrain_plugin.cli`` lists the modules in the order ``vtrain --help`` shows them, and
:func:`register` files each command in a :class:`~vtrain_plugin.core.registry.Registry`, which
rejects a name given twice.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from vtrain_plugin.core.registry import Registry


@dataclass(frozen=True, slots=True, kw_only=True)
class Command:
    name: str  # as typed: "estimate", "profile-comm"
    help: str  # one line in `vtrain --help`
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]  # the exit code
    traces: bool = False  # traces models, so takes the trace-cache options (--cache-dir, --no-cache)


def register(commands: Iterable[Command]) -> Registry[Command]:
    """A registry of ``commands``, in the order given; a name given twice is an error."""
    registry: Registry[Command] = Registry("command", plural="commands")
    for command in commands:
        registry.add(command.name, command)
    return registry
