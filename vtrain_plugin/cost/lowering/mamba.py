"""The Mamba-2 mixer as Megatron-Core's training path runs it: mamba_ssm's kernels, FLOPs and bytes
from their math, and what they keep for backward.

The traced mixer is the stand-in of :mod:`megatron_adapters.stand_ins` (``MambaMixer``: the
depthwise conv1d, the chunked scan as five batched matmuls and their decays, the gated RMSNorm, all
in torch ops). Megatron-Core's ``MambaMixer.forward`` runs ``mamba_split_conv1d_scan_combined``
(mamba_ssm ``ops/triton/ssd_combined.py``) and the gated RMSNorm (``ops/triton/layernorm_gated.py``).
Between the two projections (whose GEMMs stay as traced) the mixer's ops of one phase form one unit,
mapped here kernel by kernel. Per layer and micro-batch on one TP rank: ``b`` sequences of ``L``
tokens, ``h`` heads of ``p`` channels, ``g`` groups of B and C with state ``n``, chunks of ``Q``
tokens (``c`` of them), ``k`` the conv width, ``e`` bytes per element of the model dtype;
``X = b L h p``, ``BC = b L g n``, ``T = b L h`` (dt), ``S = b c h p n`` (chunk states), ``CB = b c g Q Q``:

=================================  =================================================  ================
kernel (forward)                   FLOPs                                              bytes
=================================  =================================================  ================
causal_conv1d_fwd (+ SiLU)         2 b L (hp + 2gn) k                                 2e b L (hp + 2gn)
chunk_cumsum_fwd                   0                                                  e T + 8 T
chunk_state_fwd                    2 X n                                              e X + e BC + 8 T + 4 S
state_passing_fwd                  2 S                                                4 S + e S
bmm_chunk_fwd (C Bᵀ)               2 BC Q                                             2e BC + 4 CB
chunk_scan_fwd                     2 X Q + 2 X n                                      4 CB + 2e X + e BC + 8 T + e S
gated_rms_norm_fwd                 0                                                  3e X + 4 b L g
=================================  =================================================  ================

Backward (``MambaSplitConv1dScanCombinedFn.backward``): the conv and the scan's cumsum, chunk
states, state passing and ``C Bᵀ`` are recomputed (the forward keeps none of them), then
gated_rms_norm_bwd (5e X + 4 b L g), chunk_scan_bwd_dstates (2 X n), state_passing_bwd (2 S),
chunk_scan_chunk_state_bwd_dx (2 X Q + 2 X n), chunk_scan_bwd_dC (2 X n), chunk_state_bwd_db
(2 X n), chunk_scan_bwd_dcb (2 X Q), bmm_chunk_bwd (4 BC Q), chunk_scan_bwd_ddAcs (2 X Q),
chunk_cumsum_bwd, causal_conv1d_bwd (4 b L (hp + 2gn) k); their bytes (what each reads and
writes) in :func:`_backward_kernels`. The scan kernels use tensor cores (``tl.dot``); their FLOPs are those of the
matmuls, the elementwise decays are not counted (as Megatron's FLOPs do not count them).

Memory: the combined function keeps the in_proj output ``zxBCdt`` (``e b L (2hp + 2gn + h)``), the
scan output before the norm (``e X``) and the norm's fp32 ``rstd`` (``4 b L g``); the chunk states
and the conv output are recomputed (:func:`mixer_saved_delta`). The Mamba layer's own norm is
TE's fused norm inside ``in_proj`` (``TELayerNormColumnParallelLinear``) and is lowered as the
other norms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from vtrain_plugin.core.dtypes import element_nbytes
from vtrain_plugin.core.graph import Block, Node, OpNode, Phase
from vtrain_plugin.cost.lowering.fusion import FORWARD_PHASES, fused, op_name

FP32 = 4
_MIXER = ".mixer"
_PROJECTIONS = (".mixer.in_proj", ".mixer.out_proj")
# The stand-in's forward batched matmuls, in the order ChunkedScan runs them.
_CB, _DIAGONAL, _STATES, _PASSING, _OFF_DIAGONAL = range(5)


def mixer_unit(module: str) -> str:
    """The mixer's modules between its projections (its conv1d, scan, gated norm and itself) form one
    unit, ``<layer>.mixer``; every other module (the projections too) is its own."""
    head, found, rest = module.partition(_MIXER)
    if not found or (rest and not rest.startswith(".")) or module.endswith(_PROJECTIONS) or ".in_proj" in rest \
            or ".out_proj" in rest:
        return module
    return head + found


def is_mixer_unit(module: str) -> bool:
    return module.endswith(_MIXER) and mixer_unit(module) == module


@dataclass(frozen=True, slots=True, kw_only=True)
class MixerDims:
    """The sizes of one traced mixer on one TP rank (see the module doc for the letters)."""

    batch: int
    seq: int
    heads: int
    head_dim: int
    groups: int
    state: int
    chunk: int
    d_conv: int
    dtype: str

    @property
    def chunks(self) -> int:
        return math.ceil(self.seq / self.chunk)

    @property
    def conv_dim(self) -> int:
        return self.heads * self.head_dim + 2 * self.groups * self.state

    @classmethod
    def of_forward(cls, group: Sequence[OpNode]) -> MixerDims | None:
        """The sizes read from a forward unit of the stand-in: its conv1d and the scan's matmuls."""
        conv = next((n for n in group if op_name(n) == "convolution"), None)
        bmms = [n for n in group if op_name(n) == "bmm"]
        if conv is None or len(bmms) != 5:
            return None
        b, _, seq = conv.key.input_shapes[0]
        d_conv = conv.key.input_shapes[1][-1]
        bcg, chunk, state = bmms[_CB].key.input_shapes[0]
        head_dim = bmms[_DIAGONAL].key.input_shapes[1][-1]
        bh, c1, _ = bmms[_PASSING].key.input_shapes[0]
        chunks = c1 - 1
        return cls(batch=b, seq=seq, heads=bh // b, head_dim=head_dim, groups=bcg // (b * chunks), state=state,
                   chunk=chunk, d_conv=d_conv, dtype=bmms[_CB].key.dtypes[0])


