"""Failures of the jobs of a cluster simulation (``vtrain cluster-sim --failures``).

Each allocation of a job draws its next failure from the process of
:mod:`vtrain_plugin.sim.goodput`: exponential, at ``gpus x failure_rate_per_gpu_hour``, memoryless,
so a draw per allocation is exact. A job checkpoints at Daly's interval for its allocation (its
checkpoint's write time on the nodes it holds, :mod:`vtrain_plugin.cost.checkpoint`, against its
mean time between failures); the checkpoint stalls slow its progress by ``(interval + stall) /
interval``. A failure throws away the work since the last checkpoint and restarts the job in place,
on the same GPUs, at the simulation's restart cost. Draws come from one seeded generator per
simulation, so a run is reproducible and the policies compared on the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vtrain_plugin.core.units import SECONDS_PER_HOUR
from vtrain_plugin.cost.checkpoint import checkpoint_times, model_checkpoint_size
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.sim.goodput import daly_interval_s
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.reliability import ReliabilitySpec


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpointing:
    """A job's checkpoints on one allocation (seconds)."""

    mtbf_s: float
    interval_s: float  # productive time between checkpoints
    stall_s: float  # training stopped per checkpoint

    @property
    def stretch(self) -> float:
        """Wall time per productive second."""
        return (self.interval_s + self.stall_s) / self.interval_s


@dataclass(frozen=True, slots=True, kw_only=True)
class FailureModel:
    reliability: ReliabilitySpec
    seed: int = 0

    def generator(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)

    def checkpointing(self, model: ModelSpec, *, gpus: int, gpus_per_node: int, gpu: str) -> Checkpointing:
        times = checkpoint_times(model_checkpoint_size(model, tensor_parallel=1), self.reliability, num_gpus=gpus,
                                 gpus_per_node=gpus_per_node,
                                 host_link_gbytes_per_s=get_device(gpu).host_copy_gbytes_per_s)
        mode = self.reliability.checkpoint
        mtbf_s = self.reliability.mean_hours_between_failures(gpus) * SECONDS_PER_HOUR
        interval_s = max(daly_interval_s(times.stall_s(mode), mtbf_s), times.shortest_interval_s(mode))
        return Checkpointing(mtbf_s=mtbf_s, interval_s=interval_s, stall_s=times.stall_at_interval_s(mode, interval_s))
