"""Fit the cluster constants a user's own runs identify, inside their documented ranges.

:func:`fit_calibration` takes plans with the logs of their runs; each plan's measured iteration time
is the median of :func:`~vtrain_plugin.measured.compare_run.compare_run` (logs of the same plan pooled).
The constants named in ``fit`` (by default GEMM efficiency, network efficiency and the host cost per
kernel) are fitted by bounded least squares on the log of predicted over measured time
(``scipy.optimize.least_squares``), every constant searched inside its range of
:data:`~vtrain_plugin.hardware.calibration.CONSTANT_RANGES` (GEMM efficiency also below the
device's measured ceiling), never clipped afterwards; the backward per-kernel host cost follows
the forward one, as in the shipped calibrations. The other constants are those of the calibration
the plans use now. A fit the runs cannot identify (:mod:`~vtrain_plugin.measured.identify`) is
refused. Leave-one-out refits without each plan in turn, where the others still identify the
constants, and predicts it. Predictions use the analytical kernel model (no profile database): it
is the model the calibration file feeds.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.units import NS_PER_MS
from vtrain_plugin.cost.prepare import PreparedGraph, prepare_run
from vtrain_plugin.estimate import estimate, predict
from vtrain_plugin.measured.compare_run import DEFAULT_WARMUP_ITERATIONS, compare_run
from vtrain_plugin.measured.identify import check_identifiable, informed, unidentifiable
from vtrain_plugin.hardware.calibration import CONSTANT_RANGES, Calibration, DeviceConstants, calibration_for
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.specs.run import RunConfig

DEFAULT_FIT = ("gemm_efficiency", "network_efficiency", "host_overhead_ns")
# Constants set from a fitted one (see the module doc), never fitted themselves.
TIED = {"host_overhead_ns": "backward_host_overhead_ns"}


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRuns:
    """A plan and the logs of its runs (pooled)."""

    label: str
    run: RunConfig
    logs: tuple[str | os.PathLike, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class FittedRun:
    plan: str
    logs: tuple[str, ...]
    measured_ms: float
    before_ms: float  # predicted with the calibration in use before the fit
    after_ms: float  # predicted with the fitted constants
    leave_one_out_ms: float | None  # predicted by a fit without this plan; None where the others cannot identify
    informs: tuple[str, ...]  # the fitted constants this run informs

    def error_pct(self, predicted_ms: float | None) -> float | None:
        return None if predicted_ms is None else 100.0 * (predicted_ms - self.measured_ms) / self.measured_ms


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationFit:
    device: str
    software_stack: str
    based_on: str  # the calibration file the other constants (and the start) come from
    fitted: tuple[str, ...]
    ranges: dict[str, tuple[float, float]]  # searched, per fitted constant
    before: DeviceConstants
    after: DeviceConstants
    runs: tuple[FittedRun, ...]

    @property
    def error_before_pct(self) -> float:
        return _mean_abs([r.error_pct(r.before_ms) for r in self.runs])

    @property
    def error_after_pct(self) -> float:
        return _mean_abs([r.error_pct(r.after_ms) for r in self.runs])

    @property
    def leave_one_out_error_pct(self) -> float | None:
        errors = [r.error_pct(r.leave_one_out_ms) for r in self.runs if r.leave_one_out_ms is not None]
        return _mean_abs(errors) if errors else None

    def provenance(self) -> dict[str, Any]:
        return {
            "based_on": self.based_on,
            "fitted": {name: {"before": getattr(self.before, name), "after": getattr(self.after, name),
                              "range": list(self.ranges[name])} for name in self.fitted},
            "runs": [{"plan": r.plan, "logs": list(r.logs), "measured_ms": r.measured_ms,
                      "predicted_before_ms": r.before_ms, "predicted_after_ms": r.after_ms,
                      "leave_one_out_ms": r.leave_one_out_ms, "informs": list(r.informs)} for r in self.runs],
            "mean_abs_error_before_pct": self.error_before_pct, "mean_abs_error_after_pct": self.error_after_pct,
            "leave_one_out_mean_abs_error_pct": self.leave_one_out_error_pct,
        }

    def calibration(self, command: str) -> Calibration:
        """The calibration file of this fit (``command``: what produced it)."""
        plans = ", ".join(f"{r.plan} ({', '.join(r.logs)})" for r in self.runs)
        source = (f"Fitted by vtrain calibrate to {len(self.runs)} measured run{'s' * (len(self.runs) != 1)} of the "
                  f"user's cluster: {plans}. {', '.join(self.fitted)} fitted by bounded least squares on the log "
                  f"error inside their documented ranges; the other constants from {self.based_on}.")
        return Calibration(device=self.device, software_stack=self.software_stack, source=source, command=command,
                           constants=self.after, provenance=self.provenance())

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "software_stack": self.software_stack, **self.provenance(),
                "constants": asdict(self.after)}


def _mean_abs(errors: Sequence[float | None]) -> float:
    return float(np.mean([abs(e) for e in errors if e is not None]))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Prepared:
    label: str
    run: RunConfig
    prepared: PreparedGraph
    measured_ms: float
    logs: tuple[str, ...]

    def predict_ms(self, constants: DeviceConstants) -> float:
        _, result = predict(self.prepared, cluster=self.run.cluster, training=self.run.training, constants=constants)
        return float(result.iteration_ns / NS_PER_MS)


class _Space:
    """The fitted constants as a point of the unit cube (log scale for the times in ns)."""

    def __init__(self, base: DeviceConstants, names: Sequence[str], ranges: dict[str, tuple[float, float]]) -> None:
        self.base, self.names, self.ranges = base, tuple(names), ranges

    def constants(self, unit: np.ndarray) -> DeviceConstants:
        values = {}
        for name, u in zip(self.names, unit):
            low, high = self.ranges[name]
            u = min(max(float(u), 0.0), 1.0)
            value = low * (high / low) ** u if name.endswith("_ns") else low + u * (high - low)
            values[name] = min(max(value, low), high)  # exactly inside despite rounding
        values.update({TIED[n]: values[n] for n in self.names if n in TIED})
        return replace(self.base, **values)

    def unit(self, constants: DeviceConstants) -> np.ndarray:
        out = []
        for name in self.names:
            low, high = self.ranges[name]
            value = min(max(getattr(constants, name), low), high)
            out.append(math.log(value / low) / math.log(high / low) if name.endswith("_ns")
                       else (value - low) / (high - low))
        return np.array(out)

    def effects(self, plans: Sequence[_Prepared], at: np.ndarray) -> np.ndarray:
        """Per plan and constant: log(time at the top of its range / time at the bottom), others at ``at``."""
        out = np.zeros((len(plans), len(self.names)))
        for j in range(len(self.names)):
            low, high = at.copy(), at.copy()
            low[j], high[j] = 0.0, 1.0
            lo_c, hi_c = self.constants(low), self.constants(high)
            out[:, j] = [math.log(p.predict_ms(hi_c) / p.predict_ms(lo_c)) for p in plans]
        return out


def fit_calibration(plans: Sequence[PlanRuns], *, fit: Sequence[str] = DEFAULT_FIT,
                    warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS) -> CalibrationFit:
    """Fit ``fit`` to the runs of ``plans`` (see the module doc)."""
    names = _fitted_names(fit)
    if not plans:
        raise ConfigError("calibrate: give at least one plan with its runs")
    device, stack, base = _common_calibration(plans)
    ceiling = get_device(device).gemm_ceiling
    ranges = {n: (CONSTANT_RANGES[n][0], min(CONSTANT_RANGES[n][1], ceiling)
                  if n == "gemm_efficiency" and ceiling is not None else CONSTANT_RANGES[n][1]) for n in names}
    prepared = [_prepare(p, warmup_iterations) for p in plans]
    space = _Space(base.constants, names, ranges)
    start = space.unit(base.constants)
    effects = space.effects(prepared, start)
    labels = [p.label for p in prepared]
    check_identifiable(effects, names, labels)
    after = space.constants(_least_squares(prepared, space, start))
    loo = []
    for i, held in enumerate(prepared):
        rest = [p for j, p in enumerate(prepared) if j != i]
        if unidentifiable(np.delete(effects, i, axis=0), names, labels[:i] + labels[i + 1:]) is not None:
            loo.append(None)
        else:
            loo.append(held.predict_ms(space.constants(_least_squares(rest, space, start))))
    runs = tuple(FittedRun(plan=p.label, logs=p.logs, measured_ms=p.measured_ms, before_ms=p.predict_ms(base.constants),
                           after_ms=p.predict_ms(after), leave_one_out_ms=held_out, informs=informs)
                 for p, held_out, informs in zip(prepared, loo, informed(effects, names)))
    return CalibrationFit(device=device, software_stack=stack, based_on=base.path or "the package's defaults",
                          fitted=names, ranges=ranges, before=base.constants, after=after, runs=runs)


def _fitted_names(fit: Sequence[str]) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(fit))
    fittable = [n for n in CONSTANT_RANGES if n not in TIED.values()]
    for name in names:
        if name not in fittable:
            raise ConfigError(f"--fit: {name!r} is not a constant calibrate fits; choose from {', '.join(fittable)}")
    if not names:
        raise ConfigError("--fit: name at least one constant")
    return names


def _common_calibration(plans: Sequence[PlanRuns]) -> tuple[str, str, Calibration]:
    """The (device, software stack) every plan runs on, and the calibration they use now."""
    pairs = {}
    for p in plans:
        device = get_device(p.run.cluster.gpu)
        pairs.setdefault((device.name, p.run.training.stack_for(p.run.model, device.architecture,
                                                                  p.run.parallel).value), []).append(p.label)
    if len(pairs) > 1:
        raise ConfigError("calibrate: one calibration file is for one (device, software stack), the plans use "
                          + "; ".join(f"{d} {s} ({', '.join(labels)})" for (d, s), labels in pairs.items()))
    (device, stack), = pairs
    return device, stack, calibration_for(device, stack)


def _prepare(plan: PlanRuns, warmup_iterations: int) -> _Prepared:
    run = plan.run
    comparison = compare_run(estimate(run, profile_db=False), plan.logs, warmup_iterations=warmup_iterations)
    stack = run.training.stack_for(run.model, get_device(run.cluster.gpu).architecture, run.parallel)
    graph = prepare_run(trace(run.model, run.parallel), stack, run.training)
    return _Prepared(label=plan.label, run=run, prepared=graph, measured_ms=comparison.measured_iteration_time_ms,
                     logs=comparison.runs)


def _least_squares(plans: Sequence[_Prepared], space: _Space, start: np.ndarray) -> np.ndarray:
    """The unit-cube point that minimises the squared log errors of ``plans``, searched inside the cube."""
    from scipy.optimize import least_squares  # here: a second to load, and only calibration needs it

    measured = np.log([p.measured_ms for p in plans])

    def residuals(unit: np.ndarray) -> np.ndarray:
        constants = space.constants(unit)
        return np.log([p.predict_ms(constants) for p in plans]) - measured

    return least_squares(residuals, np.clip(start, 0.0, 1.0), bounds=(0.0, 1.0), method="trf", diff_step=1e-3,
                         x_scale=1.0).x
