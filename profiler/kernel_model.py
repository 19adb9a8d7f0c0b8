"""Analytical kernel durations: a roofline per op class plus a fixed per-kernel overhead.

Device time of one kernel is ``max(compute_ns, memory_ns) + kernel_overhead_ns`` where
``memory_ns = nbytes / (hbm_bandwidth * hbm_efficiency)`` and ``compute_ns`` depends on the class:

- GEMM: ``flops / (tensor_peak(dtype) * efficiency(dims))``. The efficiency is
  ``gemm_efficiency * occupancy * K / (K + 64)``: output tiles of ``t_m x t_n`` (128 per edge, or the
  smallest power of two from 16 up covering a shorter edge, as cuBLAS's small-tile kernels do) are
  spread over the SMs in waves, ``occupancy = batch*M*N / (waves * sm_count * t_m * t_n)`` charges
  both the padding of partial tiles and the idle SMs of the last wave, and each tile's fixed cost
  (pipeline fill, epilogue) is worth about 64 steps of its K loop. Duration is then proportional to
  ``waves * t_m * t_n * (K + 64)``, never decreasing in M, N, K or batch. Convolutions and layouts
  without parsed dims use ``gemm_efficiency`` alone.
- ATTENTION (fused SDPA kernels): ``flops / (tensor_peak(dtype) * gemm_efficiency)``.
- every other kernel: ``flops / fp32 CUDA-core peak`` (the tracer counts only matmul FLOPs, so this
  is usually 0 and the kernel is memory-bound).
- views, metadata and host reads (NO_KERNEL, HOST_SYNC) take no device time.

FLOPs and bytes come from the op node (the tracer fills them); only for a GEMM whose node carries 0
are they computed from the input shapes. fp32 matmuls run on TF32 tensor cores unless the model is
built with ``allow_tf32=False``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from profiler.devices import DeviceSpec, canonical_dtype
from profiler.kernel_time import KernelTime, Source
from profiler.op_classes import OpClass, classify
from vtrain_plugin.graph import KernelKey, OpNode

_MAX_TILE = 128  # output-tile edge of cuBLAS's workhorse kernels
_MIN_TILE = 16
_K_FILL = 64  # per-tile fixed cost in K-loop steps
_ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp8": 1}
_NO_DEVICE_TIME = frozenset({OpClass.NO_KERNEL, OpClass.HOST_SYNC})

# Positions of the (M x K) and (K x N) operands among a GEMM's tensor inputs.
_OPERANDS = {"mm": (0, 1), "_scaled_mm": (0, 1), "matmul": (0, 1), "bmm": (0, 1),
             "addmm": (1, 2), "baddbmm": (1, 2), "linear": (0, 1)}


@dataclass(frozen=True, slots=True, kw_only=True)
class GemmDims:
    batch: int
    m: int
    n: int
    k: int

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k


def gemm_dims(key: KernelKey) -> GemmDims | None:
    """Batch, M, N, K of a matmul-type key; None for other ops, odd layouts and empty GEMMs.

    ``linear``'s weight is (N, K); a 2-D right operand folds the left operand's leading dims into M.
    """
    name = key.op.split(".")[1].removesuffix("_") if "." in key.op else key.op
    if name not in _OPERANDS:
        return None
    i, j = _OPERANDS[name]
    if len(key.input_shapes) <= j:
        return None
    a, b = key.input_shapes[i], key.input_shapes[j]
    if len(a) < 2 or len(b) < 2:
        return None
    if name == "linear":
        b = (b[1], b[0])
    if len(b) == 2:
        dims = GemmDims(batch=1, m=math.prod(a[:-1]), n=b[1], k=a[-1])
    else:
        dims = GemmDims(batch=math.prod(b[:-2]), m=a[-2], n=b[-1], k=a[-1])
    return dims if dims.flops else None


def _tile_edge(extent: int) -> int:
    return min(_MAX_TILE, max(_MIN_TILE, 1 << (extent - 1).bit_length()))


class KernelModel:
    """Modeled durations of kernels on one device; see the module docstring for the formulas."""

    def __init__(self, device: DeviceSpec, *, allow_tf32: bool = True) -> None:
        self.device = device
        self.allow_tf32 = allow_tf32

    def gemm_efficiency(self, dims: GemmDims) -> float:
        """Fraction of tensor-core peak a GEMM of these dims reaches (tiles, waves, short K)."""
        tile_m, tile_n = _tile_edge(dims.m), _tile_edge(dims.n)
        tiles = dims.batch * math.ceil(dims.m / tile_m) * math.ceil(dims.n / tile_n)
        slots = math.ceil(tiles / self.device.sm_count) * self.device.sm_count
        occupancy = dims.batch * dims.m * dims.n / (slots * tile_m * tile_n)
        return self.device.constants.gemm_efficiency * occupancy * dims.k / (dims.k + _K_FILL)

    def duration_for_key(self, key: KernelKey, *, flops: int = 0, nbytes: int = 0) -> float:
        """Device time in ns of one kernel with this key, moving ``nbytes`` and doing ``flops``."""
        cls = classify(key.op)
        if cls in _NO_DEVICE_TIME:
            return 0.0
        constants = self.device.constants
        if cls is OpClass.GEMM:
            dims = gemm_dims(key)
            rate = self.device.tensor_flop_per_ns(key.dtypes[0], allow_tf32=self.allow_tf32)
            if dims is None:
                compute_ns = flops / (rate * constants.gemm_efficiency)
            else:
                compute_ns = (flops or dims.flops) / (rate * self.gemm_efficiency(dims))
                nbytes = nbytes or _gemm_nbytes(key, dims)
        elif cls is OpClass.ATTENTION:
            rate = self.device.tensor_flop_per_ns(key.dtypes[0], allow_tf32=self.allow_tf32)
            compute_ns = flops / (rate * constants.gemm_efficiency)
        else:
            compute_ns = flops / self.device.cuda_core_flop_per_ns
        memory_ns = nbytes / (self.device.hbm_bytes_per_ns * constants.hbm_efficiency)
        return max(compute_ns, memory_ns) + constants.kernel_overhead_ns

    def kernel_time(self, key: KernelKey, *, flops: int = 0, nbytes: int = 0) -> KernelTime:
        return KernelTime(duration_ns=self.duration_for_key(key, flops=flops, nbytes=nbytes),
                          source=Source.MODELED)

    def duration_ns(self, node: OpNode) -> float:
        """Device time in ns of the node's kernel; 0 when it launches none."""
        if not node.launches_kernel:
            return 0.0
        return self.duration_for_key(node.key, flops=node.flops, nbytes=node.nbytes)

    def host_ns(self, node: OpNode) -> float:
        """CPU time in ns the framework spends issuing the node's kernel; 0 when it launches none."""
        if not node.launches_kernel or classify(node.op) in _NO_DEVICE_TIME:
            return 0.0
        return self.device.constants.host_overhead_ns

    def effective_ns(self, node: OpNode) -> float:
        """Time the node adds to its stream: ``max(device time, host time)``.

        The CPU issues ops in order and the GPU runs each kernel once it is issued and the previous
        one is done; in steady state that two-stage pipeline advances by the slower stage per op, so
        a kernel shorter than its host overhead leaves the GPU waiting on the CPU. The rule ignores
        the CPU running ahead during long kernels (short ones after them then cost only their device
        time) and the one host overhead before the first kernel of an idle GPU.
        """
        return max(self.duration_ns(node), self.host_ns(node))


def _gemm_nbytes(key: KernelKey, dims: GemmDims) -> int:
    """Every input read once plus the (batch, M, N) output written, in the first input's dtype."""
    read = sum(math.prod(shape) * _ELEMENT_BYTES[canonical_dtype(dtype)]
               for shape, dtype in zip(key.input_shapes, key.dtypes))
    return read + dims.batch * dims.m * dims.n * _ELEMENT_BYTES[canonical_dtype(key.dtypes[0])]
