"""FP8 training with TransformerEngine: a pass over a block already lowered to ``megatron_core_te``.

TE runs the GEMMs of its linear modules (a layer's QKV, projection, FC1 and FC2; Megatron-Core's
output layer is no TE module and stays in the model dtype) on FP8 operands, keeps the weights in
the model dtype with fp32 main weights, and adds the kernels that make the FP8 copies. Per element
of the tensor involved (``n`` elements, ``e`` bytes each in the model dtype):

========================================  ================================================  =============
where                                     kernels                                           bytes
========================================  ================================================  =============
every GEMM of the four linears (forward,  ``aten._scaled_mm`` at the FP8 tensor-core rate:   1 per operand
dgrad, wgrad)                             E4M3 operands, gradients E5M2 in ``hybrid``        element, e out
QKV and FC1 inputs (the norm's output)    delayed scaling: the norm kernel writes FP8        -(e - 1) n
                                          (cast and amax fused into it)
projection and FC2 inputs                 ``te.cast_transpose``: FP8 copy and its transpose  (e + 2) n
                                          for the weight-gradient GEMM, amax on the fly
the incoming gradient of each linear      ``te.cast_transpose`` before its dgrad GEMM        (e + 2) n
the saved FP8 input of QKV and FC1        ``te.fp8_transpose`` for the weight-gradient GEMM  2 n
each weight, once per iteration           ``te.cast_transpose`` (counted with the optimizer  (e + 2) n
                                          step; TE caches it across micro-batches)
sequence-parallel all-gathers of the      move the FP8 tensor                                1/e of the
QKV and FC1 inputs (forward, backward                                                        bytes
re-gather)
========================================  ================================================  =============

Current scaling (``tensorwise``) knows a tensor's scale only once its amax is known: every cast
is preceded by ``te.compute_amax`` (reads ``e n``), and the norms write the model dtype, their
outputs then cast like the other inputs (so no ``fp8_transpose``). Not modelled: the amax
reductions across the amax group (one small all-reduce per micro-batch) and the scale updates
(one small multi-tensor kernel per micro-batch); FP8 attention (TE's optional FP8 DPA) and FP8
gradient all-gathers of the projection and FC2 (kept in the model dtype).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from vtrain_plugin.core.dtypes import element_nbytes
from vtrain_plugin.core.graph import CollectiveKind, CollectiveNode, KernelKey, Node, OpNode, Phase
from vtrain_plugin.cost.lowering.fusion import FORWARD_PHASES, fused, numel, op_name
from vtrain_plugin.cost.lowering.megatron_core_te import LINEAR_MODULES
from vtrain_plugin.specs.training import Fp8Format, Fp8Recipe, Fp8Settings

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
FP8_NBYTES = 1
NORM_FED = (".linear_qkv", ".linear_fc1")  # their input is a norm's output (TE LayerNormLinear)
_FED_BY = {"input_layernorm": ".linear_qkv", "pre_mlp_layernorm": ".linear_fc1"}
_NORMS = ("te.layer_norm.default", "te.rms_norm.default")


def to_fp8(nodes: Sequence[Node], fp8: Fp8Settings) -> tuple[Node, ...]:
    """The block's TE kernels with the four linears of each layer in FP8 (see the module doc)."""
    current = fp8.recipe is Fp8Recipe.TENSORWISE
    out: list[Node] = []
    inputs: dict[str, OpNode] = {}  # linear module -> its forward GEMM (input and weight shapes)
    weights: list[OpNode] = []
    in_backward: set[str] = set()
    optimizer_at = -1
    for node in nodes:
        if isinstance(node, CollectiveNode):
            out.append(_gathered_in_fp8(node))
            continue
        if node.phase is Phase.OPTIMIZER and optimizer_at < 0:
            optimizer_at = len(out)
        if node.op in _NORMS and not current and node.module.rpartition(".")[2] in _FED_BY:
            e = element_nbytes(node.key.dtypes[0])
            out.append(replace(node, nbytes=node.nbytes - (e - FP8_NBYTES) * numel(node.key.input_shapes[0])))
            continue
        if not (node.module.endswith(LINEAR_MODULES) and op_name(node) == "mm"):
            out.append(node)
            continue
        module, e = node.module, element_nbytes(node.key.dtypes[0])
        if node.phase in FORWARD_PHASES:
            inputs.setdefault(module, node)
            if node.phase is Phase.FORWARD:
                weights.append(node)
            if current or not module.endswith(NORM_FED):
                out.extend(_casts(node, node.key.input_shapes[0], e, current))
        elif module not in in_backward:
            in_backward.add(module)
            gradient = E5M2 if fp8.format is Fp8Format.HYBRID else E4M3
            out.extend(_casts(node, node.key.input_shapes[0], e, current, gradient))  # the incoming gradient
            if module.endswith(NORM_FED) and not current and module in inputs:
                saved = inputs[module].key.input_shapes[0]
                out.append(fused("te.fp8_transpose.default", node, saved, 2 * FP8_NBYTES * numel(saved), E4M3))
        out.append(_fp8_gemm(node, fp8.format))
    casts = [cast for gemm in weights
             for cast in _casts(replace(gemm, phase=Phase.OPTIMIZER), gemm.key.input_shapes[1],
                                element_nbytes(gemm.key.dtypes[0]), current)]
    at = optimizer_at if optimizer_at >= 0 else len(out)
    return tuple(out[:at] + casts + out[at:])


def fp8_weight_numel(nodes: Sequence[Node]) -> int:
    """Elements of the weights of the four linears of a block instance: the weights TE keeps an FP8
    copy and transpose of across micro-batches, one byte per element each (or, with FP8
    parameters, holds as FP8 data and transpose; :mod:`vtrain_plugin.cost.stack_memory`)."""
    return sum(numel(n.key.input_shapes[1]) for n in nodes
               if isinstance(n, OpNode) and n.phase is Phase.FORWARD and n.launches_kernel
               and n.module.endswith(LINEAR_MODULES) and op_name(n) == "mm")


def _casts(like: OpNode, shape: tuple[int, ...], e: int, current: bool, fp8_dtype: str = E4M3) -> list[OpNode]:
    """The FP8 copy and transpose of a tensor of ``shape`` in the model dtype (``e`` bytes)."""
    n = numel(shape)
    cast = fused("te.cast_transpose.default", like, shape, (e + 2 * FP8_NBYTES) * n, fp8_dtype)
    if not current:
        return [cast]
    return [fused("te.compute_amax.default", like, shape, e * n, like.key.dtypes[0]), cast]


def _fp8_gemm(node: OpNode, fmt: Fp8Format) -> OpNode:
    a, b = node.key.input_shapes[:2]
    out = node.output_shapes[0] if node.output_shapes else (a[0], b[-1])
    gradient = E5M2 if fmt is Fp8Format.HYBRID and node.phase is Phase.BACKWARD else E4M3
    key = KernelKey(op="aten._scaled_mm.default", input_shapes=(a, b), dtypes=(gradient, E4M3))
    nbytes = FP8_NBYTES * (numel(a) + numel(b)) + element_nbytes(node.key.dtypes[0]) * numel(out)
    return replace(node, key=key, nbytes=nbytes)


def _gathered_in_fp8(node: CollectiveNode) -> CollectiveNode:
    if node.kind is CollectiveKind.ALL_GATHER and node.module.endswith(NORM_FED):
        return replace(node, nbytes=node.nbytes * FP8_NBYTES // element_nbytes(node.dtype), dtype=E4M3)
    return node
