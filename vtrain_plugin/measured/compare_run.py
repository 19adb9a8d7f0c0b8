"""Predicted against measured for a run the user made: :func:`compare_run` reads the job's logs
(:mod:`vtrain_plugin.measured.logs`) and sets them beside an estimate of the same plan.

The measured iteration time is the median of the logged intervals after warm-up (the intervals
that begin within the first ``warmup_iterations`` iterations of each start of the job are left
out), pooled over every log given, with the 10th and 90th percentiles as its spread. Throughput and
MFU are counted with vtrain's model FLOPs and tokens over the measured time, so that both sides
count the same work (the log's own TFLOP/s, Megatron's FLOP count, is kept beside them). Memory is
compared like for like: the predicted peak allocated (the tensors, without the allowance) against
the largest ``max allocated`` any rank reported; the allowance (CUDA context, NCCL buffers,
workspaces, fragmentation) and the total it makes are stated beside it, with the largest ``max
reserved`` of the logs (the caching allocator's, which holds neither the context nor NCCL's
buffers, so not the total's measure). Intervals slower than ``slow_factor``
times the median are listed (checkpoints, evaluation, stragglers), and the drift is the median of
the last third of the intervals against the first third's.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.units import GIB
from vtrain_plugin.estimate import Estimate
from vtrain_plugin.measured.logs import LoggedInterval, RunLog, read_run_log

if TYPE_CHECKING:
    import pandas as pd

DEFAULT_WARMUP_ITERATIONS = 10
DEFAULT_SLOW_FACTOR = 1.2
_MIB_PER_GIB = GIB / (1024 * 1024)
_DRIFT_MIN_INTERVALS = 6


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowInterval:
    """A logged interval after warm-up slower than the comparison's ``slow_factor`` x median."""

    path: str
    first_iteration: int
    iteration: int
    iteration_time_ms: float
    times_median: float
    line: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RunComparison:
    """An estimate against the logs of the runs of its plan (see the module doc). Errors are signed,
    ``(predicted - measured) / measured``: positive means vtrain predicted too slow (or too much
    memory, or too much throughput)."""

    runs: tuple[str, ...]
    warmup_iterations: int
    slow_factor: float
    predicted_iteration_time_ms: float
    measured_iteration_time_ms: float  # median of the intervals after warm-up
    measured_p10_ms: float
    measured_p90_ms: float
    intervals_used: int
    iterations_used: int
    predicted_tokens_per_second: float | None
    measured_tokens_per_second: float | None
    predicted_tflops_per_gpu: float
    measured_tflops_per_gpu: float  # the model FLOPs (Megatron-LM's count) over the measured time
    logged_tflops_per_gpu: float | None  # median of the log's own figure (Megatron's FLOP count)
    predicted_mfu: float
    measured_mfu: float
    predicted_peak_allocated_gib: float  # the tensors of the stage that holds most (Estimate.peak_allocated_gib)
    measured_peak_allocated_gib: float | None  # the largest max allocated; None when no log reports memory
    predicted_allowance_gib: float  # of the stage that needs most in all: context, NCCL, workspaces, fragmentation
    predicted_peak_memory_gib: float  # that stage's allocated plus allowance (Estimate.peak_memory_gib)
    measured_peak_reserved_gib: float | None  # the largest max reserved; None when no log reports it
    slow: tuple[SlowInterval, ...]
    drift_pct: float | None  # None with fewer than six intervals after warm-up
    restarts: int
    truncated: tuple[str, ...]  # "path:line" of each incomplete last line left out
    skipped_iterations: int
    nan_iterations: int
    logs: tuple[RunLog, ...] = field(repr=False, compare=False)

    @property
    def iteration_time_error_pct(self) -> float:
        return _error(self.predicted_iteration_time_ms, self.measured_iteration_time_ms)

    @property
    def tokens_per_second_error_pct(self) -> float | None:
        return _error(self.predicted_tokens_per_second, self.measured_tokens_per_second)

    @property
    def tflops_per_gpu_error_pct(self) -> float:
        return _error(self.predicted_tflops_per_gpu, self.measured_tflops_per_gpu)

    @property
    def mfu_error_pct(self) -> float:
        return _error(self.predicted_mfu, self.measured_mfu)

    @property
    def peak_allocated_error_pct(self) -> float | None:
        return _error(self.predicted_peak_allocated_gib, self.measured_peak_allocated_gib)

    def quantities(self) -> list[tuple[str, float | None, float | None, float | None]]:
        """``(quantity, predicted, measured, error %)`` of each compared figure."""
        return [
            ("iteration_time_ms", self.predicted_iteration_time_ms, self.measured_iteration_time_ms,
             self.iteration_time_error_pct),
            ("tokens_per_second", self.predicted_tokens_per_second, self.measured_tokens_per_second,
             self.tokens_per_second_error_pct),
            ("tflops_per_gpu", self.predicted_tflops_per_gpu, self.measured_tflops_per_gpu,
             self.tflops_per_gpu_error_pct),
            ("mfu", self.predicted_mfu, self.measured_mfu, self.mfu_error_pct),
            ("peak_allocated_gib", self.predicted_peak_allocated_gib, self.measured_peak_allocated_gib,
             self.peak_allocated_error_pct),
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "runs": list(self.runs), "warmup_iterations": self.warmup_iterations, "slow_factor": self.slow_factor,
            **{f"{side}_{name}": value for name, predicted, measured, _ in self.quantities()
               for side, value in (("predicted", predicted), ("measured", measured))},
            **{f"{name}_error_pct": error for name, _, _, error in self.quantities()},
            "measured_p10_ms": self.measured_p10_ms, "measured_p90_ms": self.measured_p90_ms,
            "intervals_used": self.intervals_used, "iterations_used": self.iterations_used,
            "logged_tflops_per_gpu": self.logged_tflops_per_gpu, "drift_pct": self.drift_pct,
            "predicted_allowance_gib": self.predicted_allowance_gib,
            "predicted_peak_memory_gib": self.predicted_peak_memory_gib,
            "measured_peak_reserved_gib": self.measured_peak_reserved_gib,
            "restarts": self.restarts, "truncated": list(self.truncated),
            "skipped_iterations": self.skipped_iterations, "nan_iterations": self.nan_iterations,
            "slow": [{"path": s.path, "first_iteration": s.first_iteration, "iteration": s.iteration,
                      "iteration_time_ms": s.iteration_time_ms, "times_median": s.times_median, "line": s.line}
                     for s in self.slow],
        }

    def to_frame(self) -> pd.DataFrame:
        """One row per compared quantity: ``quantity, predicted, measured, error_pct``."""
        import pandas as pd  # here: a comparison needs none of it

        return pd.DataFrame(self.quantities(), columns=["quantity", "predicted", "measured", "error_pct"])


