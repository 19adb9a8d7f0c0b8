"""Predicted against measured: the user's logs, iterations timed in their own loop, one-device runs.

``logs/`` reads Megatron-LM, NeMo and TensorBoard logs; :func:`compare_run` sets a run's logs beside
its estimate; :func:`compare_iterations` and :class:`IterationRecorder` do the same for iterations
timed in the user's loop; :func:`validate` trains a plan on this machine's device; and
:func:`fit_calibration` (``vtrain calibrate``) is the one fitter of the cluster constants.
"""

from vtrain_plugin.measured.calibrate import CalibrationFit, FittedRun, PlanRuns, fit_calibration
from vtrain_plugin.measured.compare_run import RunComparison, SlowInterval, compare_run
from vtrain_plugin.measured.iterations import IterationComparison, IterationRecorder, compare_iterations
from vtrain_plugin.measured.one_device import ValidationResult, single_device_run, validate

__all__ = ["CalibrationFit", "FittedRun", "IterationComparison", "IterationRecorder", "PlanRuns", "RunComparison",
           "SlowInterval", "ValidationResult", "compare_iterations", "compare_run", "fit_calibration",
           "single_device_run", "validate"]
