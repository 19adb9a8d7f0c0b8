"""Fitted constants of the analytical model, per (device, software stack), with their provenance.

A device's spec sheet (:mod:`vtrain_plugin.hardware.devices`) holds published facts only; what a
calibration fits lives in a calibration file, one per (device, software stack): JSON with
``format_version``, ``device``, ``software_stack`` (or ``default``: the device's constants for any
stack without a file of its own), ``source`` (the data it was fitted on), ``command`` (what
produced it), ``constants`` and, optionally, ``provenance`` (a mapping: what ``vtrain calibrate``
fitted, on which runs, with its errors). Files are looked up in the user's calibration folder
(``$VTRAIN_CALIBRATION_DIR``, else ``$XDG_CONFIG_HOME/vtrain/calibrations``, else
``~/.config/vtrain/calibrations``) before the package's ``data/calibrations``, the stack's own file
before the ``default`` one. Calibration writes into the user's folder unless asked to write into
the package.

The device constants (:class:`DeviceConstants`) and their physically plausible ranges. A
calibration is a bounded fit inside these ranges (not clipped afterwards); a file whose constant
lies outside its range is refused. Host time is modelled the way the CPU spends it: per launched
kernel, per module call, per transformer layer, per micro-batch and per iteration, each its own
constant, so that constants fitted on one model, GPU or scale carry over to another (host costs are
software costs: they do not change with the GPU, only with the node's CPU, ``host_time_factor``).

Software constants (:data:`SOFTWARE_CONSTANTS`: every host cost) belong to the software stack: the
package's files of one stack state the same values on every GPU (a test holds them to it), so that
the same plan on a faster GPU never comes out slower for the host's sake. Device constants
(efficiencies, kernel overhead) come from the GPU's measurements or spec sheet; a GPU with no
measurement of its own takes those of the closest measured one (H200: the H100's, the same GH100
die), each file's ``source`` says which. The CPU device is the exception: there the host runs the
kernels itself, and its host costs are measured on it.

- ``gemm_efficiency`` in [0.5, 0.859], and never above the device's measured ceiling
  (:attr:`~vtrain_plugin.hardware.devices.DeviceSpec.gemm_ceiling`): the fraction of dense
  tensor-core peak that a large, well-shaped GEMM reaches after tile and wave quantization are
  accounted for. The highest dense matmul rates ever measured by a brute-force shape search are
  85.9% of peak on an A100 SXM and 80.1% on an H100 SXM (benchmarks/data/gemm_ceilings_public.csv);
  no constant may claim more. Our own H100 sweep (benchmarks/results/h100_kernel_sweep.csv, bf16
  on normal inputs) puts large training GEMMs at 66-80% and the model's best fit at 0.7425; below
  0.5 a calibration is fitting something other than GEMM throughput.
- ``hbm_efficiency`` in [0.5, 0.95]: the fraction of spec HBM bandwidth the memory-bound kernels
  of a training step reach on average. Measured on an H100 SXM (3.35 TB/s datasheet;
  ``python -m benchmarks.accuracy.kernel_classes --by-size``): 96 streaming kernels from 128 KiB to
  6 GiB (``benchmarks/results/h100_kernel_sweep.csv``) follow the kernel model's
  ``kernel_overhead_ns + nbytes / (bandwidth * hbm_efficiency)`` within 3% with 4.3 us and 0.88;
  the memory-bound kernels of three profiled plans (``benchmarks/results/h100_profiles.json``:
  softmax and its backward, masked fills, dtype-converting copies, fp32 optimizer arithmetic)
  reach 0.71 of it by time from 64 to 256 MiB and 0.61 above (smaller ones are paced by the host,
  see ``host_overhead_ns``). On an H200 (4.8 TB/s) the streaming sweep gives 4.46 us and 0.879,
  the profiled kernels 0.56 by time above 64 MiB. In a real eager step (``local_spec``, the
  ``default`` files) those kernels reach 0.757 (H100) and 0.655 (H200): fitted on the real steps
  (``python -m benchmarks.accuracy.eager_steps --fit-hbm``), between alone and streaming. Not
  validated on A100 or Blackwell (datasheet bandwidth only).
- ``kernel_overhead_ns`` in [1000, 5000]: device time each kernel adds beyond its roofline time:
  launch latency between back-to-back kernels on one stream, ramp-up and tail; 2-5 us measured
  for back-to-back small kernels (e.g. the CUDA launch-latency microbenchmarks of Jia et al.,
  "Dissecting the NVIDIA Volta/Ampere GPU architecture via microbenchmarking"), 4.3 us on an H100
  with the L2 flushed (the streaming sweep above).
- ``host_overhead_ns`` in [1000, 25000]: CPU time per launched kernel of a forward, recompute or
  optimizer op: ATen dispatch plus the launch call. Eager PyTorch spends 3-10 us per op on small
  tensors (PyTorch's operator-overhead benchmarks, ``benchmarks/operator_benchmark``), the
  cudaLaunchKernel call 2-5 us of it. Issued from Python, as Megatron's layers issue most ops, an
  op costs more: the 203 kernels under 1 MiB of ``benchmarks/results/h100_profiles.json``, each
  called from Python back to back, take 17.6 / 25.1 / 29.3 us (10th / 50th / 90th percentile)
  whatever their size, the host's pace, not the device's; the top is that median (25.6 us on the
  lent H200's host, ``h200_profiles.json``). PyTorch's published per-op figures are not available
  offline: the bounds cite our measurements. Eager megatron-core (``local_spec``, on a GPU the
  ``default`` files) takes megatron-core's layer costs of the joint fit (``megatron_core_local``);
  with them 16 real eager steps on an H100 and an H200 come out within 10%
  (``benchmarks/results/2026-12-03_eager_host_cost.txt``).

Optional constants (a file may leave them out; then the neutral value below applies, which means
"not modelled" and is exempt from the range):

- ``backward_host_overhead_ns`` in [500, 25000], neutral 1000: CPU time per kernel of a backward op,
  issued by autograd's C++ engine (dispatch and launch as in forward, and the Python ``backward``
  of Megatron's ``autograd.Function`` s); the top is the forward's (the H100 measurement above).
- ``module_host_overhead_ns`` in [2000, 100000], neutral 0: CPU time per module call that issues
  kernels, in every phase but the optimizer: ``nn.Module.__call__`` with its hooks, the module's
  Python ``forward``, and Megatron's ``autograd.Function`` s (tensor-parallel linears and
  mappings, fused softmax) whose Python ``forward`` and ``backward`` run per call. A bare module
  call costs 5-10 us; with forward hooks and a Python autograd Function 20-60 us (PyTorch
  profiler traces of Megatron layers show 20-80 us of CPU between the kernels of one module).
- ``collective_host_overhead_ns`` in [5000, 100000], neutral 0: CPU time to issue one blocking
  tensor-parallel collective instead of a kernel's dispatch and launch: the ``torch.distributed``
  Python call, ProcessGroupNCCL's work object and its CUDA events, and ``ncclAllReduce`` enqueueing
  its kernel; 15-50 us per call in PyTorch profiler traces of Megatron's tensor-parallel layers.
- ``layer_host_overhead_ns`` in [10000, 1000000], neutral 0: CPU time per transformer layer per
  forward, recompute and backward, outside its modules: the layer's own Python, and with
  activation checkpointing the checkpoint wrapper (saving and restoring the CPU and CUDA RNG
  states, detaching and re-attaching inputs, DeepSpeed's activation partitioning bookkeeping),
  0.05-1 ms per layer in published profiler traces.
- ``microbatch_overhead_ns`` in [100000, 5000000], neutral 0: host time each pipeline stage spends
  per micro-batch outside the model's ops (the schedule's Python, fetching and broadcasting the
  batch to the tensor-parallel ranks, the synchronisation after each pipeline transfer): 0.1-5 ms.
- ``iteration_overhead_ns`` in [500000, 50000000], neutral 0: host time each pipeline rank spends once
  per iteration outside the model's ops and their micro-batches, with the device drained: the
  training loop's Python (``train_step``, ``finalize_model_grads``, the optimizer step's loops over
  parameter groups, the learning-rate scheduler, the per-step log) and its host synchronisations,
  each of which empties the launch queue so the host work after it hides behind no kernel: the
  gradient-norm and found-inf ``.item()`` s after their all-reduces, the loss reduction read for the
  log, and the interval timer's barrier with ``torch.cuda.synchronize``. Our own estimate, not
  validated on any GPU: 5-20 host synchronisations at 20-200 us each (a drained queue restarts at a
  kernel launch's latency plus the host's reaction) and 0.5-40 ms of Python in the loop and the
  optimizer's per-parameter loops (5-30 us per parameter tensor, hundreds of tensors per rank).
- ``host_time_factor`` in [1.0, 1.6], neutral 1.0: how much longer the CPU of this GPU's usual node
  takes for the same host work than the node the stack's host costs stand for (a DGX H100's Xeon
  Platinum 8480C, Sapphire Rapids, 3.8 GHz boost): every host cost above is multiplied by it on this
  device. Python and the CUDA driver's launch path run on one core, so the ratio is that of single-
  thread speed: a DGX A100's EPYC 7742 (Zen 2, 3.4 GHz boost, 2019) trails a 2023 core by its clock
  (3.4 vs 3.8 GHz) and four years of per-clock gains, 1.1-1.5x together; 1.6 leaves room for
  memory latency. Our own estimate from clocks and generations, not validated on any GPU.
- ``network_efficiency`` in [0.7, 0.95], neutral 1.0: the fraction of a node's nominal network
  bandwidth NCCL reaches between nodes (protocol overhead, PCIe between GPU and NIC, congestion);
  nccl-tests on InfiniBand HDR / NDR report 70-95% of line rate for large all-reduce buses.
- ``attention_efficiency`` in [0.3, 0.9], neutral 0 (fused attention then runs at ``gemm_efficiency``):
  the fraction of dense tensor-core peak that a fused attention kernel (FlashAttention-2/3, cuDNN
  fused attention; forward and backward, counted with the FLOPs the kernel really does: the causal
  half, and the backward's recomputation of the scores) reaches on long sequences.
  FlashAttention-2 reaches 50-73% of peak forward and 45-63% backward on A100 (Dao, 2023);
  FlashAttention-3 and cuDNN 9 reach 60-75% forward and 45-60% backward in bf16 on H100 (Shah et
  al., 2024); below 0.3 a calibration is fitting something other than attention throughput.
- ``gpu_speed_spread`` in [0.003, 0.03], neutral 0 (all GPUs equally fast): the relative standard
  deviation of sustained speed between the nominally identical GPUs of a cluster; a synchronous
  job runs at the pace of its slowest GPU, ``1 + spread * E[max of N standard normals]`` slower
  than a typical one (:mod:`vtrain_plugin.cost.kernels.stragglers`). Sinha et al. (SC'22, "Not All GPUs
  Are Created Equal") measured a spread between the fastest and slowest GPU of production clusters
  of several percent up to about 20% on the same compute-bound kernels; among a thousand normal
  samples the range is about 6.5 standard deviations, hence 0.3-3%.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.files import atomic_write_text
from vtrain_plugin.hardware.devices import get_device

FORMAT_VERSION = 1
DEFAULT_STACK = "default"

# Physically plausible [low, high] of each device constant; see the module docstring for why.
CONSTANT_RANGES: dict[str, tuple[float, float]] = {
    "gemm_efficiency": (0.5, 0.859),
    "hbm_efficiency": (0.5, 0.95),
    "kernel_overhead_ns": (1000.0, 5000.0),
    "host_overhead_ns": (1000.0, 25000.0),
    "backward_host_overhead_ns": (500.0, 25000.0),
    "module_host_overhead_ns": (2000.0, 100000.0),
    "layer_host_overhead_ns": (10000.0, 1_000_000.0),
    "collective_host_overhead_ns": (5000.0, 100000.0),
    "microbatch_overhead_ns": (100_000.0, 5_000_000.0),
    "iteration_overhead_ns": (500_000.0, 50_000_000.0),
    "host_time_factor": (1.0, 1.6),
    "network_efficiency": (0.7, 0.95),
    "attention_efficiency": (0.3, 0.9),
    "gpu_speed_spread": (0.003, 0.03),
}
# Host costs: properties of the CPU and the software stack, the same for a stack on every GPU.
SOFTWARE_CONSTANTS = ("host_overhead_ns", "backward_host_overhead_ns", "module_host_overhead_ns",
                      "layer_host_overhead_ns", "collective_host_overhead_ns", "microbatch_overhead_ns",
                      "iteration_overhead_ns")
# Constants a file may omit; missing ones take these neutral values ("not modelled"), exempt from the ranges.
OPTIONAL_CONSTANTS: dict[str, float] = {
    "backward_host_overhead_ns": 1000.0,
    "module_host_overhead_ns": 0.0,
    "layer_host_overhead_ns": 0.0,
    "collective_host_overhead_ns": 0.0,
    "microbatch_overhead_ns": 0.0,
    "iteration_overhead_ns": 0.0,
    "host_time_factor": 1.0,
    "network_efficiency": 1.0,
    "attention_efficiency": 0.0,
    "gpu_speed_spread": 0.0,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceConstants:
    """The analytical model's fitted constants for one device (ranges in :data:`CONSTANT_RANGES`)."""

    gemm_efficiency: float
    hbm_efficiency: float
    kernel_overhead_ns: float
    host_overhead_ns: float
    backward_host_overhead_ns: float = OPTIONAL_CONSTANTS["backward_host_overhead_ns"]
    module_host_overhead_ns: float = OPTIONAL_CONSTANTS["module_host_overhead_ns"]
    layer_host_overhead_ns: float = OPTIONAL_CONSTANTS["layer_host_overhead_ns"]
    collective_host_overhead_ns: float = OPTIONAL_CONSTANTS["collective_host_overhead_ns"]
    microbatch_overhead_ns: float = OPTIONAL_CONSTANTS["microbatch_overhead_ns"]
    iteration_overhead_ns: float = OPTIONAL_CONSTANTS["iteration_overhead_ns"]
    host_time_factor: float = OPTIONAL_CONSTANTS["host_time_factor"]
    network_efficiency: float = OPTIONAL_CONSTANTS["network_efficiency"]
    attention_efficiency: float = OPTIONAL_CONSTANTS["attention_efficiency"]
    gpu_speed_spread: float = OPTIONAL_CONSTANTS["gpu_speed_spread"]

    def __post_init__(self) -> None:
        for name, (low, high) in CONSTANT_RANGES.items():
            check = v.positive_number if low > 0 and OPTIONAL_CONSTANTS.get(name, 1.0) > 0 else v.non_negative_number
            value = check(f"device constant {name}", getattr(self, name))
            if not low <= value <= high and value != OPTIONAL_CONSTANTS.get(name):
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """The constants of one device under one software stack, and where they come from."""

    device: str
    software_stack: str  # a SoftwareStack value, or "default"
    source: str  # the data the constants were fitted on (or why they are defaults)
    command: str  # the command that produced this file
    constants: DeviceConstants
    path: str = ""  # the file it was read from
    provenance: dict[str, Any] | None = None  # the runs and errors of a fit to measured runs

    def to_dict(self) -> dict[str, Any]:
        constants = {name: value for name, value in asdict(self.constants).items()
                     if name not in OPTIONAL_CONSTANTS or value != OPTIONAL_CONSTANTS[name]}  # neutral: left out
        return {"format_version": FORMAT_VERSION, "device": self.device, "software_stack": self.software_stack,
                "source": self.source, "command": self.command, "constants": constants,
                **({} if self.provenance is None else {"provenance": self.provenance})}


