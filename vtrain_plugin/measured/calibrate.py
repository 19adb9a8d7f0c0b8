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
constants, and predicts it (:func:`leave_out_refits`: the same fit started from the full one).
Predictions use the analytical kernel model (no profile database): it is the model the calibration
file feeds.

:func:`fit_constants` is the fit itself, also over plans of several devices and software stacks at
once (the shipped calibration files: ``benchmarks/accuracy/calibrate.py``): a host cost
(:data:`~vtrain_plugin.hardware.calibration.SOFTWARE_CONSTANTS`) is one parameter per software
stack, any other constant one per device, each searched in
:func:`~vtrain_plugin.hardware.calibration.constant_range`; plans carry a data set's name, and each
set weighs the same (its residuals scaled by one over the root of its size). A plan is predicted
again only when its own constants change: a finite difference of another GPU's or another stack's
constant reuses its time, which halves the cost of a joint fit's Jacobian.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection, Sequence
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
from vtrain_plugin.hardware.calibration import (CONSTANT_RANGES, SOFTWARE_CONSTANTS, Calibration, DeviceConstants,
                                                calibration_for, constant_range)
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.specs.run import RunConfig

# The fit stops when a step changes the cost or the unit point by less than this share, or the
# gradient is this small: far below the scatter of measured times (percents); scipy's default,
# 1e-8, spends its last evaluations on digits no measurement supports.
_TOLERANCE = 1e-6
_DIFF_STEP = 1e-3  # finite-difference step, a share of the unit range (constants are read to 3-4 digits)
_MEMO_PER_PLAN = 64  # predictions remembered per plan before the memo starts over
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
class MeasuredPlan:
    """A prepared plan with its measured iteration time: what :func:`fit_constants` fits."""

    label: str
    run: RunConfig
    prepared: PreparedGraph
    measured_ms: float
    device: str  # preset name
    stack: str  # software stack value
    base: DeviceConstants  # the constants it is predicted with where not fitted
    data_set: str = ""  # each data set weighs the same in a fit
    logs: tuple[str, ...] = ()

    def predict_ms(self, constants: DeviceConstants) -> float:
        _, result = predict(self.prepared, cluster=self.run.cluster, training=self.run.training, constants=constants)
        return float(result.iteration_ns / NS_PER_MS)


def measured_plan(label: str, run: RunConfig, measured_ms: float, *, data_set: str = "",
                  logs: tuple[str, ...] = ()) -> MeasuredPlan:
    """``run`` traced and prepared as ``vtrain estimate`` prepares it, with the calibration it uses now."""
    device = get_device(run.cluster.gpu)
    stack = run.training.stack_for(run.model, device.architecture, run.parallel)
    graph = prepare_run(trace(run.model, run.parallel), stack, run.training)
    return MeasuredPlan(label=label, run=run, prepared=graph, measured_ms=measured_ms, device=device.name,
                        stack=stack.value, base=calibration_for(device.name, stack).constants, data_set=data_set,
                        logs=logs)


def scope_of(name: str, plan: MeasuredPlan) -> str:
    """What one fitted value of ``name`` is shared by: its software stack for a host cost, else its device."""
    return plan.stack if name in SOFTWARE_CONSTANTS else plan.device