def _error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None:
        return None
    return 100.0 * (predicted - measured) / measured


def compare_run(estimate: Estimate, logs: str | os.PathLike | RunLog | Iterable[str | os.PathLike | RunLog], *,
                warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS,
                slow_factor: float = DEFAULT_SLOW_FACTOR) -> RunComparison:
    """Compare ``estimate`` with the runs of its plan: a log path (a Megatron-LM or NeMo log, or a
    Megatron-LM TensorBoard folder), a :class:`RunLog`, or several of them, pooled. A log whose GPU
    count or global batch differs from the estimate's is refused."""
    if isinstance(warmup_iterations, bool) or not isinstance(warmup_iterations, int) or warmup_iterations < 0:
        raise ConfigError(f"warmup_iterations must be a non-negative integer, got {warmup_iterations!r}")
    if not slow_factor > 1:
        raise ConfigError(f"slow_factor must be above 1, got {slow_factor!r}")
    items = [logs] if isinstance(logs, (str, os.PathLike, RunLog)) else list(logs)
    if not items:
        raise ConfigError("compare_run: give at least one log")
    parsed = tuple(item if isinstance(item, RunLog) else read_run_log(item) for item in items)
    used: list[tuple[RunLog, LoggedInterval]] = []
    for log in parsed:
        check_matches_plan(log, estimate)
        kept = after_warmup(log.intervals, warmup_iterations)
        if not kept:
            raise ConfigError(f"{log.path}: all {len(log.intervals)} logged intervals begin within the first "
                              f"{warmup_iterations} iterations of a start (warm-up): give a longer log or fewer "
                              f"warm-up iterations")
        used.extend((log, interval) for interval in kept)
    times = np.array([interval.iteration_time_ms for _, interval in used])
    median = float(np.median(times))
    ratio = estimate.iteration_time_ms / median  # measured quantities that scale with speed
    logged_tflops = [i.tflops_per_gpu for _, i in used if i.tflops_per_gpu is not None]
    peaks = [log.peak_memory_mib for log in parsed if log.peak_memory_mib is not None]
    reserved = [m.max_reserved_mib for log in parsed for m in log.memory if m.max_reserved_mib is not None]
    neediest = max(estimate.memory_gib, key=lambda m: m.total_gib)
    every = [i for log in parsed for i in log.intervals]
    return RunComparison(
        runs=tuple(log.path for log in parsed), warmup_iterations=warmup_iterations, slow_factor=slow_factor,
        predicted_iteration_time_ms=estimate.iteration_time_ms, measured_iteration_time_ms=median,
        measured_p10_ms=float(np.percentile(times, 10)), measured_p90_ms=float(np.percentile(times, 90)),
        intervals_used=len(used), iterations_used=sum(i.iterations for _, i in used),
        predicted_tokens_per_second=estimate.tokens_per_second,
        measured_tokens_per_second=None if estimate.tokens_per_second is None else estimate.tokens_per_second * ratio,
        predicted_tflops_per_gpu=estimate.tflops_per_gpu, measured_tflops_per_gpu=estimate.tflops_per_gpu * ratio,
        logged_tflops_per_gpu=statistics.median(logged_tflops) if logged_tflops else None,
        predicted_mfu=estimate.mfu, measured_mfu=estimate.mfu * ratio,
        predicted_peak_allocated_gib=estimate.peak_allocated_gib,
        measured_peak_allocated_gib=max(peaks) / _MIB_PER_GIB if peaks else None,
        predicted_allowance_gib=neediest.allowance_gib, predicted_peak_memory_gib=estimate.peak_memory_gib,
        measured_peak_reserved_gib=max(reserved) / _MIB_PER_GIB if reserved else None,
        slow=tuple(SlowInterval(path=log.path, first_iteration=i.first_iteration, iteration=i.iteration,
                                iteration_time_ms=i.iteration_time_ms, times_median=i.iteration_time_ms / median,
                                line=i.line)
                   for log, i in used if i.iteration_time_ms > slow_factor * median),
        drift_pct=_drift_pct([i.iteration_time_ms for _, i in used]),
        restarts=sum(len(log.restart_lines) for log in parsed),
        truncated=tuple(f"{log.path}:{log.truncated_line}" for log in parsed if log.truncated_line is not None),
        skipped_iterations=sum(i.skipped_iterations for i in every), nan_iterations=sum(i.nan_iterations for i in every),
        logs=parsed)


