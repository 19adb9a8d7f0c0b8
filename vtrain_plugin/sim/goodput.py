"""Expected wall time of a run that fails, restarts from its last checkpoint and goes on.

The model is Daly's (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for
restart dumps", Future Generation Computer Systems 22, 2006): failures are a Poisson process of
mean time between failures ``M``; the run's failure-free compute ``T`` is cut into segments of
``tau`` compute, each followed by a checkpoint that stops training for ``delta``; a failure loses the
segment in progress and costs a restart ``R``, during which a failure restarts the restart. A
segment of ``L = tau + delta`` then takes ``M e^(R/M) (e^(L/M) - 1)`` on average (exact for this
process), and the run

    wall = M e^(R/M) (e^((tau + delta)/M) - 1) T / tau.

Split per segment, with ``a = e^(L/M) - 1`` failed attempts and ``b = e^(R/M) - 1`` failed
restarts per restart: the segment ``L``, lost work ``a M - L``, restarts ``a b M``, and ``a (1 + b)``
failures. :func:`simulate_run` draws the same process (a test checks the two agree), and the
cluster simulator draws failures from it.

The interval that minimises ``wall`` is Daly's higher-order estimate (:func:`daly_interval_s`),
which refines Young's ``sqrt(2 delta M)`` (J. W. Young, CACM 17, 1974).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vtrain_plugin.core.errors import ConfigError


def young_interval_s(stall_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: ``sqrt(2 delta M)``."""
    return math.sqrt(2.0 * stall_s * mtbf_s)


def daly_interval_s(stall_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum compute between checkpoints (his eq. 37):
    ``sqrt(2 delta M) [1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9] - delta`` for ``delta < 2M``,
    else ``M``."""
    if stall_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = stall_s / (2.0 * mtbf_s)
    return young_interval_s(stall_s, mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - stall_s


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpectedRun:
    """The expected wall time of a run and where it goes, in seconds (see the module doc)."""

    compute_s: float  # failure-free training
    checkpoint_s: float  # training stopped for the checkpoints of the segments that completed
    lost_s: float  # work (and checkpoint time) done since the last checkpoint when a failure hit
    restart_s: float  # restarts: detection, relaunch, model build, checkpoint load
    failures: float  # expected number of failures

    @property
    def wall_s(self) -> float:
        return self.compute_s + self.checkpoint_s + self.lost_s + self.restart_s

    @property
    def goodput(self) -> float:
        """The productive fraction of the wall time."""
        return self.compute_s / self.wall_s


def expected_run(*, compute_s: float, interval_s: float, stall_s: float, restart_s: float,
                 mtbf_s: float) -> ExpectedRun:
    """Daly's expected run (see the module doc) of ``compute_s`` in segments of ``interval_s``."""
    segments = compute_s / interval_s
    length = interval_s + stall_s
    try:
        failed_attempts = math.expm1(length / mtbf_s)
        failed_restarts = math.expm1(restart_s / mtbf_s)
    except OverflowError:
        failed_attempts = math.inf
    if not math.isfinite(failed_attempts * (1.0 + failed_restarts) * segments):
        raise ConfigError(f"a checkpoint every {length / 3600:.3g} h (with restarts of {restart_s / 3600:.3g} h) "
                          f"against one failure every {mtbf_s / 3600:.3g} h: the run would never finish")
    return ExpectedRun(
        compute_s=compute_s,
        checkpoint_s=segments * stall_s,
        lost_s=segments * (failed_attempts * mtbf_s - length),
        restart_s=segments * failed_attempts * failed_restarts * mtbf_s,
        failures=segments * failed_attempts * (1.0 + failed_restarts),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class SampledRun:
    wall_s: float
    failures: int


def simulate_run(rng: np.random.Generator, *, segments: int, interval_s: float, stall_s: float, restart_s: float,
                 mtbf_s: float) -> SampledRun:
    """One draw of the process of the module doc: ``segments`` segments of ``interval_s + stall_s``,
    each retried until no failure interrupts it, every failure followed by a restart of
    ``restart_s`` that is itself retried until no failure interrupts it."""
    length = interval_s + stall_s
    wall = 0.0
    failures = 0
    pending = segments
    while pending:
        times = rng.exponential(mtbf_s, size=pending)
        interrupted = times < length
        failed = int(interrupted.sum())
        wall += (pending - failed) * length + float(times[interrupted].sum())
        failures += failed
        restarting = failed
        while restarting:
            restarts = rng.exponential(mtbf_s, size=restarting)
            again = restarts < restart_s
            wall += (restarting - int(again.sum())) * restart_s + float(restarts[again].sum())
            restarting = int(again.sum())
            failures += restarting
        pending = failed
    return SampledRun(wall_s=wall, failures=failures)