def _sizes(d: MixerDims) -> tuple[int, int, int, int, int, int, int]:
    """Bytes per element and the element counts the mixer's kernels read and write: x (heads x head
    dim per token), B/C (groups x state), dt (heads), the chunk states, C^T B per chunk, the conv input."""
    e = element_nbytes(d.dtype)
    x, bc, t = d.batch * d.seq * d.heads * d.head_dim, d.batch * d.seq * d.groups * d.state, d.batch * d.seq * d.heads
    s = d.batch * d.chunks * d.heads * d.head_dim * d.state
    cb = d.batch * d.chunks * d.groups * d.chunk * d.chunk
    return e, x, bc, t, s, cb, d.batch * d.seq * d.conv_dim


def _forward_kernels(d: MixerDims) -> list[tuple[str, int, int]]:
    e, x, bc, t, s, cb, conv = _sizes(d)
    return [
        ("causal_conv1d_fwd", 2 * conv * d.d_conv, 2 * e * conv),
        *_scan_forward(d, e, x, bc, t, s, cb),
        ("chunk_scan_fwd", 2 * x * d.chunk + 2 * x * d.state, FP32 * cb + 2 * e * x + e * bc + 8 * t + e * s),
        ("gated_rms_norm_fwd", 0, 3 * e * x + FP32 * d.batch * d.seq * d.groups),
    ]


def _scan_forward(d: MixerDims, e: int, x: int, bc: int, t: int, s: int, cb: int) -> list[tuple[str, int, int]]:
    """The scan kernels before its output: run in the forward and again in the backward."""
    return [
        ("chunk_cumsum_fwd", 0, e * t + 8 * t),
        ("chunk_state_fwd", 2 * x * d.state, e * x + e * bc + 8 * t + FP32 * s),
        ("state_passing_fwd", 2 * s, FP32 * s + e * s),
        ("bmm_chunk_fwd", 2 * bc * d.chunk, 2 * e * bc + FP32 * cb),
    ]