class JointSpace:
    """The fitted parameters ((constant, scope) pairs) as a point of the unit cube (log scale for the
    times in ns), each inside its range."""

    def __init__(self, plans: Sequence[MeasuredPlan], names: Sequence[str],
                 fixed: Collection[tuple[str, str]] = (),
                 scope: Callable[[str, MeasuredPlan], str] = scope_of) -> None:
        """``fixed``: (constant, scope) pairs of ``names`` left at each plan's own value; ``scope``: what
        one value of a constant is shared by (:func:`scope_of` by default)."""
        self.names, self.scope = tuple(names), scope
        params: dict[tuple[str, str], tuple[float, float]] = {}
        for plan in plans:
            for name in self.names:
                if (name, scope(name, plan)) not in fixed:
                    params.setdefault((name, scope(name, plan)), constant_range(name, plan.device))
        self.params = tuple(params)
        self.ranges = params
        self.index = {p: i for i, p in enumerate(self.params)}

    def value(self, param: tuple[str, str], u: float) -> float:
        low, high = self.ranges[param]
        u = min(max(float(u), 0.0), 1.0)
        value = low * (high / low) ** u if param[0].endswith("_ns") else low + u * (high - low)
        return min(max(value, low), high)  # exactly inside despite rounding

    def to_unit(self, param: tuple[str, str], value: float) -> float:
        low, high = self.ranges[param]
        value = min(max(value, low), high)
        return math.log(value / low) / math.log(high / low) if param[0].endswith("_ns") else (value - low) / (high - low)

    def constants(self, plan: MeasuredPlan, unit: np.ndarray) -> DeviceConstants:
        params = [(n, self.scope(n, plan)) for n in self.names]
        values = {p[0]: self.value(p, unit[self.index[p]]) for p in params if p in self.index}
        values.update({TIED[n]: values[n] for n in values if n in TIED})
        return replace(plan.base, **values)

    def start(self, plans: Sequence[MeasuredPlan]) -> np.ndarray:
        """The unit point of the plans' own constants (the first plan of each scope's)."""
        unit = np.zeros(len(self.params))
        for plan in reversed(plans):
            for n in self.names:
                param = (n, self.scope(n, plan))
                if param in self.index:
                    unit[self.index[param]] = self.to_unit(param, getattr(plan.base, n))
        return unit

    def label(self, param: tuple[str, str]) -> str:
        return f"{param[0]} ({param[1]})"

    def effects(self, plans: Sequence[MeasuredPlan], at: np.ndarray) -> np.ndarray:
        """Per plan and parameter: log(time at the top of its range / time at the bottom), others at ``at``."""
        out = np.zeros((len(plans), len(self.params)))
        for j in range(len(self.params)):
            low, high = at.copy(), at.copy()
            low[j], high[j] = 0.0, 1.0
            out[:, j] = [math.log(p.predict_ms(self.constants(p, high)) / p.predict_ms(self.constants(p, low)))
                         for p in plans]
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class JointFit:
    """The result of :func:`fit_constants`: the fitted point, and per plan its log residual and its
    response to each parameter (the Jacobian the fitter last took)."""

    space: JointSpace
    unit: np.ndarray
    residuals: np.ndarray  # log(predicted / measured) per plan
    jacobian: np.ndarray  # d residual / d unit, plans x parameters
    weights: np.ndarray  # per plan
    evaluations: int = 0  # of the residuals at a new point (the Jacobian's not counted)
    jacobians: int = 0  # finite-difference Jacobians, one per parameter and plan at most
    predictions: int = 0  # plans predicted, the finite differences' included (the fit's cost)
    converged: bool = True  # a tolerance was met, not the bound on evaluations

    def value(self, param: tuple[str, str]) -> float:
        return self.space.value(param, self.unit[self.space.index[param]])

    def constants(self, plan: MeasuredPlan) -> DeviceConstants:
        return self.space.constants(plan, self.unit)

    def on_bound(self, tolerance: float = 1e-3) -> list[tuple[str, str]]:
        """The parameters at (within ``tolerance`` of the unit range of) a bound of their range."""
        return [p for p, u in zip(self.space.params, self.unit) if u <= tolerance or u >= 1.0 - tolerance]


def fit_constants(plans: Sequence[MeasuredPlan], names: Sequence[str], *, start: np.ndarray | None = None,
                  space: JointSpace | None = None, max_nfev: int | None = None, max_steps: int | None = None,
                  verbose: int = 0, memo: dict[tuple[int, DeviceConstants], float] | None = None) -> JointFit:
    """Fit ``names`` to ``plans`` by bounded least squares on the log error (see the module doc).

    ``max_steps`` (at least 1): stop after this many accepted trust-region steps, before the Jacobian
    at the last point is taken (the fit's cost); ``memo``: log predicted times by (``id`` of the plan, its
    constants), shared between fits of the same plan objects (leave-out refits reuse the times at
    their common start); a new one by default."""
    from scipy.optimize import least_squares  # here: a second to load, and only calibration needs it
    from scipy.optimize._numdiff import approx_derivative  # least_squares' own finite differences

    if max_steps is not None and max_steps < 1:
        raise ConfigError(f"max_steps: {max_steps} must be at least 1 (or None: to convergence)")
    space = space or JointSpace(plans, names)
    sizes: dict[str, int] = {}
    for p in plans:
        sizes[p.data_set] = sizes.get(p.data_set, 0) + 1
    weights = np.array([1.0 / math.sqrt(sizes[p.data_set]) for p in plans])
    measured = np.log([p.measured_ms for p in plans])
    # A plan's time depends only on its own constants: a finite difference of a parameter outside
    # its scopes (another GPU's, another stack's) finds them unchanged and reuses the time.
    memo = {} if memo is None else memo
    predictions = 0

    def log_predicted(plan: MeasuredPlan, unit: np.ndarray) -> float:
        nonlocal predictions
        key = (id(plan), space.constants(plan, unit))
        if key not in memo:
            if len(memo) > _MEMO_PER_PLAN * len(plans):
                memo.clear()
            memo[key] = math.log(plan.predict_ms(key[1]))
            predictions += 1
        return memo[key]

    calls = [0, 0]  # of residuals: every one, and those of the finite differences of a max_steps fit

    def residuals(unit: np.ndarray) -> np.ndarray:
        calls[0] += 1
        return weights * (np.array([log_predicted(p, unit) for p in plans]) - measured)

    taken: list[np.ndarray] = []  # the Jacobians of a fit bounded by max_steps

    def jacobian(unit: np.ndarray) -> np.ndarray:
        if taken and len(taken) >= (max_steps or 0):  # after the last allowed step (the first call: the start)
            raise _StepsTaken(unit.copy())
        before = calls[0]
        taken.append(approx_derivative(residuals, unit, method="2-point", rel_step=_DIFF_STEP, bounds=(0.0, 1.0)))
        calls[1] += calls[0] - before
        return taken[-1]

    x0 = np.clip(space.start(plans) if start is None else start, 0.0, 1.0)
    try:
        result = least_squares(residuals, x0, jac="2-point" if max_steps is None else jacobian, bounds=(0.0, 1.0),
                               method="trf", diff_step=_DIFF_STEP, x_scale=1.0, ftol=_TOLERANCE, xtol=_TOLERANCE,
                               gtol=_TOLERANCE, max_nfev=max_nfev, verbose=verbose)
        unit, fun, jac = result.x, result.fun, result.jac
        evaluations, jacobians, converged = int(result.nfev), int(result.njev or 0), bool(result.status > 0)
    except _StepsTaken as stop:
        evaluations, jacobians, converged = calls[0] - calls[1], len(taken), False
        unit, fun, jac = stop.unit, residuals(stop.unit), taken[-1]
    return JointFit(space=space, unit=unit, residuals=fun / weights, jacobian=jac / weights[:, None], weights=weights,
                    evaluations=evaluations, jacobians=jacobians, predictions=predictions, converged=converged)


