"""The machine a job runs on: GPUs per node and the two link tiers (NVLink/NVSwitch, network).

Bandwidths are given the way vendors quote them (intra-node in GB/s per GPU and direction,
inter-node in Gbit/s per node, summed over the node's NICs) and converted to bytes per nanosecond
once, by the properties below, for the communication model. The number of nodes is not a field: it
follows from the plan's world size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from vtrain_plugin import _validate as v
from vtrain_plugin.comm.nccl_table import available_table_sets
from vtrain_plugin.errors import ConfigError
from vtrain_plugin.registry import Registry

NS_PER_US = 1000.0


def gbytes_per_s_to_bytes_per_ns(gbytes_per_s: float) -> float:
    """GB/s (10^9 bytes per second) is exactly one byte per nanosecond."""
    return gbytes_per_s


def gbps_to_bytes_per_ns(gbps: float) -> float:
    """Gbit/s (10^9 bits per second) to bytes per nanosecond."""
    return gbps / 8.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec:
    gpu: str  # device preset name, e.g. "a100-sxm4-80gb" (resolved by the profiler)
    gpus_per_node: int = 8
    intra_node_bandwidth_gbytes_per_s: float  # per GPU and direction (NVLink/NVSwitch)
    intra_node_latency_us: float
    inter_node_bandwidth_gbps: float  # per node, all NICs together (e.g. 8 x 200 Gb/s = 1600)
    inter_node_latency_us: float
    price_per_gpu_hour_usd: float | None = None  # None: cost unknown
    nccl_tables: str | None = None  # measured intra-node NCCL table set, e.g. "a100_sxm"
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.gpu, str) or not self.gpu:
            raise ConfigError(f"cluster.gpu must be a non-empty device preset name, got {self.gpu!r}")
        v.positive_int("cluster.gpus_per_node", self.gpus_per_node)
        for name in ("intra_node_bandwidth_gbytes_per_s", "inter_node_bandwidth_gbps"):
            v.positive_number(f"cluster.{name}", getattr(self, name))
        for name in ("intra_node_latency_us", "inter_node_latency_us"):
            v.non_negative_number(f"cluster.{name}", getattr(self, name))
        if self.price_per_gpu_hour_usd is not None:
            v.non_negative_number("cluster.price_per_gpu_hour_usd", self.price_per_gpu_hour_usd)
        if self.nccl_tables is not None:
            v.one_of("cluster.nccl_tables", self.nccl_tables, available_table_sets())

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

    def num_nodes(self, world_size: int) -> int:
        v.positive_int("world_size", world_size)
        return -(-world_size // self.gpus_per_node)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClusterSpec:
        """Build from a config mapping; ``preset`` names a base preset that the other keys override."""
        d = dict(v.mapping("cluster", d))
        allowed = [f.name for f in fields(cls)]
        v.no_unknown_keys("cluster", d, [*allowed, "preset"])
        preset = d.pop("preset", None)
        if preset is not None:
            d = {**get_cluster_preset(preset).to_dict(), **d}
        missing = [f.name for f in fields(cls) if f.name not in d and f.default is MISSING]
        if missing:
            raise ConfigError(f"cluster: missing key {missing[0]!r} (or give 'preset', one of "
                              f"{', '.join(_PRESETS.names())})")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_PRESETS: Registry[ClusterSpec] = Registry("cluster preset", plural="presets")


def register_cluster_preset(spec: ClusterSpec) -> ClusterSpec:
    if not spec.name:
        raise ConfigError("cluster preset needs a name")
    return _PRESETS.add(spec.name, spec)


def get_cluster_preset(name: str) -> ClusterSpec:
    return _PRESETS.get(name)


def cluster_preset_names() -> tuple[str, ...]:
    return _PRESETS.names()


# Latencies are per NCCL ring step (NVSwitch hop, resp. one InfiniBand/RoCE message); prices are
# indicative on-demand cloud rates per GPU-hour, to be overridden with the user's own.
register_cluster_preset(ClusterSpec(
    name="dgx-a100", gpu="a100-sxm4-80gb", gpus_per_node=8,
    intra_node_bandwidth_gbytes_per_s=300.0, intra_node_latency_us=1.0,
    inter_node_bandwidth_gbps=8 * 200.0, inter_node_latency_us=5.0,
    price_per_gpu_hour_usd=2.0, nccl_tables="a100_sxm"))
register_cluster_preset(ClusterSpec(
    name="dgx-h100", gpu="h100-sxm", gpus_per_node=8,
    intra_node_bandwidth_gbytes_per_s=450.0, intra_node_latency_us=1.0,
    inter_node_bandwidth_gbps=8 * 400.0, inter_node_latency_us=5.0,
    price_per_gpu_hour_usd=4.0))
register_cluster_preset(ClusterSpec(
    name="dgx-h200", gpu="h200-sxm", gpus_per_node=8,
    intra_node_bandwidth_gbytes_per_s=450.0, intra_node_latency_us=1.0,
    inter_node_bandwidth_gbps=8 * 400.0, inter_node_latency_us=5.0,
    price_per_gpu_hour_usd=5.0))
# The local CPU as one single-device node (``vtrain validate --device cpu``): gloo over shared
# memory inside the node, a 10 Gb/s Ethernet between nodes; no price.
register_cluster_preset(ClusterSpec(
    name="local-cpu", gpu="cpu", gpus_per_node=1,
    intra_node_bandwidth_gbytes_per_s=10.0, intra_node_latency_us=10.0,
    inter_node_bandwidth_gbps=10.0, inter_node_latency_us=50.0))
