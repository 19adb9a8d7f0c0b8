"""The machine a job runs on: GPUs per node and the two link tiers (NVLink/NVSwitch, network).

A node is what a launch counts (a DGX, an NVL72 compute tray); the NVLink tier spans a node, or a
rack of nodes where NVLink switches join them (``nvlink_domain_gpus``: GB200 / GB300 NVL72).

Bandwidths are given the way vendors quote them (intra-node in GB/s per GPU and direction,
inter-node in Gbit/s per node, summed over the node's NICs) and converted to bytes per nanosecond
once, by the properties below, for the communication model. The number of nodes is not a field: it
follows from the plan's world size. Named clusters (DGX A100, ...) are data files of
:mod:`vtrain_plugin.hardware.clusters`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.units import NS_PER_US, gbps_to_bytes_per_ns, gbytes_per_s_to_bytes_per_ns
from vtrain_plugin.specs import limits


class GpuArchitecture(StrEnum):
    """The generation of a device (a spec-sheet fact, ``DeviceSpec.architecture``): which software a
    plan runs by default depends on it (``TrainingSpec.stack_for``)."""

    CPU = "cpu"  # the local CPU as a training device (validation)
    AMPERE = "ampere"  # A100
    HOPPER = "hopper"  # H100, H200
    BLACKWELL = "blackwell"  # B200, GB200, GB300


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec:
    gpu: str  # device preset name, e.g. "a100-sxm4-80gb" (vtrain_plugin.hardware.devices)
    gpus_per_node: int = 8
    # GPUs that share one NVLink domain: a multiple of gpus_per_node (GB200 NVL72: 72 GPUs on NVLink
    # switches, in compute trays of 4, a tray being the node a launch counts); None: the node.
    nvlink_domain_gpus: int | None = None
    intra_node_bandwidth_gbytes_per_s: float  # per GPU and direction (NVLink/NVSwitch)
    intra_node_latency_us: float
    inter_node_bandwidth_gbps: float  # per node, all NICs together (e.g. 8 x 200 Gb/s = 1600)
    inter_node_latency_us: float
    # Fraction of the nominal network bandwidth NCCL reaches between nodes, in (0, 1]; None: the
    # value calibrated for the GPU and software stack (vtrain_plugin.hardware.calibration), else 1.
    network_efficiency: float | None = None
    # The node's CPU memory bandwidth, all sockets (channels x transfer rate, datasheet): what the
    # node's GPUs share when they copy to and from host memory at once. None: not a limit (unknown, or
    # the host link is the bound).
    host_memory_bandwidth_gbytes_per_s: float | None = None
    price_per_gpu_hour_usd: float | None = None  # None: cost unknown
    nccl_tables: str | None = None  # measured intra-node NCCL table set, e.g. "a100_sxm"
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.gpu, str) or not self.gpu:
            raise ConfigError(f"cluster.gpu must be a non-empty device preset name, got {v.show(self.gpu)}")
        limits.GPUS_PER_NODE.positive_int("cluster.gpus_per_node", self.gpus_per_node)
        if self.nvlink_domain_gpus is not None:
            limits.GPUS_PER_NODE.positive_int("cluster.nvlink_domain_gpus", self.nvlink_domain_gpus)
            if self.nvlink_domain_gpus % self.gpus_per_node:
                raise ConfigError(f"cluster.nvlink_domain_gpus ({self.nvlink_domain_gpus}) must be a multiple of "
                                  f"cluster.gpus_per_node ({self.gpus_per_node}): a node lies in one NVLink domain")
        limits.INTRA_NODE_BANDWIDTH.positive_number("cluster.intra_node_bandwidth_gbytes_per_s",
                                                    self.intra_node_bandwidth_gbytes_per_s)
        limits.INTER_NODE_BANDWIDTH.positive_number("cluster.inter_node_bandwidth_gbps", self.inter_node_bandwidth_gbps)
        for name in ("intra_node_latency_us", "inter_node_latency_us"):
            limits.LATENCY_US.non_negative_number(f"cluster.{name}", getattr(self, name))
        if self.network_efficiency is not None:
            limits.NETWORK_EFFICIENCY.positive_number("cluster.network_efficiency", self.network_efficiency)
        if self.host_memory_bandwidth_gbytes_per_s is not None:
            limits.HOST_MEMORY_BANDWIDTH.positive_number("cluster.host_memory_bandwidth_gbytes_per_s",
                                                         self.host_memory_bandwidth_gbytes_per_s)
        if self.price_per_gpu_hour_usd is not None:
            limits.PRICE_PER_GPU_HOUR.non_negative_number("cluster.price_per_gpu_hour_usd",
                                                          self.price_per_gpu_hour_usd)
        if self.nccl_tables is not None and not isinstance(self.nccl_tables, str):
            raise ConfigError(f"cluster.nccl_tables must be a table set name, got {v.show(self.nccl_tables)}")
        v.string("cluster.name", self.name)

    @property
    def gpus_per_nvlink_domain(self) -> int:
        """GPUs that reach each other over NVLink: the communication model's unit of placement."""
        return self.nvlink_domain_gpus or self.gpus_per_node

    @property
    def intra_node_bytes_per_ns(self) -> float:
        return gbytes_per_s_to_bytes_per_ns(self.intra_node_bandwidth_gbytes_per_s)

    @property
    def inter_node_bytes_per_ns(self) -> float:
        """Network bandwidth of one node (all NICs), bytes per nanosecond."""
        return gbps_to_bytes_per_ns(self.inter_node_bandwidth_gbps)

    @property
    def intra_node_latency_ns(self) -> float:
        return self.intra_node_latency_us * NS_PER_US

    @property
    def inter_node_latency_ns(self) -> float:
        return self.inter_node_latency_us * NS_PER_US

    def host_copy_gbytes_per_s(self, host_link_gbytes_per_s: float) -> float:
        """Per GPU and direction, the rate of copies to and from host memory while every GPU of the
        node copies both ways at once (activation offloading): the host link, or the GPU's share of
        the node's memory bandwidth where that is lower."""
        if self.host_memory_bandwidth_gbytes_per_s is None:
            return host_link_gbytes_per_s
        return min(host_link_gbytes_per_s, self.host_memory_bandwidth_gbytes_per_s / (2 * self.gpus_per_node))

    def num_nodes(self, world_size: int) -> int:
        v.positive_int("world_size", world_size)
        return -(-world_size // self.gpus_per_node)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
