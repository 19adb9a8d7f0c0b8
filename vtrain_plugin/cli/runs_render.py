"""Human renderings of ``vtrain compare`` and ``vtrain calibrate``."""

from __future__ import annotations

from collections.abc import Sequence

from vtrain_plugin.cli.render import render_table
from vtrain_plugin.measured.calibrate import CalibrationFit
from vtrain_plugin.measured.compare_run import RunComparison

_LABELS = {"iteration_time_ms": ("iteration ms", "{:,.1f}"), "tokens_per_second": ("tokens/s", "{:,.0f}"),
           "tflops_per_gpu": ("TFLOP/s per GPU", "{:,.1f}"), "mfu": ("MFU", "{:.1%}"),
           "peak_allocated_gib": ("peak allocated GiB", "{:,.2f}"), "memory_gib": ("GiB", "{:,.2f}")}


def _value(name: str, value: float | None) -> str:
    return "n/a" if value is None else _LABELS[name][1].format(value)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1f}%"


def comparison_table(plan: str, c: RunComparison) -> str:
    """One plan against its runs: the compared figures, the spread, drift and the slow intervals."""
    notes = [f"{c.restarts} restart{'s' * (c.restarts != 1)}" if c.restarts else "",
             f"incomplete last line left out ({', '.join(c.truncated)})" if c.truncated else ""]
    lines = [f"{plan} against {len(c.runs)} run{'s' * (len(c.runs) != 1)} ({', '.join(c.runs)}): median of "
             f"{c.intervals_used} logged intervals ({c.iterations_used:,} iterations) after {c.warmup_iterations} "
             f"warm-up iterations of each start" + "".join(f"; {n}" for n in notes if n), ""]
    rows = [[_LABELS[name][0], _value(name, predicted), _value(name, measured), _pct(error)]
            for name, predicted, measured, error in c.quantities()]
    lines.append(render_table(rows, ["quantity", "predicted", "measured", "error"]))
    lines.append("")
    drift = "n/a (fewer than 6 intervals)" if c.drift_pct is None else f"{c.drift_pct:+.1f}% (median of the last third " \
                                                                     f"of the intervals against the first third)"
    lines.append(f"measured iteration: median {c.measured_iteration_time_ms:,.1f} ms, p10-p90 "
                 f"{c.measured_p10_ms:,.1f}-{c.measured_p90_ms:,.1f} ms; drift {drift}")
    reserved = "" if c.measured_peak_reserved_gib is None else \
        f"; the logs' max reserved {c.measured_peak_reserved_gib:,.2f} GiB (the allocator's, without context or NCCL)"
    lines.append(f"memory: peak allocated as Megatron's max allocated counts it; with the predicted allowance "
                 f"{c.predicted_allowance_gib:,.2f} GiB (context, NCCL buffers, cuDNN and scratch buffers, fragmentation; the cuBLAS workspaces count in allocated) the GPU "
                 f"needs {c.predicted_peak_memory_gib:,.2f} GiB{reserved}")
    if c.logged_tflops_per_gpu is not None:
        lines.append(f"the log's own throughput: {c.logged_tflops_per_gpu:,.1f} TFLOP/s per GPU (median; "
                     f"the FLOP count of the measured figures above, Megatron-LM's own)")
    if c.skipped_iterations or c.nan_iterations:
        lines.append(f"skipped iterations {c.skipped_iterations}, NaN iterations {c.nan_iterations}")
    if c.slow:
        lines.append(f"slow intervals (> {c.slow_factor:g} x median): " + ", ".join(
            f"iterations {s.first_iteration}-{s.iteration} {s.iteration_time_ms:,.1f} ms ({s.times_median:.2f} x"
            + (f", {s.path}:{s.line}" if s.line else f", {s.path}") + ")" for s in c.slow))
    else:
        lines.append(f"slow intervals (> {c.slow_factor:g} x median): none")
    return "\n".join(lines)


def comparisons_summary(results: Sequence[tuple[str, RunComparison]]) -> str:
    """Several plans, one row each."""
    rows = [[plan, str(len(c.runs)), str(c.intervals_used), _value("iteration_time_ms", c.predicted_iteration_time_ms),
             _value("iteration_time_ms", c.measured_iteration_time_ms), _pct(c.iteration_time_error_pct),
             _value("mfu", c.predicted_mfu), _value("mfu", c.measured_mfu),
             _value("memory_gib", c.predicted_peak_allocated_gib), _value("memory_gib", c.measured_peak_allocated_gib),
             _pct(c.peak_allocated_error_pct),
             "n/a" if c.drift_pct is None else f"{c.drift_pct:+.1f}%", str(len(c.slow))]
            for plan, c in results]
    return render_table(rows, ["plan", "runs", "intervals", "predicted ms", "measured ms", "error", "predicted MFU",
                               "measured MFU", "predicted allocated GiB", "max allocated GiB", "memory error",
                               "drift", "slow"])


def calibration_table(fit: CalibrationFit) -> str:
    """The fitted constants, each run's error before, after and left out, and the mean errors."""
    lines = [f"{fit.device} {fit.software_stack}: {', '.join(fit.fitted)} fitted to {len(fit.runs)} plan"
             f"{'s' * (len(fit.runs) != 1)} (other constants from {fit.based_on})", ""]
    rows = [[name, f"{getattr(fit.before, name):.4g}", f"{getattr(fit.after, name):.4g}",
             f"[{fit.ranges[name][0]:g}, {fit.ranges[name][1]:g}]"] for name in fit.fitted]
    lines += [render_table(rows, ["constant", "before", "fitted", "range searched"]), ""]
    rows = [[r.plan, str(len(r.logs)), f"{r.measured_ms:,.1f}", f"{r.before_ms:,.1f}", _pct(r.error_pct(r.before_ms)),
             f"{r.after_ms:,.1f}", _pct(r.error_pct(r.after_ms)),
             "n/a" if r.leave_one_out_ms is None else f"{r.leave_one_out_ms:,.1f}",
             _pct(r.error_pct(r.leave_one_out_ms)), ", ".join(r.informs)] for r in fit.runs]
    lines += [render_table(rows, ["plan", "runs", "measured ms", "before ms", "error", "fitted ms", "error",
                                  "left out ms", "error", "informs"]), ""]
    loo = fit.leave_one_out_error_pct
    lines.append(f"mean absolute error: before {fit.error_before_pct:.2f}%, fitted {fit.error_after_pct:.2f}%, "
                 f"leave-one-out " + ("n/a (no plan can be left out: the others would not identify the constants)"
                                      if loo is None else f"{loo:.2f}%"))
    return "\n".join(lines)
