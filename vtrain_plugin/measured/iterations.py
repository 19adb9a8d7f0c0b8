"""Predicted against measured for iterations timed in the user's own training loop.

:func:`compare_iterations` sets an estimate (or a predicted time) beside measured iteration times
(their median); :class:`IterationRecorder` times the iterations of a loop::

    recorder = IterationRecorder(warmup=2, synchronize=torch.cuda.synchronize)
    for batch in data:
        with recorder:
            train_step(batch)
    print(recorder.compare(est).error_pct)

The logs of a finished run are compared by :func:`~vtrain_plugin.measured.compare_run.compare_run`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.estimate import Estimate


@dataclass(frozen=True, slots=True, kw_only=True)
class IterationComparison:
    predicted_ms: float
    measured_ms: float  # median of the measured iterations
    measured_iterations_ms: tuple[float, ...]

    @property
    def error_pct(self) -> float:
        """Signed error of the prediction relative to the measurement: positive = predicted too slow."""
        return 100.0 * (self.predicted_ms - self.measured_ms) / self.measured_ms

    def to_dict(self) -> dict[str, Any]:
        return {"predicted_ms": self.predicted_ms, "measured_ms": self.measured_ms, "error_pct": self.error_pct,
                "measured_iterations_ms": list(self.measured_iterations_ms)}


def compare_iterations(predicted: Estimate | float, measured_ms: Sequence[float]) -> IterationComparison:
    """Compare an estimate (or a predicted time in ms) with measured iteration times in ms (median)."""
    samples = tuple(float(ms) for ms in measured_ms)
    if not samples:
        raise ConfigError("compare_iterations: measured_ms must hold at least one iteration time")
    if any(not ms > 0 for ms in samples):
        raise ConfigError(f"compare_iterations: measured iteration times must be positive, got {min(samples)}")
    predicted_ms = predicted.iteration_time_ms if isinstance(predicted, Estimate) else float(predicted)
    return IterationComparison(predicted_ms=predicted_ms, measured_ms=statistics.median(samples),
                      measured_iterations_ms=samples)


class IterationRecorder:
    """Times iterations of a training loop: ``with recorder: step()`` per iteration, or :meth:`record`.

    The first ``warmup`` iterations are recorded but left out of :attr:`samples_ms`.
    ``synchronize`` (e.g. ``torch.cuda.synchronize``) is called before the clock starts and
    before it stops, so asynchronous device work is counted in its iteration.
    """

    def __init__(self, *, warmup: int = 1, synchronize: Callable[[], None] | None = None) -> None:
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ConfigError(f"IterationRecorder warmup must be a non-negative integer, got {warmup!r}")
        self.warmup = warmup
        self._synchronize = synchronize
        self._all_ms: list[float] = []
        self._start_ns: int | None = None

    def __enter__(self) -> IterationRecorder:
        if self._synchronize is not None:
            self._synchronize()
        self._start_ns = time.perf_counter_ns()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self._synchronize is not None and exc_type is None:
            self._synchronize()
        start, self._start_ns = self._start_ns, None
        if exc_type is None and start is not None:
            self.record((time.perf_counter_ns() - start) / 1e6)

    def record(self, ms: float) -> None:
        """Add one iteration that took ``ms`` milliseconds (timed by the caller)."""
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not ms > 0:
            raise ConfigError(f"iteration time must be a positive number of ms, got {ms!r}")
        self._all_ms.append(float(ms))

    @property
    def samples_ms(self) -> tuple[float, ...]:
        return tuple(self._all_ms[self.warmup:])

    def compare(self, predicted: Estimate | float) -> IterationComparison:
        if not self.samples_ms:
            raise ConfigError(f"IterationRecorder has {len(self._all_ms)} iterations, none after the "
                              f"{self.warmup} warm-up ones")
        return compare_iterations(predicted, self.samples_ms)