class _StepsTaken(Exception):
    """A fit bounded by ``max_steps`` took them: its point."""

    def __init__(self, unit: np.ndarray) -> None:
        super().__init__()
        self.unit = unit


def leave_out_refits(fit: JointFit, plans: Sequence[MeasuredPlan], groups: Sequence[Collection[int]], *,
                     max_steps: int | None = None, verbose: int = 0) -> list[JointFit]:
    """Per group of indices into ``plans`` (those ``fit`` was fitted on), the fit redone without them:
    :func:`fit_constants` in ``fit``'s space, started from its point, to convergence or
    ``max_steps`` trust-region steps. The residuals and Jacobian at that start are taken once for
    every plan and shared; a group given twice is refitted once."""
    memo: dict[tuple[int, DeviceConstants], float] = {}
    fit_constants(plans, fit.space.names, start=fit.unit, space=fit.space, max_nfev=1, max_steps=max_steps,
                  memo=memo)
    refits: dict[frozenset[int], JointFit] = {}
    for group in map(frozenset, groups):
        if group not in refits:
            rest = [p for i, p in enumerate(plans) if i not in group]
            refits[group] = fit_constants(rest, fit.space.names, start=fit.unit, space=fit.space, max_steps=max_steps,
                                          verbose=verbose, memo=dict(memo))
    return [refits[frozenset(group)] for group in groups]


def fit_calibration(plans: Sequence[PlanRuns], *, fit: Sequence[str] = DEFAULT_FIT,
                    warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS) -> CalibrationFit:
    """Fit ``fit`` to the runs of ``plans`` (see the module doc)."""
    names = _fitted_names(fit)
    if not plans:
        raise ConfigError("calibrate: give at least one plan with its runs")
    device, stack, base = _common_calibration(plans)
    prepared = [_prepare(p, warmup_iterations) for p in plans]
    space = JointSpace(prepared, names)
    start = space.start(prepared)
    effects = space.effects(prepared, start)
    labels = [p.label for p in prepared]
    check_identifiable(effects, names, labels)
    fit = fit_constants(prepared, names, start=start, space=space)
    after = fit.constants(prepared[0])
    held = [i for i in range(len(prepared)) if unidentifiable(np.delete(effects, i, axis=0), names,
                                                              labels[:i] + labels[i + 1:]) is None]
    loo: list[float | None] = [None] * len(prepared)
    for i, refit in zip(held, leave_out_refits(fit, prepared, [[i] for i in held])):
        loo[i] = prepared[i].predict_ms(refit.constants(prepared[i]))
    runs = tuple(FittedRun(plan=p.label, logs=p.logs, measured_ms=p.measured_ms, before_ms=p.predict_ms(base.constants),
                           after_ms=p.predict_ms(after), leave_one_out_ms=held_out, informs=informs)
                 for p, held_out, informs in zip(prepared, loo, informed(effects, names)))
    return CalibrationFit(device=device, software_stack=stack, based_on=base.path or "the package's defaults",
                          fitted=names, ranges={n: constant_range(n, device) for n in names}, before=base.constants,
                          after=after, runs=runs)


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


def _prepare(plan: PlanRuns, warmup_iterations: int) -> MeasuredPlan:
    run = plan.run
    comparison = compare_run(estimate(run, profile_db=False), plan.logs, warmup_iterations=warmup_iterations)
    return measured_plan(plan.label, run, comparison.measured_iteration_time_ms, logs=comparison.runs)
