"""Analytical kernel durations: a roofline per op class, fixed per-kernel costs and the host's share.

Device time of one kernel is ``max(compute_ns, memory_ns) + kernel_overhead_ns`` where
``memory_ns = nbytes / (hbm_bandwidth * hbm_efficiency)`` and ``compute_ns`` depends on the class:

- GEMM: ``flops / (tensor_peak(dtype) * efficiency(dims))``. The efficiency is
  ``gemm_efficiency * batch*M*N*K / (sm_count * t_m * t_n * steps)``: output tiles of ``t_m x t_n``
  (128 per edge, or the smallest power of two from 16 up covering a shorter edge, as cuBLAS's
  small-tile kernels do) are spread over the SMs in waves, and ``steps = waves * (K + 128)`` counts
  the K-loop steps of an SM, with the padding of partial tiles, the idle SMs of the last wave and
  each tile's fixed cost (the K loop's prologue: pipeline fill; its epilogue: the output write)
  worth about 128 steps. When there are fewer tiles than SMs, cuBLAS may split K (split-K /
  stream-K) into ``s`` pieces: ``steps = ceil(tiles * s / sm_count) * (K / s + 128 + 1024)``, the
  1024 steps for reducing the partial tiles, with the ``s`` (1 to 16, at most
  ``sm_count // tiles``) that takes fewest steps, so a 1024 x 512 x 16384 GEMM (32 tiles) fills
  the SMs. Duration never decreases in M, N, K or batch (each split's steps grow with K, and
  more tiles leave fewer splits). ``gemm_efficiency`` is the rate of
  a large, well-shaped GEMM, bounded by the device's measured ceiling
  (:attr:`~vtrain_plugin.hardware.devices.DeviceSpec.gemm_ceiling`). Tile edge, prologue and split
  and cost were chosen on 436 bf16 GEMMs measured on an H100 (``benchmarks/accuracy/gemm_model.py`` over
  ``benchmarks/results/h100_kernel_sweep.csv``: 128 x 128 tiles fit better than 128 x 256 or
  256 x 128, a prologue of 128 steps better than 0, 32 or 64). The memory-bound regime of thin
  GEMMs is the roofline's ``max`` below. Batched GEMMs (``bmm``, ``baddbmm``: attention scores
  and context) are tiled the same way over ``batch`` independent matrices. Convolutions and
  layouts without parsed dims use ``gemm_efficiency`` alone.
- ATTENTION (fused attention kernels: SDPA's flash / memory-efficient / cuDNN kernels, the
  FlashAttention / cuDNN kernels of :mod:`vtrain_plugin.cost.lowering.megatron_core_te`): compute-bound at
  ``flops / (tensor_peak(dtype) * attention_efficiency)``, a calibrated constant of its own (such
  a kernel streams its tiles through shared memory with an online softmax between the two
  matmuls, and reaches a lower share of peak than a GEMM of the same FLOPs); ``gemm_efficiency``
  where a calibration leaves it out.
- every other kernel: ``flops / fp32 CUDA-core peak`` (the tracer counts only matmul FLOPs, so this
  is usually 0 and the kernel is memory-bound at the achievable HBM bandwidth).
- indexed kernels whose work is per element, not per byte (``gather``, ``scatter_add``,
  ``index_add``: megatron-core's token unpermutation and the backward of its permutation): at
  least ``elements / (sm_count * rate)``, the elements being the index's or the source's (the
  largest operand but the first). ``gather`` and ``scatter_add`` run PyTorch's element-wise
  scatter/gather kernel, which computes a 64-bit offset from the index for every element, and
  ``scatter_add`` and ``index_add`` add with an atomic read-modify-write in L2 (bf16 atomics, top-k
  sources per token); neither is limited by HBM bandwidth at MoE sizes. The rates, elements
  per ns per SM (:data:`INDEXED_ELEMENTS_PER_NS_PER_SM`), are the middle of what a lent H100 and
  H200 measured for 16 Mi bf16 elements (16384 routed tokens x hidden 1024, the profile exports
  ``benchmarks/results/h100_profiles.json`` and ``h200_trace_in_script_profiles.json``, less the
  kernel overhead): ``gather`` 0.86-1.00, ``index_add`` 0.83-0.90, ``scatter_add`` 0.43-0.50
  (0.35 to 1.4 TB/s of their operands' bytes, against 3.35 and 4.8 TB/s of HBM).
  ``index_select``, the forward permutation, copies whole rows and stays memory-bound. A CPU
  (``host_runs_kernels``) keeps the memory bound.
- views, metadata and host reads (NO_KERNEL, HOST_SYNC) take no device time.

Host time per kernel: the CPU spends ``host_overhead_ns`` issuing each kernel of a forward,
recompute or optimizer op (ATen dispatch, the launch call) and ``backward_host_overhead_ns`` for
each kernel of a backward op (issued by autograd's C++ engine; a grouped GEMM is one launch per
expert: TE loops over the experts' cuBLAS GEMMs), each times the node's
``host_time_factor`` (its CPU's speed); the framework's Python per module
call and per layer is added by the costing (:func:`vtrain_plugin.cost.prepare.host_calls`). For small models the GPU
waits on the CPU; the caller combines host and device times of a kernel sequence as a two-stage
pipeline (see :mod:`vtrain_plugin.cost.kernels.host_device`).

Kernels are timed in batches (:class:`KernelBatch`: numpy arrays of the features of many kernels),
so a whole stage is re-timed with new device constants by a few array operations; the per-node
methods time a batch of one. FLOPs and bytes come from the op node (the tracer fills them); only for
a GEMM whose node carries 0 are they computed from the input shapes. fp32 matmuls run on TF32
tensor cores unless the model is built with ``allow_tf32=False``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vtrain_plugin.core.dtypes import Dtype, canonical_dtype
from vtrain_plugin.core.graph import KernelKey, OpNode, Phase
from vtrain_plugin.core.op_names import parse_op_name
from vtrain_plugin.cost.kernels.op_classes import OpClass, classify
from vtrain_plugin.hardware.calibration import DeviceConstants
from vtrain_plugin.hardware.devices import DeviceSpec

_MAX_TILE = 128  # output-tile edge of cuBLAS's workhorse kernels
_MIN_TILE = 16
_K_FILL = 128  # per-tile fixed cost in K-loop steps
_SPLIT_K_COST = 1024  # reducing the partial tiles of a split GEMM, in K-loop steps
_MAX_SPLIT_K = 16
_NO_DEVICE_TIME = frozenset({OpClass.NO_KERNEL, OpClass.HOST_SYNC})
_TENSOR_DTYPES = (Dtype.FP16, Dtype.BF16, Dtype.FP32, Dtype.FP8, Dtype.FP4)

# Elements per ns per SM of indexed kernels bound by per-element work (module doc; measured on an H100
# and an H200, ranges there).
INDEXED_ELEMENTS_PER_NS_PER_SM = {"gather": 0.93, "index_add": 0.87, "scatter_add": 0.47}

# Positions of the (M x K) and (K x N) operands among a GEMM's tensor inputs.
# A grouped GEMM (one kernel over the GEMMs of several experts) is tiled as a batch of them.
_OPERANDS = {"mm": (0, 1), "_scaled_mm": (0, 1), "matmul": (0, 1), "bmm": (0, 1), "grouped_gemm": (0, 1),
             "addmm": (1, 2), "baddbmm": (1, 2), "linear": (0, 1)}


class KernelKind:
    """Integer codes of :attr:`KernelBatch.kind` (numpy arrays hold no enums)."""

    NONE = 0  # no device time (views, metadata, host reads)
    GEMM = 1  # GEMM with parsed dims: tile and wave model
    TENSOR = 2  # tensor-core work without dims (convolutions): flat GEMM efficiency
    OTHER = 3  # memory-bound kernels on CUDA cores
    ATTENTION = 4  # fused attention kernels: attention efficiency


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
    name = parse_op_name(key.op).base
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


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelBatch:
    """Features of ``len(kind)`` kernels as parallel numpy arrays (float64 unless noted)."""

    kind: np.ndarray  # int8 KernelKind codes
    dtype: np.ndarray  # int8 index into ("fp16", "bf16", "fp32", "fp8"): tensor-core dtype of GEMMs
    flops: np.ndarray
    nbytes: np.ndarray
    batch: np.ndarray  # GEMM dims (0 for non-GEMMs)
    m: np.ndarray
    n: np.ndarray
    k: np.ndarray
    backward: np.ndarray  # bool: issued by autograd (backward host overhead)
    # Kernels the host launches for each row: a grouped GEMM's GEMM count (TE issues one cuBLAS GEMM
    # per expert), 1 for every other; None: 1 each.
    launches: np.ndarray | None = None
    # SM-nanoseconds of an indexed kernel's per-element work (elements / per-SM rate, module doc), 0
    # for every other; None: 0 each.
    index_work: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.kind)

    @classmethod
    def of(cls, nodes: Sequence[OpNode]) -> KernelBatch:
        """The batch of ``nodes`` in order; ops that launch no kernel get kind NONE."""
        rows = [_features(node) for node in nodes]
        cols = list(zip(*rows)) if rows else [()] * 9
        return cls(kind=np.array(cols[0], np.int8), dtype=np.array(cols[1], np.int8),
                   flops=np.array(cols[2], float), nbytes=np.array(cols[3], float),
                   batch=np.array(cols[4], float), m=np.array(cols[5], float), n=np.array(cols[6], float),
                   k=np.array(cols[7], float), backward=np.array(cols[8], bool),
                   launches=np.array([_launches(node) for node in nodes], float),
                   index_work=np.array([_index_work(node) for node in nodes], float))

    @classmethod
    def concat(cls, batches: Sequence[KernelBatch]) -> KernelBatch:
        """The rows of ``batches`` one after another (each made by :meth:`of`)."""
        return cls(**{name: np.concatenate([getattr(b, name) for b in batches])
                      for name in ("kind", "dtype", "flops", "nbytes", "batch", "m", "n", "k", "backward", "launches",
                                   "index_work")})


def tensor_dtype_code(dtype: Dtype) -> int:
    """The :attr:`KernelBatch.dtype` code of a tensor-core dtype."""
    return _TENSOR_DTYPES.index(dtype)


def _launches(node: OpNode) -> int:
    """Kernels the host launches for ``node``: TransformerEngine's grouped GEMM (``GroupedLinear``'s
    ``general_grouped_gemm``) issues one cuBLAS GEMM per expert, on several streams, from a loop over
    the experts; its node's first input is the experts' batch."""
    if parse_op_name(node.op).base == "grouped_gemm" and node.key.input_shapes and node.key.input_shapes[0]:
        return int(node.key.input_shapes[0][0])
    return 1


def _index_work(node: OpNode) -> float:
    """SM-nanoseconds of per-element work of an indexed kernel (module doc), 0 for every other:
    its largest operand but the first (the index of ``gather`` / ``scatter_add``, the source of
    ``index_add``) over the op's per-SM rate."""
    rate = INDEXED_ELEMENTS_PER_NS_PER_SM.get(parse_op_name(node.op).base)
    if rate is None or not node.launches_kernel or len(node.key.input_shapes) < 2:
        return 0.0
    return max(math.prod(shape) for shape in node.key.input_shapes[1:]) / rate


