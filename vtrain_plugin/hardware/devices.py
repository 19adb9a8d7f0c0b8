"""GPU spec sheets: published peak rates and sizes, one JSON data file per device preset.

Each preset is ``data/devices/<name>.json``, named after the preset; it holds the spec-sheet numbers
with their units in the key names (``hbm_bandwidth_gbytes_per_s``, decimal giga, as NVIDIA publishes
them), where they come from (``reference``) and the usual node of the device (``default_cluster``).
Rates are converted to per-nanosecond units by properties, once, where the kernel model reads them:
1 TFLOP/s is 1e3 FLOP/ns and 1 GB/s is 1 byte/ns. The analytical model's fitted constants are not
spec-sheet facts: they live in calibration files (:mod:`vtrain_plugin.hardware.calibration`).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.dtypes import Dtype, canonical_dtype
from vtrain_plugin.core.units import tflop_per_s_to_flop_per_ns
from vtrain_plugin.specs.cluster import GpuArchitecture
from vtrain_plugin.specs.training import Fp8Recipe, TrainingSpec

# Short names a config may use for a preset (vTrain's ``gpu_name``), matched case-insensitively.
ALIASES = {"a100": "a100-sxm4-80gb", "h100": "h100-sxm", "h200": "h200-sxm", "b200": "b200-sxm"}
# gb200 and gb300 are preset names themselves (no SXM / memory variants to tell apart).

_MEMORY_TOKEN = re.compile(r"^\d+gb$")
_NOT_SXM = ("pcie", "nvl")
_POSITIVE_FIELDS = ("peak_fp16_tflop_per_s", "peak_bf16_tflop_per_s", "peak_tf32_tflop_per_s",
                    "peak_fp32_tflop_per_s", "peak_fp8_tflop_per_s", "peak_fp4_tflop_per_s", "hbm_bandwidth_gbytes_per_s",
                    "memory_gibibytes", "l2_cache_mebibytes", "nvlink_gbytes_per_s_per_direction",
                    "gemm_ceiling_bf16_tflop_per_s", "host_link_gbytes_per_s_per_direction", "usable_memory_gibibytes")
_OPTIONAL_FIELDS = ("peak_fp8_tflop_per_s", "peak_fp4_tflop_per_s", "gemm_ceiling_bf16_tflop_per_s", "host_link_gbytes_per_s_per_direction",
                    "usable_memory_gibibytes")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """One GPU model: published peak rates and sizes (dense, no sparsity)."""

    name: str
    description: str = ""
    reference: str = ""  # where the spec-sheet numbers come from
    architecture: GpuArchitecture  # the generation: picks the default software stack
    peak_fp16_tflop_per_s: float  # dense tensor-core rates
    peak_bf16_tflop_per_s: float
    peak_tf32_tflop_per_s: float  # fp32 matmuls on tensor cores (TF32)
    peak_fp32_tflop_per_s: float  # CUDA cores, non-tensor
    peak_fp8_tflop_per_s: float | None = None  # None: no fp8 tensor cores
    peak_fp4_tflop_per_s: float | None = None  # None: no fp4 (NVFP4) tensor cores
    # The highest dense bf16 GEMM rate measured on the device (a public brute-force shape search;
    # ``reference`` says which): the physical ceiling of any calibrated GEMM efficiency. None: no
    # tensor cores (a CPU).
    gemm_ceiling_bf16_tflop_per_s: float | None = None
    hbm_bandwidth_gbytes_per_s: float
    memory_gibibytes: float
    # What a process can allocate in: the total CUDA reports (``total_memory``: the datasheet's memory
    # less what the driver reserves), measured where ``reference`` says. None: not measured, the
    # datasheet's memory stands for it (and the estimate says so).
    usable_memory_gibibytes: float | None = None
    sm_count: int
    l2_cache_mebibytes: float
    nvlink_gbytes_per_s_per_direction: float
    # The GPU's link to host memory (PCIe), per direction: copies of checkpoint shards to the host.
    # None: the device's memory is the host's (a CPU).
    host_link_gbytes_per_s_per_direction: float | None = None
    default_cluster: str  # the usual node of this device (a cluster preset name)
    # Rates that rest on the datasheet alone, with no public measurement on this device to bound them
    # (field names): an estimate that uses one says so in its assumptions (unvalidated_rates).
    datasheet_only: tuple[str, ...] = ()
    # True when the processor that issues kernels also runs them (a CPU): host and kernel time add
    # up instead of overlapping as the CPU -> GPU launch pipeline does.
    host_runs_kernels: bool = False

    def __post_init__(self) -> None:
        where = f"device {self.name!r}"
        object.__setattr__(self, "architecture", GpuArchitecture(v.one_of(
            f"{where} architecture", str(self.architecture), [a.value for a in GpuArchitecture])))
        v.positive_int(f"{where} sm_count", self.sm_count)
        for name in _POSITIVE_FIELDS:
            value = getattr(self, name)
            if not (name in _OPTIONAL_FIELDS and value is None):
                object.__setattr__(self, name, v.positive_number(f"{where} {name}", value))
        if self.gemm_ceiling is not None and self.gemm_ceiling > 1.0:
            raise ConfigError(f"{where} gemm_ceiling_bf16_tflop_per_s ({self.gemm_ceiling_bf16_tflop_per_s:g}) "
                              f"must not exceed peak_bf16_tflop_per_s ({self.peak_bf16_tflop_per_s:g})")
        if self.usable_memory_gibibytes is not None and self.usable_memory_gibibytes > self.memory_gibibytes:
            raise ConfigError(f"{where} usable_memory_gibibytes ({self.usable_memory_gibibytes:g}) must not exceed "
                              f"memory_gibibytes ({self.memory_gibibytes:g})")
        v.boolean(f"{where} host_runs_kernels", self.host_runs_kernels)
        object.__setattr__(self, "datasheet_only", tuple(
            v.one_of(f"{where} datasheet_only", name, _POSITIVE_FIELDS) for name in self.datasheet_only))
        if not isinstance(self.default_cluster, str) or not self.default_cluster:
            raise ConfigError(f"{where} default_cluster must be a cluster preset name, got {self.default_cluster!r}")

    @property
    def gemm_ceiling(self) -> float | None:
        """The measured GEMM ceiling as a fraction of the dense bf16 peak (None: not a GPU)."""
        if self.gemm_ceiling_bf16_tflop_per_s is None:
            return None
        return self.gemm_ceiling_bf16_tflop_per_s / self.peak_bf16_tflop_per_s

    @property
    def has_fp8(self) -> bool:
        """Whether the device has fp8 tensor cores (Hopper and later)."""
        return self.peak_fp8_tflop_per_s is not None

    def require_fp8(self, field: str, value: str) -> None:
        """Raise the one-line error of an fp8 setting (``field`` = ``value``) on a device without fp8."""
        self._require(field, value, "fp8 tensor cores", "has_fp8")

    def require_recipe(self, training: TrainingSpec) -> None:
        """Raise the one-line error of a low-precision recipe of ``training`` that this device's tensor
        cores cannot run: any FP8 without fp8 tensor cores (Ampere), MXFP8 without block-scaled fp8
        MMA (before Blackwell), NVFP4 without fp4 tensor cores. Checked before anything is traced."""
        if training.fp4 is not None:
            self._require("training.fp4", training.fp4.value, f"fp4 tensor cores ({training.fp4_recipe.value})",
                          "has_fp4")
        if training.fp8 is None:
            return
        self.require_fp8("training.fp8", training.fp8.value)
        if training.fp8_recipe is Fp8Recipe.MXFP8:
            self._require("training.fp8_recipe", training.fp8_recipe.value,
                          "tensor cores that apply block scales (Blackwell)", "has_block_scaled_fp8")

    def unvalidated_rates(self, training: TrainingSpec) -> tuple[str, ...]:
        """One assumption line per datasheet-only rate (``datasheet_only``) an estimate of ``training``
        on this device uses: the GEMM ceiling always, the fp8 or fp4 peak with those GEMMs."""
        used = ["gemm_ceiling_bf16_tflop_per_s"]
        if training.fp8 is not None:
            used.append("peak_fp8_tflop_per_s")
        if training.fp4 is not None:
            used.append("peak_fp4_tflop_per_s")
        return tuple(f"{self.name} {name} ({getattr(self, name):g}) rests on the datasheet alone: not validated "
                     f"on a {self.name} (no public measurement)" for name in used if name in self.datasheet_only)

    def _require(self, field: str, value: str, what: str, capability: str) -> None:
        if not getattr(self, capability):
            able = ", ".join(n for n in known_devices() if getattr(_load(n), capability))
            raise ConfigError(f"{field} {value!r} needs {what}; {self.name} ({self.architecture.value}) has none "
                              f"(these have: {able})")

    @property
    def has_fp4(self) -> bool:
        """Whether the device has fp4 (NVFP4) tensor cores (Blackwell)."""
        return self.peak_fp4_tflop_per_s is not None

    @property
    def has_block_scaled_fp8(self) -> bool:
        """Whether the tensor cores apply per-block scales themselves (MXFP8: Blackwell's block-scaled
        MMA); Hopper runs fp8 with per-tensor scales, or with block scales applied by the GEMM's epilogue."""
        return self.architecture is GpuArchitecture.BLACKWELL

    @property
    def host_copy_gbytes_per_s(self) -> float:
        """Copies from device to host memory: over the host link, or within memory on a CPU."""
        return self.host_link_gbytes_per_s_per_direction or self.hbm_bandwidth_gbytes_per_s

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
    def usable_memory_gib(self) -> float:
        """The capacity "fits" is checked against: the measured usable memory, else the datasheet's."""
        return self.memory_gibibytes if self.usable_memory_gibibytes is None else self.usable_memory_gibibytes

    def unmeasured_capacity(self) -> tuple[str, ...]:
        """The assumption line of a device whose usable memory was not measured (none when it was)."""
        if self.usable_memory_gibibytes is not None or self.host_runs_kernels:
            return ()
        return (f"usable memory of {self.name} not measured: fits is checked against the datasheet's "
                f"{self.memory_gibibytes:g} GiB (a real card gives a process a little less: the driver reserves some)",)

    @property
    def l2_cache_bytes(self) -> int:
        return round(self.l2_cache_mebibytes * 2**20)

    @property
    def cuda_core_flop_per_ns(self) -> float:
        """fp32 rate without tensor cores (the roofline ceiling of non-matmul kernels)."""
        return tflop_per_s_to_flop_per_ns(self.peak_fp32_tflop_per_s)

    def tensor_flop_per_ns(self, dtype: str, *, allow_tf32: bool = True) -> float:
        """Dense tensor-core peak for matmul inputs of ``dtype``; fp32 runs on TF32 cores if allowed."""
        kind = canonical_dtype(dtype)
        if kind is Dtype.FP32:
            rate = self.peak_tf32_tflop_per_s if allow_tf32 else self.peak_fp32_tflop_per_s
        elif kind is Dtype.FP8:
            if self.peak_fp8_tflop_per_s is None:
                raise ConfigError(f"device {self.name!r} has no fp8 tensor cores (dtype {dtype!r})")
            rate = self.peak_fp8_tflop_per_s
        elif kind is Dtype.FP4:
            if self.peak_fp4_tflop_per_s is None:
                raise ConfigError(f"device {self.name!r} has no fp4 tensor cores (dtype {dtype!r})")
            rate = self.peak_fp4_tflop_per_s
        else:
            rate = self.peak_fp16_tflop_per_s if kind is Dtype.FP16 else self.peak_bf16_tflop_per_s
        return tflop_per_s_to_flop_per_ns(rate)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["architecture"] = self.architecture.value
        return d

    @classmethod
    def from_dict(cls, d: Any, *, where: str) -> DeviceSpec:
        d = v.mapping(where, d)
        names = [f.name for f in fields(cls)]
        v.no_unknown_keys(where, d, names)
        required = {"name", "architecture", "sm_count", "default_cluster", *_POSITIVE_FIELDS} - set(_OPTIONAL_FIELDS)
        missing = sorted(required - set(d))
        if missing:
            raise ConfigError(f"{where}: missing key {missing[0]!r}")
        return cls(**d)