def check_matches_plan(log: RunLog, estimate: Estimate) -> None:
    """Refuse a log of another plan: its GPU count or a global batch other than the estimate's."""
    if log.world_size is not None and log.world_size != estimate.num_gpus:
        where = f"line {log.world_size_line}: " if log.world_size_line else ""
        raise ConfigError(f"{log.path}: {where}log says {log.world_size} GPUs, plan has {estimate.num_gpus}")
    for interval in log.intervals:
        if interval.global_batch_size is not None and interval.global_batch_size != estimate.global_batch_size:
            where = f"line {interval.line}" if interval.line else f"iteration {interval.iteration}"
            raise ConfigError(f"{log.path}: {where}: log says global batch size {interval.global_batch_size}, "
                              f"plan has {estimate.global_batch_size}")


def after_warmup(intervals: Sequence[LoggedInterval], warmup_iterations: int) -> list[LoggedInterval]:
    """The intervals that begin at least ``warmup_iterations`` iterations after the start of their
    segment (the first iteration its first interval covers)."""
    starts: dict[int, int] = {}
    for interval in intervals:
        starts.setdefault(interval.segment, interval.first_iteration)
    return [i for i in intervals if i.first_iteration - starts[i.segment] >= warmup_iterations]


def _drift_pct(times_ms: Sequence[float]) -> float | None:
    if len(times_ms) < _DRIFT_MIN_INTERVALS:
        return None
    third = len(times_ms) // 3
    return 100.0 * (statistics.median(times_ms[-third:]) / statistics.median(times_ms[:third]) - 1.0)
