"""The whole run: iterations times the iteration, then what failures, restarts and checkpoints add
(:mod:`vtrain_plugin.sim.goodput`), in days, GPU-hours and dollars."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vtrain_plugin.core.units import SECONDS_PER_DAY, SECONDS_PER_HOUR
from vtrain_plugin.cost.checkpoint import CheckpointSize, CheckpointTimes, checkpoint_times
from vtrain_plugin.sim.goodput import ExpectedRun, daly_interval_s, expected_run
from vtrain_plugin.specs.reliability import CheckpointMode, ReliabilitySpec


@dataclass(frozen=True, slots=True, kw_only=True)
class Failures:
    """What failures cost a run: the checkpoint interval used, its checkpoints' times and the
    expected run (seconds)."""

    reliability: ReliabilitySpec
    mtbf_hours: float  # of the job: one failure every so many hours
    checkpoint_nbytes: int
    checkpoint: CheckpointTimes
    interval_iterations: int
    interval_chosen: bool  # True: Daly's optimum, rounded to whole iterations; False: given
    # A given interval longer than the run (e.g. a launch script's --save-interval with a short
    # --tokens): what was given; the interval used is then the run's length (one checkpoint, at its end).
    interval_clamped_from: int | None = None
    stall_s: float  # training stopped per checkpoint
    restart_s: float  # per restart: relaunch and checkpoint load
    run: ExpectedRun

    def to_dict(self) -> dict[str, Any]:
        return {
            "failures": self.reliability.failures.value,
            "failure_rate_per_gpu_hour": self.reliability.rate_per_gpu_hour,
            "mtbf_hours": self.mtbf_hours,
            "checkpoint": self.reliability.checkpoint.value,
            "checkpoint_nbytes": self.checkpoint_nbytes,
            "checkpoint_write_s": self.checkpoint.write_s,
            "checkpoint_load_s": self.checkpoint.load_s,
            "checkpoint_stall_s": self.stall_s,
            "checkpoint_interval_iterations": self.interval_iterations,
            "checkpoint_interval_chosen": self.interval_chosen,
            "checkpoint_interval_clamped_from": self.interval_clamped_from,
            "restart_s": self.restart_s,
            "expected_failures": self.run.failures,
            "breakdown_hours": {
                "compute": self.run.compute_s / SECONDS_PER_HOUR,
                "checkpoint_stalls": self.run.checkpoint_s / SECONDS_PER_HOUR,
                "lost_work": self.run.lost_s / SECONDS_PER_HOUR,
                "restarts": self.run.restart_s / SECONDS_PER_HOUR,
            },
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainTotals:
    """Time and cost to train ``tokens``: failure-free (``ideal_*``) and expected with failures
    (``days``, ``gpu_hours``, ``cost_usd``; equal to the ideal ones when ``failures`` is None)."""

    tokens: float
    iterations: int
    num_gpus: int
    ideal_days: float
    ideal_gpu_hours: float
    ideal_cost_usd: float | None
    failures: Failures | None

    @property
    def wall_s(self) -> float:
        return self.ideal_days * SECONDS_PER_DAY if self.failures is None else self.failures.run.wall_s

    @property
    def days(self) -> float:
        return self.wall_s / SECONDS_PER_DAY

    @property
    def gpu_hours(self) -> float:
        return self.wall_s * self.num_gpus / SECONDS_PER_HOUR

    @property
    def cost_usd(self) -> float | None:
        if self.ideal_cost_usd is None:
            return None
        return self.ideal_cost_usd * self.gpu_hours / self.ideal_gpu_hours

    @property
    def goodput(self) -> float:
        return 1.0 if self.failures is None else self.failures.run.goodput

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "iterations": self.iterations, "ideal_days": self.ideal_days,
                "ideal_gpu_hours": self.ideal_gpu_hours, "ideal_cost_usd": self.ideal_cost_usd,
                "days": self.days, "gpu_hours": self.gpu_hours, "cost_usd": self.cost_usd, "goodput": self.goodput,
                "failures": None if self.failures is None else self.failures.to_dict()}


def train_totals(*, tokens: float, iterations: int, iteration_s: float, num_gpus: int, gpus_per_node: int,
                 price_per_gpu_hour_usd: float | None, checkpoint_size: CheckpointSize,
                 host_link_gbytes_per_s: float, reliability: ReliabilitySpec | None) -> TrainTotals:
    """The run of ``iterations`` iterations of ``iteration_s`` on ``num_gpus`` GPUs, with the
    failures, restarts and checkpoints of ``reliability`` (None: failure-free only)."""
    compute_s = iterations * iteration_s
    gpu_hours = compute_s * num_gpus / SECONDS_PER_HOUR
    failures = None
    if reliability is not None:
        failures = _failures(reliability, compute_s=compute_s, iterations=iterations, iteration_s=iteration_s,
                             num_gpus=num_gpus, gpus_per_node=gpus_per_node, size=checkpoint_size,
                             host_link_gbytes_per_s=host_link_gbytes_per_s)
    return TrainTotals(tokens=tokens, iterations=iterations, num_gpus=num_gpus, ideal_days=compute_s / SECONDS_PER_DAY,
                       ideal_gpu_hours=gpu_hours,
                       ideal_cost_usd=None if price_per_gpu_hour_usd is None else gpu_hours * price_per_gpu_hour_usd,
                       failures=failures)


def _failures(reliability: ReliabilitySpec, *, compute_s: float, iterations: int, iteration_s: float, num_gpus: int,
              gpus_per_node: int, size: CheckpointSize, host_link_gbytes_per_s: float) -> Failures:
    times = checkpoint_times(size, reliability, num_gpus=num_gpus, gpus_per_node=gpus_per_node,
                             host_link_gbytes_per_s=host_link_gbytes_per_s)
    mtbf_s = reliability.mean_hours_between_failures(num_gpus) * SECONDS_PER_HOUR
    restart_s = reliability.restart_s + times.load_s
    interval = reliability.checkpoint_interval_iterations
    chosen = interval is None
    clamped_from = None
    if interval is not None and interval > iterations:
        clamped_from, interval = interval, iterations
    if chosen:
        interval = choose_interval(times, reliability.checkpoint, mtbf_s=mtbf_s, iteration_s=iteration_s,
                                   iterations=iterations)
    stall_s = times.stall_at_interval_s(reliability.checkpoint, interval * iteration_s)
    run = expected_run(compute_s=compute_s, interval_s=interval * iteration_s, stall_s=stall_s,
                       restart_s=restart_s, mtbf_s=mtbf_s)
    return Failures(reliability=reliability, mtbf_hours=mtbf_s / SECONDS_PER_HOUR,
                    checkpoint_nbytes=size.total_nbytes, checkpoint=times, interval_iterations=interval,
                    interval_chosen=chosen, interval_clamped_from=clamped_from, stall_s=stall_s, restart_s=restart_s, run=run)


def choose_interval(times: CheckpointTimes, mode: CheckpointMode, *, mtbf_s: float, iteration_s: float,
                    iterations: int) -> int:
    """Daly's optimum interval in whole iterations, no shorter than
    :meth:`~CheckpointTimes.shortest_interval_s` (at least one iteration, at most the run)."""
    interval = max(round(daly_interval_s(times.stall_s(mode), mtbf_s) / iteration_s),
                   math.ceil(times.shortest_interval_s(mode) / iteration_s))
    return min(iterations, max(1, interval))