def _spec_dir() -> Path:
    return Path(__file__).with_name("data") / "devices"


def known_devices() -> list[str]:
    """Names of the preset devices, sorted."""
    return list(_preset_names())


@lru_cache(maxsize=1)
def _preset_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in _spec_dir().glob("*.json")))


def _resolve(name: str) -> str:
    if not isinstance(name, str):
        raise ConfigError(f"a GPU is named by a string, got {v.show(name)}")
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    known = known_devices()
    if key not in known:
        raise ConfigError(f"unknown GPU {v.show(name)}; known: {', '.join(known)} "
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


def gpu_name_matches(preset: str, device_name: str) -> bool:
    """Whether a CUDA device called ``device_name`` is an instance of GPU preset ``preset``.

    The preset's family ("a100", "h100", ...) must be a word of the name (words split at spaces,
    dashes and underscores, case-insensitive); a memory size in both ("40gb" vs "80gb") must
    agree; and a PCIe or NVL card is not an SXM preset.
    """
    family, *details = preset.casefold().split("-")
    words = set(re.split(r"[\s_\-]+", device_name.casefold()))
    if family not in words:
        return False
    if any(d.startswith("sxm") for d in details) and any(w in _NOT_SXM for w in words):
        return False
    preset_memory = {d for d in details if _MEMORY_TOKEN.match(d)}
    name_memory = {w for w in words if _MEMORY_TOKEN.match(w)}
    return not (preset_memory and name_memory and not preset_memory & name_memory)
