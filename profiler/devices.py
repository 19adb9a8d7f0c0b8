"""GPU spec sheets: published peak rates plus the few device constants of the analytical model.

Each preset is one JSON file in ``profiler/device_specs/`` named after the preset; the file holds the
spec-sheet numbers with their units in the key names (``hbm_bandwidth_gbytes_per_s``, decimal
giga, as NVIDIA publishes them) and a ``constants`` block that calibration may rewrite
(:func:`write_device_constants`). Rates are converted to per-nanosecond units by properties, once,
where the kernel model reads them: 1 TFLOP/s is 1e3 FLOP/ns and 1 GB/s is 1 byte/ns.

The device constants (:class:`DeviceConstants`) and their physically plausible ranges:

- ``gemm_efficiency`` in [0.3, 1.0]: the fraction of dense tensor-core peak that a large,
  well-shaped GEMM reaches after tile and wave quantization are accounted for. cuBLAS reaches
  80-90% on A100 and 65-80% on H100 (power and clock limits); below 0.3 a calibration is fitting
  something other than GEMM throughput.
- ``hbm_efficiency`` in [0.3, 1.0]: the fraction of spec HBM bandwidth a streaming kernel reaches.
  Copy kernels reach 85-92%, PyTorch pointwise, norm and softmax kernels 60-90%.
- ``kernel_overhead_ns`` in [500, 20000]: device time each kernel adds beyond its roofline time:
  launch latency between back-to-back kernels on one stream, ramp-up and tail. 1-5 us in practice.
- ``host_overhead_ns`` in [1000, 100000]: CPU time the framework spends per launched op of a
  forward, recompute or optimizer step (Python, module hooks, dispatch, the launch call itself).
  3-20 us in eager PyTorch.

Optional constants (a preset may leave them out; the default is the neutral value):

- ``backward_host_overhead_ns`` in [500, 100000], default 1000: CPU time per kernel of a backward op.
  Autograd's C++ engine issues plain ops in 1-10 us, but Megatron's layers implement most backwards
  as Python ``autograd.Function`` s (tensor-parallel linears and mappings, fused softmax,
  activation checkpointing), which cost as much as forward Python: up to the forward range.
- ``microbatch_overhead_ns`` in [0, 10000000], default 0: host time each pipeline stage spends per
  micro-batch outside the model's ops (the schedule's Python, fetching and broadcasting the batch
  to the tensor-parallel ranks, the synchronisation after each pipeline transfer): 0.1-5 ms.
- ``network_efficiency`` in [0.2, 1.0], default 1.0: the fraction of a node's nominal network
  bandwidth NCCL reaches between nodes (protocol overhead, PCIe between GPU and NIC, congestion);
  nccl-tests on InfiniBand HDR reach 70-95%, concurrent collectives of many groups less.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from vtrain_plugin import _validate as v
from vtrain_plugin.errors import ConfigError
from vtrain_plugin.graph import atomic_write_text

# Short names a config may use for a preset (vTrain's ``gpu_name``), matched case-insensitively.
ALIASES = {"a100": "a100-sxm4-80gb", "h100": "h100-sxm", "h200": "h200-sxm"}

# Physically plausible [low, high] of each device constant; see the module docstring for why.
CONSTANT_RANGES: dict[str, tuple[float, float]] = {
    "gemm_efficiency": (0.3, 1.0),
    "hbm_efficiency": (0.3, 1.0),
    "kernel_overhead_ns": (500.0, 20000.0),
    "host_overhead_ns": (1000.0, 100000.0),
    "backward_host_overhead_ns": (500.0, 100000.0),
    "microbatch_overhead_ns": (0.0, 10_000_000.0),
    "network_efficiency": (0.2, 1.0),
}
# Constants a preset may omit; missing ones take these neutral values.
OPTIONAL_CONSTANTS: dict[str, float] = {
    "backward_host_overhead_ns": 1000.0,
    "microbatch_overhead_ns": 0.0,
    "network_efficiency": 1.0,
}

# Canonical tensor-core dtype of each accepted dtype spelling (torch names, with or without "torch.").
_DTYPES = {
    "float16": "fp16", "half": "fp16", "fp16": "fp16",
    "bfloat16": "bf16", "bf16": "bf16",
    "float32": "fp32", "float": "fp32", "fp32": "fp32",
    "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "float8_e4m3fnuz": "fp8", "float8_e5m2fnuz": "fp8",
    "fp8": "fp8",
}


def canonical_dtype(name: str) -> str:
    """``"fp16"``, ``"bf16"``, ``"fp32"`` or ``"fp8"`` for a dtype spelling such as ``"torch.bfloat16"``."""
    key = name.removeprefix("torch.").lower()
    if key not in _DTYPES:
        raise ConfigError(f"dtype {name!r} has no tensor-core rate; supported: {', '.join(sorted(_DTYPES))}")
    return _DTYPES[key]


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceConstants:
    """The analytical model's fitted constants for one device (ranges in :data:`CONSTANT_RANGES`)."""

    gemm_efficiency: float
    hbm_efficiency: float
    kernel_overhead_ns: float
    host_overhead_ns: float
    backward_host_overhead_ns: float = OPTIONAL_CONSTANTS["backward_host_overhead_ns"]
    microbatch_overhead_ns: float = OPTIONAL_CONSTANTS["microbatch_overhead_ns"]
    network_efficiency: float = OPTIONAL_CONSTANTS["network_efficiency"]

    def __post_init__(self) -> None:
        for name, (low, high) in CONSTANT_RANGES.items():
            check = v.positive_number if low > 0 else v.non_negative_number
            value = check(f"device constant {name}", getattr(self, name))
            if not low <= value <= high:
                raise ConfigError(f"device constant {name} must lie in [{low:g}, {high:g}], got {value:g}")
            object.__setattr__(self, name, value)

    @classmethod
    def from_dict(cls, d: Any, *, where: str) -> DeviceConstants:
        d = v.mapping(f"{where} constants", d)
        v.no_unknown_keys(f"{where} constants", d, CONSTANT_RANGES)
        missing = sorted(set(CONSTANT_RANGES) - set(OPTIONAL_CONSTANTS) - set(d))
        if missing:
            raise ConfigError(f"{where} constants: missing key {missing[0]!r}")
        return cls(**d)


