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

Block-scaled recipes (:data:`QUANTISATIONS`) differ in what one quantised copy of ``n`` elements
costs: ``q n`` bytes of data plus ``s n`` bytes of scales, per copy (TE writes a rowwise and a
columnwise copy in one kernel, so no ``fp8_transpose``); the norms write the model dtype and every
linear input is quantised by its own kernel, reading ``e n`` and writing ``2 (q + s) n``:

===========  ==========  =========================================  =========================  ====
recipe       GEMM rate   scales (per copy)                          amax pass before the cast  q
===========  ==========  =========================================  =========================  ====
mxfp8        fp8         E8M0, 1 byte per 32 elements               no (scales per block)      1
blockwise    fp8         fp32 per 1x128 tile (4/128 byte); weights  no                         1
                         fp32 per 128x128 tile (4/16384 byte)
nvfp4        fp4         E4M3, 1 byte per 16 elements (weights:     yes (the per-tensor fp32   1/2
                         16x16 tiles, 1 byte per 256); a per-       scale needs the amax)
                         tensor fp32 scale (negligible)
===========  ==========  =========================================  =========================  ====

GEMMs read ``(q + s)`` bytes per operand element and write the model dtype. The memory the
recipes keep (saved inputs of the linears, the weight copies) is ``q + s`` bytes per element
(:mod:`vtrain_plugin.cost.lowering.te_saved`, :mod:`vtrain_plugin.cost.stack_memory`). Not modelled:
NVFP4's random Hadamard transform of the weight-gradient GEMM inputs and its stochastic rounding of
gradients (fused into TE's cast kernels), and the layers a recipe keeps in bf16.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from vtrain_plugin.core.dtypes import element_nbytes
from vtrain_plugin.core.graph import CollectiveKind, CollectiveNode, KernelKey, Node, OpNode, Phase
from vtrain_plugin.cost.lowering.fusion import FORWARD_PHASES, fused, numel, op_name
from vtrain_plugin.cost.lowering.megatron_core_te import LINEAR_MODULES
from vtrain_plugin.specs.training import Fp4Recipe, Fp8Format, Fp8Recipe, Fp8Settings

E4M3, E5M2, E2M1 = "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn_x2"
FP8_NBYTES = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Quantisation:
    """What a recipe's quantised copy of a tensor costs, per element (see the module doc)."""

    cast_op: str  # the kernel that writes the quantised copies
    data_nbytes: float  # q: one copy's data
    scale_nbytes: float  # s: one copy's scales, activations and gradients
    weight_scale_nbytes: float  # s of a weight copy
    amax_pass: bool  # an amax kernel reads the tensor before its cast (current per-tensor scaling)
    norm_writes_quantised: bool  # delayed scaling: the norm writes the FP8 copy itself
    fp4: bool = False  # GEMM operands in FP4 (E2M1), else FP8

    @property
    def nbytes(self) -> float:
        """One quantised copy of an activation or gradient, with its scales, per element."""
        return self.data_nbytes + self.scale_nbytes

    @property
    def weight_nbytes(self) -> float:
        return self.data_nbytes + self.weight_scale_nbytes


QUANTISATIONS: dict[Fp8Recipe | Fp4Recipe, Quantisation] = {
    Fp8Recipe.DELAYED: Quantisation(cast_op="te.cast_transpose.default", data_nbytes=1, scale_nbytes=0,
                                    weight_scale_nbytes=0, amax_pass=False, norm_writes_quantised=True),
    Fp8Recipe.TENSORWISE: Quantisation(cast_op="te.cast_transpose.default", data_nbytes=1, scale_nbytes=0,
                                       weight_scale_nbytes=0, amax_pass=True, norm_writes_quantised=False),
    Fp8Recipe.MXFP8: Quantisation(cast_op="te.quantize_mxfp8.default", data_nbytes=1, scale_nbytes=1 / 32,
                                  weight_scale_nbytes=1 / 32, amax_pass=False, norm_writes_quantised=False),
    Fp8Recipe.BLOCKWISE: Quantisation(cast_op="te.quantize_fp8_block.default", data_nbytes=1, scale_nbytes=4 / 128,
                                      weight_scale_nbytes=4 / (128 * 128), amax_pass=False,
                                      norm_writes_quantised=False),
    Fp4Recipe.NVFP4: Quantisation(cast_op="te.quantize_nvfp4.default", data_nbytes=0.5, scale_nbytes=1 / 16,
                                  weight_scale_nbytes=1 / 256, amax_pass=True, norm_writes_quantised=False, fp4=True),
}


def quantisation(fp8: Fp8Settings) -> Quantisation:
    return QUANTISATIONS[fp8.recipe]


def recipe_assumptions(fp8: Fp8Settings | None) -> tuple[str, ...]:
    """The assumption line of a block-scaled recipe: its kernels priced from their bytes, never measured."""
    if fp8 is None or fp8.recipe in (Fp8Recipe.DELAYED, Fp8Recipe.TENSORWISE):
        return ()
    q = quantisation(fp8)
    rate = "fp4" if q.fp4 else "fp8"
    return (f"{fp8.recipe.value}: the linears' GEMMs at the {rate} tensor-core peak times the bf16 GEMM efficiency, "
            f"their quantisation kernels (rowwise and columnwise copies, {q.scale_nbytes:.4g} byte of scales per "
            f"element) priced from their bytes; neither measured",)
NORM_FED = (".linear_qkv", ".linear_fc1")  # their input is a norm's output (TE LayerNormLinear)
_FED_BY = {"input_layernorm": ".linear_qkv", "pre_mlp_layernorm": ".linear_fc1"}
_NORMS = ("te.layer_norm.default", "te.rms_norm.default")


def to_fp8(nodes: Sequence[Node], fp8: Fp8Settings) -> tuple[Node, ...]:
    """The block's TE kernels with the four linears of each layer in FP8 (see the module doc)."""
    q = quantisation(fp8)
    out: list[Node] = []
    inputs: dict[str, OpNode] = {}  # linear module -> its forward GEMM (input and weight shapes)
    weights: list[OpNode] = []
    in_backward: set[str] = set()
    optimizer_at = -1
    for node in nodes:
        if isinstance(node, CollectiveNode):
            out.append(_gathered_in_fp8(node, q))
            continue
        if node.phase is Phase.OPTIMIZER and optimizer_at < 0:
            optimizer_at = len(out)
        if node.op in _NORMS and q.norm_writes_quantised and node.module.rpartition(".")[2] in _FED_BY:
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
            if not q.norm_writes_quantised or not module.endswith(NORM_FED):
                out.extend(_casts(node, node.key.input_shapes[0], e, q))
        elif module not in in_backward:
            in_backward.add(module)
            out.extend(_casts(node, node.key.input_shapes[0], e, q, _operand_dtype(fp8, q, gradient=True)))
            if module.endswith(NORM_FED) and q.norm_writes_quantised and module in inputs:
                saved = inputs[module].key.input_shapes[0]
                out.append(fused("te.fp8_transpose.default", node, saved, 2 * FP8_NBYTES * numel(saved), E4M3))
        out.append(_fp8_gemm(node, fp8, q))
    casts = [cast for gemm in weights
             for cast in _casts(replace(gemm, phase=Phase.OPTIMIZER), gemm.key.input_shapes[1],
                                element_nbytes(gemm.key.dtypes[0]), q, weight=True)]
    at = optimizer_at if optimizer_at >= 0 else len(out)
    return tuple(out[:at] + casts + out[at:])


def fp8_weight_numel(nodes: Sequence[Node]) -> int:
    """Elements of the weights of the four linears of a block instance: the weights TE keeps an FP8
    copy and transpose of across micro-batches, one byte per element each (or, with FP8
    parameters, holds as FP8 data and transpose; :mod:`vtrain_plugin.cost.stack_memory`)."""
    return sum(numel(n.key.input_shapes[1]) for n in nodes
               if isinstance(n, OpNode) and n.phase is Phase.FORWARD and n.launches_kernel
               and n.module.endswith(LINEAR_MODULES) and op_name(n) == "mm")


def _operand_dtype(fp8: Fp8Settings, q: Quantisation, *, gradient: bool = False) -> str:
    if q.fp4:
        return E2M1
    return E5M2 if gradient and fp8.format is Fp8Format.HYBRID else E4M3


def _casts(like: OpNode, shape: tuple[int, ...], e: int, q: Quantisation, dtype: str | None = None, *,
           weight: bool = False) -> list[OpNode]:
    """The quantised rowwise and columnwise copies of a tensor of ``shape`` in the model dtype (``e``
    bytes), after an amax pass where the recipe needs one."""
    n = numel(shape)
    per_copy = q.weight_nbytes if weight else q.nbytes
    cast = fused(q.cast_op, like, shape, round((e + 2 * per_copy) * n), dtype or (E2M1 if q.fp4 else E4M3))
    if not q.amax_pass:
        return [cast]
    return [fused("te.compute_amax.default", like, shape, e * n, like.key.dtypes[0]), cast]


def _fp8_gemm(node: OpNode, fp8: Fp8Settings, q: Quantisation) -> OpNode:
    a, b = node.key.input_shapes[:2]
    out = node.output_shapes[0] if node.output_shapes else (a[0], b[-1])
    first = _operand_dtype(fp8, q, gradient=node.phase is Phase.BACKWARD)
    key = KernelKey(op="aten._scaled_mm.default", input_shapes=(a, b), dtypes=(first, _operand_dtype(fp8, q)))
    nbytes = round(q.nbytes * (numel(a) + numel(b))) + element_nbytes(node.key.dtypes[0]) * numel(out)
    return replace(node, key=key, nbytes=nbytes)


def _gathered_in_fp8(node: CollectiveNode, q: Quantisation) -> CollectiveNode:
    if node.kind is CollectiveKind.ALL_GATHER and node.module.endswith(NORM_FED):
        dtype = E2M1 if q.fp4 else E4M3
        return replace(node, nbytes=round(node.nbytes * q.nbytes / element_nbytes(node.dtype)), dtype=dtype)
    return node
