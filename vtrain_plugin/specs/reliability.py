"""How often a training job is interrupted, what a restart costs and how checkpoints are written:
the inputs of the goodput model (:mod:`vtrain_plugin.sim.goodput`), a plan file's ``reliability``
section.

Failures are a Poisson process of ``failure_rate_per_gpu_hour`` per GPU: a job of N GPUs is
interrupted every ``1 / (N x rate)`` hours on average, whatever failed (a GPU, a NIC, a host, the
software), since any of them stops a synchronous job. The presets are published rates:

- ``large-scale`` (the default): the Llama 3 405B pre-training, 419 unexpected interruptions in 54
  days on 16,384 H100 (Meta, "The Llama 3 Herd of Models", 2024, section 3.3.4 and Table 5): one
  every 3.1 hours, 1.97e-5 per GPU-hour, 78% of them hardware.
- ``reliable``: the same run's hardware-attributed interruptions only (78% of 419): a cluster whose
  software never stops the job itself, 1.54e-5 per GPU-hour.
- ``typical``: the BLOOM-176B training (BigScience, 2022; 48 nodes of 8 A100 on Jean Zay), whose
  public training chronicle reports 1 to 2 GPU failures a week: 1.5 a week on 384 GPUs is 2.33e-5
  per GPU-hour, GPU failures only, so a lower bound for all of that cluster's interruptions.

A restart is ``restart_minutes`` (detecting the failure, requeueing, starting the processes and
building the model) plus loading the last checkpoint at the storage's read bandwidth. The default,
10 minutes, is an assumption, not a measurement: a hang is seen only when the NCCL watchdog fires
(Megatron-LM's ``--distributed-timeout-minutes`` defaults to 10), a crash at once; set it from your
cluster's logs.

Storage bandwidth bounds checkpoint writes and loads twice: each node's link to the file system
(default 25 GB/s, the line rate of one 200 Gbit/s storage NIC, as on a DGX A100) and the file
system's total (default 2,000 GB/s, the sustained throughput of the Tectonic file system Llama 3
was trained with, same report, section 3.3.1).

``checkpoint``: ``sync`` (Megatron-LM's default) stops training for the whole write; ``async``
(Megatron-Core's ``--async-save``) stops it only to copy each GPU's shard to host memory, and the
file system write runs in the background. ``checkpoint_interval_iterations`` (Megatron-LM's
``--save-interval``): None picks the interval that minimises the expected wall time (Daly 2006); one
longer than the run is clamped to the run's length, and the estimate says so (``interval_clamped_from``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.units import SECONDS_PER_MINUTE
from vtrain_plugin.specs import limits


class FailurePreset(StrEnum):
    RELIABLE = "reliable"
    TYPICAL = "typical"
    LARGE_SCALE = "large-scale"


class CheckpointMode(StrEnum):
    SYNC = "sync"  # training waits for the whole write (Megatron-LM's default)
    ASYNC = "async"  # training waits for the copy to host memory only (--async-save)


_LLAMA3_GPU_HOURS = 16_384 * 54 * 24
FAILURE_RATES_PER_GPU_HOUR: dict[FailurePreset, float] = {
    FailurePreset.LARGE_SCALE: 419 / _LLAMA3_GPU_HOURS,
    FailurePreset.RELIABLE: 0.78 * 419 / _LLAMA3_GPU_HOURS,
    FailurePreset.TYPICAL: 1.5 / (384 * 7 * 24),
}
DEFAULT_RESTART_MINUTES = 10.0
DEFAULT_STORAGE_GBYTES_PER_S_PER_NODE = 25.0  # one 200 Gbit/s storage NIC
DEFAULT_STORAGE_GBYTES_PER_S_TOTAL = 2_000.0  # Llama 3's Tectonic, sustained


@dataclass(frozen=True, slots=True, kw_only=True)
class ReliabilitySpec:
    """Failures, restarts and checkpoints of a run (see the module doc); ``failure_rate_per_gpu_hour``
    None takes the ``failures`` preset's rate."""

    failures: FailurePreset = FailurePreset.LARGE_SCALE
    failure_rate_per_gpu_hour: float | None = None
    restart_minutes: float = DEFAULT_RESTART_MINUTES
    checkpoint: CheckpointMode = CheckpointMode.SYNC
    checkpoint_interval_iterations: int | None = None
    storage_write_gbytes_per_s_per_node: float = DEFAULT_STORAGE_GBYTES_PER_S_PER_NODE
    storage_write_gbytes_per_s_total: float = DEFAULT_STORAGE_GBYTES_PER_S_TOTAL
    storage_read_gbytes_per_s_per_node: float = DEFAULT_STORAGE_GBYTES_PER_S_PER_NODE
    storage_read_gbytes_per_s_total: float = DEFAULT_STORAGE_GBYTES_PER_S_TOTAL

    def __post_init__(self) -> None:
        object.__setattr__(self, "failures", FailurePreset(
            v.one_of("reliability.failures", self.failures, [p.value for p in FailurePreset])))
        if self.failure_rate_per_gpu_hour is not None:
            limits.FAILURE_RATE.positive_number("reliability.failure_rate_per_gpu_hour",
                                                self.failure_rate_per_gpu_hour)
        limits.RESTART_MINUTES.non_negative_number("reliability.restart_minutes", self.restart_minutes)
        object.__setattr__(self, "checkpoint", CheckpointMode(
            v.one_of("reliability.checkpoint", self.checkpoint, [m.value for m in CheckpointMode])))
        if self.checkpoint_interval_iterations is not None:
            limits.CHECKPOINT_INTERVAL.positive_int("reliability.checkpoint_interval_iterations",
                                                    self.checkpoint_interval_iterations)
        for name in ("storage_write_gbytes_per_s_per_node", "storage_write_gbytes_per_s_total",
                     "storage_read_gbytes_per_s_per_node", "storage_read_gbytes_per_s_total"):
            limits.STORAGE_BANDWIDTH.positive_number(f"reliability.{name}", getattr(self, name))

    @property
    def rate_per_gpu_hour(self) -> float:
        if self.failure_rate_per_gpu_hour is not None:
            return self.failure_rate_per_gpu_hour
        return FAILURE_RATES_PER_GPU_HOUR[self.failures]

    def mean_hours_between_failures(self, num_gpus: int) -> float:
        """Of a job of ``num_gpus`` GPUs: any GPU's failure stops it."""
        return 1.0 / (self.rate_per_gpu_hour * v.positive_int("num_gpus", num_gpus))

    @property
    def restart_s(self) -> float:
        return self.restart_minutes * SECONDS_PER_MINUTE