def _features(node: OpNode) -> tuple:
    cls = classify(node.op)
    if not node.launches_kernel or cls in _NO_DEVICE_TIME:
        return (KernelKind.NONE, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, False)
    backward = node.phase is Phase.BACKWARD
    if cls in (OpClass.GEMM, OpClass.ATTENTION):
        dtype = tensor_dtype_code(canonical_dtype(node.key.dtypes[0]))
        dims = gemm_dims(node.key) if cls is OpClass.GEMM else None
        if dims is not None:
            nbytes = node.nbytes or _gemm_nbytes(node.key, dims)
            return (KernelKind.GEMM, dtype, float(node.flops or dims.flops), float(nbytes),
                    float(dims.batch), float(dims.m), float(dims.n), float(dims.k), backward)
        kind = KernelKind.ATTENTION if cls is OpClass.ATTENTION else KernelKind.TENSOR
        return (kind, dtype, float(node.flops), float(node.nbytes), 0.0, 0.0, 0.0, 0.0, backward)
    return (KernelKind.OTHER, 0, float(node.flops), float(node.nbytes), 0.0, 0.0, 0.0, 0.0, backward)


def _tile_edges(extent: np.ndarray) -> np.ndarray:
    """Output-tile edges: the smallest power of two >= extent, clipped to [16, 128]."""
    pow2 = np.exp2(np.ceil(np.log2(np.maximum(extent, 1.0))))
    return np.minimum(np.maximum(pow2, _MIN_TILE), _MAX_TILE)