def _backward_kernels(d: MixerDims) -> list[tuple[str, int, int]]:
    e, x, bc, t, s, cb, conv = _sizes(d)
    return [
        ("causal_conv1d_fwd", 2 * conv * d.d_conv, 2 * e * conv),  # recomputed
        ("gated_rms_norm_bwd", 0, 5 * e * x + FP32 * d.batch * d.seq * d.groups),
        *_scan_forward(d, e, x, bc, t, s, cb),  # recomputed
        ("chunk_scan_bwd_dstates", 2 * x * d.state, e * x + e * bc + 4 * t + FP32 * s),
        ("state_passing_bwd", 2 * s, 2 * FP32 * s + e * s + 4 * t),
        ("chunk_scan_chunk_state_bwd_dx", 2 * x * d.chunk + 2 * x * d.state,
         3 * e * x + FP32 * cb + e * bc + FP32 * s + 16 * t),
        ("chunk_scan_bwd_dC", 2 * x * d.state, e * x + e * s + 2 * e * bc + 8 * t),
        ("chunk_state_bwd_db", 2 * x * d.state, e * x + FP32 * s + 2 * e * bc + 8 * t),
        ("chunk_scan_bwd_dcb", 2 * x * d.chunk, 2 * e * x + FP32 * cb + 8 * t),
        ("bmm_chunk_bwd", 4 * bc * d.chunk, FP32 * cb + 4 * e * bc),
        ("chunk_scan_bwd_ddAcs", 2 * x * d.chunk, 2 * e * x + FP32 * cb + 8 * t),
        ("chunk_cumsum_bwd", 0, 16 * t + e * t),
        ("causal_conv1d_bwd", 4 * conv * d.d_conv, 3 * e * conv),
    ]


KERNEL_PREFIX = "mamba_"  # the kernels' names; those with tensor-core matmuls are GEMMs in op_classes


def mixer_dims(nodes: Sequence[Node]) -> dict[str, MixerDims]:
    """The sizes of every mixer in a block's nodes, by unit, from its forward ops."""
    groups: dict[str, list[OpNode]] = {}
    for node in nodes:
        if isinstance(node, OpNode) and node.phase is Phase.FORWARD and node.launches_kernel:
            unit = mixer_unit(node.module)
            if is_mixer_unit(unit):
                groups.setdefault(unit, []).append(node)
    found = {unit: MixerDims.of_forward(group) for unit, group in groups.items()}
    return {unit: dims for unit, dims in found.items() if dims is not None}


def lower_mixer(group: list[OpNode], dims: MixerDims | None) -> list[Node] | None:
    """One phase of a mixer unit as mamba_ssm's kernels (see the module doc); None when the unit's
    sizes are unknown."""
    if dims is None:
        return None
    first = group[0]
    kernels = _forward_kernels(dims) if first.phase in FORWARD_PHASES else _backward_kernels(dims)
    shape = (dims.batch, dims.seq, dims.heads * dims.head_dim)
    unit = mixer_unit(first.module)
    return [replace(fused(f"mamba.{KERNEL_PREFIX}{name}.default", first, shape, nbytes, dims.dtype, flops=flops),
                    module=unit) for name, flops, nbytes in kernels]


def mixer_saved_delta(block: Block, dims: dict[str, MixerDims]) -> int:
    """What mamba_ssm's combined scan keeps for backward minus what the traced stand-in's conv1d,
    scan, gated norm and mixer kept (bytes per block instance and micro-batch; see the module doc)."""
    delta = 0
    for module, nbytes in block.saved_by_module:
        unit = mixer_unit(module)
        if is_mixer_unit(unit):
            delta -= nbytes
    if next(block.ops(Phase.RECOMPUTE), None) is not None:
        return delta  # the layer is recomputed: its mixer keeps nothing between forward and backward
    for d in dims.values():
        e = element_nbytes(d.dtype)
        tokens = d.batch * d.seq
        in_proj = 2 * d.heads * d.head_dim + 2 * d.groups * d.state + d.heads
        delta += e * tokens * in_proj + e * tokens * d.heads * d.head_dim + FP32 * tokens * d.groups
    return delta
