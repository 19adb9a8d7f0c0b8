"""Predicted against measured on the user's own runs: comparisons with their training logs, and
calibrations fitted to them."""

from vtrain_plugin.fitting.compare import RunComparison, SlowInterval, compare_run

__all__ = ["RunComparison", "SlowInterval", "compare_run"]