class KernelModel:
    """Modeled durations of kernels on one device; see the module docstring for the formulas.

    ``constants`` are the device's calibrated constants (calibration re-times with candidates).
    """

    def __init__(self, device: DeviceSpec, constants: DeviceConstants, *, allow_tf32: bool = True) -> None:
        self.device = device
        self.allow_tf32 = allow_tf32
        self.constants = constants
        self._rates = np.array([self._rate(d) for d in _TENSOR_DTYPES])

    def _rate(self, dtype: Dtype) -> float:
        if (dtype is Dtype.FP8 and not self.device.has_fp8) or (dtype is Dtype.FP4 and not self.device.has_fp4):
            return math.nan  # only reached by such a GEMM, which tensor_flop_per_ns rejects first
        return self.device.tensor_flop_per_ns(dtype, allow_tf32=self.allow_tf32)

    def gemm_efficiencies(self, batch: np.ndarray, m: np.ndarray, n: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Fraction of tensor-core peak GEMMs of these dims reach (tiles, waves, short K)."""
        sms = self.device.sm_count
        tile_m, tile_n = _tile_edges(m), _tile_edges(n)
        tiles = batch * np.ceil(m / tile_m) * np.ceil(n / tile_n)
        steps = np.ceil(tiles / sms) * (k + _K_FILL)
        most_splits = np.floor(sms / tiles)
        for split in range(2, _MAX_SPLIT_K + 1):
            split_steps = np.ceil(tiles * split / sms) * (k / split + _K_FILL + _SPLIT_K_COST)
            steps = np.where(most_splits >= split, np.minimum(steps, split_steps), steps)
        return self.constants.gemm_efficiency * batch * m * n * k / (sms * tile_m * tile_n * steps)

    def gemm_efficiency(self, dims: GemmDims) -> float:
        one = [np.array([float(x)]) for x in (dims.batch, dims.m, dims.n, dims.k)]
        return float(self.gemm_efficiencies(*one)[0])

    def device_ns(self, kernels: KernelBatch) -> np.ndarray:
        """Device time in ns of every kernel of the batch (0 for kind NONE)."""
        c = self.constants
        kind = kernels.kind
        compute = kernels.flops / self.device.cuda_core_flop_per_ns
        tensor = kind == KernelKind.TENSOR
        attention = kind == KernelKind.ATTENTION
        gemm = kind == KernelKind.GEMM
        if tensor.any() or gemm.any() or attention.any():
            missing = np.isnan(self._rates[kernels.dtype[tensor | gemm | attention]])
            if missing.any():  # raises the device's "no fp8" / "no fp4" error
                self.device.tensor_flop_per_ns(_TENSOR_DTYPES[kernels.dtype[tensor | gemm | attention][missing][0]])
            rate = self._rates[kernels.dtype]
            compute = np.where(tensor, kernels.flops / (rate * c.gemm_efficiency), compute)
            attention_efficiency = c.attention_efficiency or c.gemm_efficiency  # 0: not modelled apart
            compute = np.where(attention, kernels.flops / (rate * attention_efficiency), compute)
            if gemm.any():
                g = np.flatnonzero(gemm)
                eff = self.gemm_efficiencies(kernels.batch[g], kernels.m[g], kernels.n[g], kernels.k[g])
                compute[g] = kernels.flops[g] / (rate[g] * eff)
        memory = kernels.nbytes / (self.device.hbm_bytes_per_ns * c.hbm_efficiency)
        bound = np.maximum(compute, memory)
        if kernels.index_work is not None and not self.device.host_runs_kernels:  # GPU rates (module doc)
            bound = np.maximum(bound, np.where(kind == KernelKind.OTHER, kernels.index_work / self.device.sm_count, 0.0))
        return np.where(kind == KernelKind.NONE, 0.0, bound + c.kernel_overhead_ns)

    def host_ns_batch(self, kernels: KernelBatch) -> np.ndarray:
        """CPU time in ns spent issuing every kernel of the batch (0 for kind NONE)."""
        c = self.constants
        per_kernel = np.where(kernels.backward, c.backward_host_overhead_ns, c.host_overhead_ns) * c.host_time_factor
        if kernels.launches is not None:
            per_kernel = per_kernel * kernels.launches
        return np.where(kernels.kind == KernelKind.NONE, 0.0, per_kernel)

    def duration_ns(self, node: OpNode) -> float:
        """Device time in ns of the node's kernel; 0 when it launches none."""
        return float(self.device_ns(KernelBatch.of([node]))[0])

    def host_ns(self, node: OpNode) -> float:
        """CPU time in ns the framework spends issuing the node's kernel; 0 when it launches none."""
        return float(self.host_ns_batch(KernelBatch.of([node]))[0])


def _gemm_nbytes(key: KernelKey, dims: GemmDims) -> int:
    """Every input read once plus the (batch, M, N) output written, in the first input's dtype."""
    read = sum(math.prod(shape) * canonical_dtype(dtype).nbytes for shape, dtype in zip(key.input_shapes, key.dtypes))
    return read + dims.batch * dims.m * dims.n * canonical_dtype(key.dtypes[0]).nbytes
