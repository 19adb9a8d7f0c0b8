"""``python -m vtrain_plugin.cli``."""

from vtrain_plugin.cli import console

console()
