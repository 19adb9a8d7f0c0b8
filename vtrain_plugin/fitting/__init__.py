"""Predicted against measured on the user's own runs: comparisons with their training logs, and
calibrations fitted to them."""

from vtrain_plugin.fitting.calibrate import CalibrationFit, FittedRun, PlanRuns, fit_calibration
from vtrain_plugin.fitting.compare import RunComparison, SlowInterval, compare_run

__all__ = ["CalibrationFit", "FittedRun", "PlanRuns", "RunComparison", "SlowInterval", "compare_run", "fit_calibration"]