_POSITIVE_FIELDS = ("peak_fp16_tflop_per_s", "peak_bf16_tflop_per_s", "peak_tf32_tflop_per_s",
                    "peak_fp32_tflop_per_s", "peak_fp8_tflop_per_s", "hbm_bandwidth_gbytes_per_s",
                    "memory_gibibytes", "l2_cache_mebibytes", "nvlink_gbytes_per_s_per_direction")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """One GPU model: published peak rates and sizes (dense, no sparsity) plus the model constants."""

    name: str
    description: str = ""
    reference: str = ""  # where the spec-sheet numbers come from
    peak_fp16_tflop_per_s: float  # dense tensor-core rates
    peak_bf16_tflop_per_s: float
    peak_tf32_tflop_per_s: float  # fp32 matmuls on tensor cores (TF32)
    peak_fp32_tflop_per_s: float  # CUDA cores, non-tensor
    peak_fp8_tflop_per_s: float | None = None  # None: no fp8 tensor cores
    hbm_bandwidth_gbytes_per_s: float
    memory_gibibytes: float
    sm_count: int
    l2_cache_mebibytes: float
    nvlink_gbytes_per_s_per_direction: float
    # True when the processor that issues kernels also runs them (a CPU): host and kernel time add
    # up instead of overlapping as the CPU -> GPU launch pipeline does.
    host_runs_kernels: bool = False
    constants: DeviceConstants

    def __post_init__(self) -> None:
        where = f"device {self.name!r}"
        v.positive_int(f"{where} sm_count", self.sm_count)
        for name in _POSITIVE_FIELDS:
            value = getattr(self, name)
            if not (name == "peak_fp8_tflop_per_s" and value is None):
                object.__setattr__(self, name, v.positive_number(f"{where} {name}", value))
        v.boolean(f"{where} host_runs_kernels", self.host_runs_kernels)
        if not isinstance(self.constants, DeviceConstants):
            raise ConfigError(
                f"{where} constants must be DeviceConstants, got {type(self.constants).__name__}")

    @property
    def hbm_bytes_per_ns(self) -> float:
        return self.hbm_bandwidth_gbytes_per_s

    @property
    def nvlink_bytes_per_ns(self) -> float:
        return self.nvlink_gbytes_per_s_per_direction

    @property
    def memory_bytes(self) -> int:
        return round(self.memory_gibibytes * 2**30)

    @property
    def l2_cache_bytes(self) -> int:
        return round(self.l2_cache_mebibytes * 2**20)

    @property
    def cuda_core_flop_per_ns(self) -> float:
        """fp32 rate without tensor cores (the roofline ceiling of non-matmul kernels)."""
        return self.peak_fp32_tflop_per_s * 1e3

    def tensor_flop_per_ns(self, dtype: str, *, allow_tf32: bool = True) -> float:
        """Dense tensor-core peak for matmul inputs of ``dtype``; fp32 runs on TF32 cores if allowed."""
        kind = canonical_dtype(dtype)
        if kind == "fp32":
            return (self.peak_tf32_tflop_per_s if allow_tf32 else self.peak_fp32_tflop_per_s) * 1e3
        if kind == "fp8":
            if self.peak_fp8_tflop_per_s is None:
                raise ConfigError(f"device {self.name!r} has no fp8 tensor cores (dtype {dtype!r})")
            return self.peak_fp8_tflop_per_s * 1e3
        return (self.peak_fp16_tflop_per_s if kind == "fp16" else self.peak_bf16_tflop_per_s) * 1e3

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, *, where: str) -> DeviceSpec:
        d = v.mapping(where, d)
        names = [f.name for f in fields(cls)]
        v.no_unknown_keys(where, d, names)
        required = {"name", "sm_count", "constants", *_POSITIVE_FIELDS} - {"peak_fp8_tflop_per_s"}
        missing = sorted(required - set(d))
        if missing:
            raise ConfigError(f"{where}: missing key {missing[0]!r}")
        return cls(**{**d, "constants": DeviceConstants.from_dict(d["constants"], where=where)})


