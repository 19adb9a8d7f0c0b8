"""The shared cluster a simulation schedules: a node type (:class:`ClusterSpec`), how many nodes,
and the unit GPUs are handed out in."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from vtrain_plugin.core import checks as v
from vtrain_plugin.specs.cluster import ClusterSpec


class Granularity(StrEnum):
    NODE = "node"  # whole nodes: a job never shares a node (the default)
    GPU = "gpu"  # any GPU count


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterConfig:
    spec: ClusterSpec  # one node: GPU, GPUs per node, links, price
    nodes: int
    granularity: Granularity = Granularity.NODE

    def __post_init__(self) -> None:
        v.positive_int("nodes", self.nodes)
        object.__setattr__(self, "granularity", Granularity(
            v.one_of("granularity", str(self.granularity), [g.value for g in Granularity])))

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.spec.gpus_per_node

    @property
    def unit_gpus(self) -> int:
        """The allocation unit: a node's GPUs, or one GPU."""
        return self.spec.gpus_per_node if self.granularity is Granularity.NODE else 1

    @property
    def allocatable_counts(self) -> tuple[int, ...]:
        """Every GPU count a job may receive: the multiples of the unit up to the whole cluster."""
        return tuple(range(self.unit_gpus, self.total_gpus + 1, self.unit_gpus))

    @property
    def price_per_gpu_hour_usd(self) -> float | None:
        return self.spec.price_per_gpu_hour_usd

    def describe(self) -> str:
        return (f"{self.nodes} x {self.spec.gpus_per_node} {self.spec.gpu} ({self.total_gpus} GPUs, "
                f"allocated by {self.granularity.value})")