def package_calibration_dir() -> Path:
    return Path(__file__).with_name("data") / "calibrations"


def user_calibration_dir() -> Path:
    explicit = os.environ.get("VTRAIN_CALIBRATION_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "vtrain" / "calibrations"


def calibration_for(device: str, software_stack: str) -> Calibration:
    """The calibration of ``device`` (a preset name) for ``software_stack`` (see the module doc)."""
    user_dir = user_calibration_dir()
    try:
        version = (user_dir / device).stat().st_mtime_ns
    except OSError:
        version = None
    return _locate(device, str(software_stack), user_dir, version)


@lru_cache(maxsize=256)
def _locate(device: str, software_stack: str, user_dir: Path, version: int | None) -> Calibration:
    """Looked up again only when the user's folder for ``device`` changes (``version``: its
    modification time; a file written atomically, as :func:`write_calibration` does, changes it),
    so an estimate costs one ``stat`` here, not a search of both folders."""
    folders = (user_dir, package_calibration_dir())
    for stack in (software_stack, DEFAULT_STACK):
        for folder in folders:
            path = folder / device / f"{stack}.json"
            if path.is_file():
                return _read(str(path), device, stack)
    raise ConfigError(f"no calibration for device {device!r}: expected {device}/{DEFAULT_STACK}.json in "
                      f"{' or '.join(str(f) for f in folders)}")


@lru_cache(maxsize=64)
def _read(path: str, device: str, stack: str) -> Calibration:
    where = f"calibration file {path}"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    data = v.mapping(where, data)
    v.no_unknown_keys(where, data, ("format_version", "device", "software_stack", "source", "command", "constants",
                                    "provenance"))
    if data.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"{where}: format_version {data.get('format_version')!r} is not supported "
                          f"(this vtrain reads {FORMAT_VERSION})")
    if (data.get("device"), data.get("software_stack")) != (device, stack):
        raise ConfigError(f"{where}: describes ({data.get('device')!r}, {data.get('software_stack')!r}), "
                          f"its place says ({device!r}, {stack!r})")
    for key in ("source", "command"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ConfigError(f"{where}: {key} must be a non-empty string")
    constants = DeviceConstants.from_dict(data["constants"], where=where)
    check_gemm_ceiling(constants, device, where=where)
    provenance = data.get("provenance")
    return Calibration(device=device, software_stack=stack, source=data["source"], command=data["command"],
                       constants=constants, path=path,
                       provenance=None if provenance is None else dict(v.mapping(f"{where} provenance", provenance)))


def constant_range(name: str, device: str) -> tuple[float, float]:
    """The range a calibration of ``device`` (a preset name) searches ``name`` in: its documented
    range (:data:`CONSTANT_RANGES`), the GEMM efficiency's top lowered to the device's measured
    ceiling."""
    if name not in CONSTANT_RANGES:
        raise ConfigError(f"device constant {name!r} is unknown; choose from {', '.join(CONSTANT_RANGES)}")
    low, high = CONSTANT_RANGES[name]
    ceiling = get_device(device).gemm_ceiling
    if name == "gemm_efficiency" and ceiling is not None:
        high = min(high, ceiling)
    return low, high


def check_gemm_ceiling(constants: DeviceConstants, device: str, *, where: str) -> None:
    """Refuse a GEMM efficiency above the highest rate ever measured on ``device`` (a preset name)."""
    ceiling = get_device(device).gemm_ceiling
    if ceiling is not None and constants.gemm_efficiency > ceiling:
        raise ConfigError(f"{where}: gemm_efficiency ({constants.gemm_efficiency:g}) must not exceed {device}'s "
                          f"measured GEMM ceiling ({ceiling:.4f} of peak)")


def write_calibration(calibration: Calibration, *, into_package: bool = False) -> Path:
    """Write ``calibration`` atomically into the user's folder (or the package's); returns the path."""
    folder = package_calibration_dir() if into_package else user_calibration_dir()
    path = folder / calibration.device / f"{calibration.software_stack}.json"
    check_gemm_ceiling(calibration.constants, calibration.device, where=str(path))  # what _read would refuse
    atomic_write_text(path, json.dumps(calibration.to_dict(), indent=2) + "\n")
    _read.cache_clear()
    return path