def _spec_dir() -> Path:
    return Path(str(resources.files(__package__).joinpath("device_specs")))


def known_devices() -> list[str]:
    """Names of the preset devices, sorted."""
    return sorted(p.stem for p in _spec_dir().glob("*.json"))


def _resolve(name: str) -> str:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    known = known_devices()
    if key not in known:
        raise ConfigError(f"unknown GPU {name!r}; known: {', '.join(known)} "
                          f"(aliases: {', '.join(a.upper() for a in ALIASES)})")
    return key


def get_device(name: str) -> DeviceSpec:
    """The preset called ``name`` (or an alias such as ``"A100"``), case-insensitive."""
    return _load(_resolve(name))


@lru_cache(maxsize=None)
def _load(name: str) -> DeviceSpec:
    path = _spec_dir() / f"{name}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"device spec {path}: {exc}") from None
    spec = DeviceSpec.from_dict(data, where=f"device spec {path.name}")
    if spec.name != name:
        raise ConfigError(f"device spec {path.name}: name {spec.name!r} must equal the file name {name!r}")
    return spec


def write_device_constants(name: str, constants: dict[str, float]) -> DeviceSpec:
    """Replace some or all of a preset's device constants in its JSON file, atomically.

    The merged constants are validated (known names, plausible ranges) before anything is written;
    returns the updated spec, which later :func:`get_device` calls also see.
    """
    key = _resolve(name)
    v.no_unknown_keys(f"constants for {key}", constants, CONSTANT_RANGES)
    path = _spec_dir() / f"{key}.json"
    data = json.loads(path.read_text())
    data["constants"] = {**data["constants"], **constants}
    spec = DeviceSpec.from_dict(data, where=f"device spec {path.name}")
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")
    _load.cache_clear()
    return spec
