"""What Megatron-Core's TransformerEngine modules keep for backward where it differs from what the
traced local spec keeps, module by module, in bytes per block instance and micro-batch.

The differences are added by :func:`~vtrain_plugin.cost.stack_memory.stack_rank_memory`; the
attention's own is :func:`~vtrain_plugin.cost.lowering.megatron_core_te.fused_attention_saved_delta`.

The trace records each saving module's bytes (``Block.saved_by_module``); for a norm input of ``n``
elements of ``e`` bytes in rows of ``h`` and an FC1 output of ``f`` elements:

- a layer's norms and the final one (the QK norms and MLA's latent norm too): TE's fused norm keeps
  its input and fp32 row statistics (:mod:`~vtrain_plugin.cost.lowering.fused_norms`, what every
  GPU's fused norm keeps); megatron-core's compiled L2 QK norm keeps the same;
- the MLP's activation (the ``mlp`` module's own saves): Megatron-Core's fused ``bias_swiglu_impl`` /
  ``bias_gelu_impl`` keep their input, the FC1 output, ``e f``, and recompute the rest in backward;
  the traced unfused SwiGLU keeps its products besides (a GeLU keeps ``e f`` either way, and so
  does the unfused squared ReLU: its ReLU output, which the square reads too);
- in FP8, TE's linears keep their input in FP8, one byte per element instead of ``e``: QKV and FC1
  (the norm writes it in FP8), FC2 (cast before its GEMM), and the output projection, whose input
  is the fused attention's output, which the attention keeps in the model dtype for its own
  backward: for it the FP8 copy comes on top, unless the attention is recomputed (selective
  recompute of core_attn), when the projection alone keeps it. A module recomputed as a whole
  (``mlp``, the norms) saves nothing in the trace and is left as traced.
"""

from __future__ import annotations

from vtrain_plugin.core.graph import Block, OpNode, Phase
from vtrain_plugin.cost.lowering.fusion import dtype_nbytes, numel, op_name
from vtrain_plugin.cost.lowering.fused_norms import fused_norm_saved_by_module
from vtrain_plugin.cost.lowering.megatron_core_te import LINEAR_MODULES
CORE_ATTENTION = ".core_attention"  # recomputed under selective recompute of core_attn
KEPT_BESIDE_FP8 = ".linear_proj"  # its input, the attention's output, is kept by the attention too


def te_saved_delta(block: Block, *, fp8: bool, quantised_nbytes: float = 1.0) -> int:
    """What the TE modules of one instance of ``block`` keep minus what the trace recorded for the
    same modules (see the module doc); with ``fp8``, a linear keeps its input quantised at
    ``quantised_nbytes`` per element (data and scales: :attr:`Quantisation.nbytes`)."""
    return sum(te_saved_by_module(block, fp8=fp8, quantised_nbytes=quantised_nbytes).values())


def te_saved_by_module(block: Block, *, fp8: bool, quantised_nbytes: float = 1.0) -> dict[str, int]:
    """:func:`te_saved_delta` module by module (module path -> bytes; modules TE keeps as traced
    are absent)."""
    first: dict[str, OpNode] = {}  # module -> its first forward kernel
    gemm: dict[str, OpNode] = {}  # linear module -> its forward GEMM
    for node in block.ops(Phase.FORWARD):
        first.setdefault(node.module, node)
        if op_name(node) == "mm":
            gemm.setdefault(node.module, node)
    attention_keeps_its_output = not any(CORE_ATTENTION in n.module for n in block.ops(Phase.RECOMPUTE))
    delta = fused_norm_saved_by_module(block)
    for module, nbytes in block.saved_by_module:
        leaf = module.rpartition(".")[2]
        if module in delta:
            continue
        if leaf == "mlp" and f"{module}.linear_fc1" in gemm:
            fc1 = gemm[f"{module}.linear_fc1"]
            delta[module] = dtype_nbytes(fc1) * numel(fc1.output_shapes[0]) - nbytes
        elif fp8 and module.endswith(LINEAR_MODULES) and module in gemm:
            in_fp8 = round(nbytes // dtype_nbytes(gemm[module]) * quantised_nbytes)
            beside = attention_keeps_its_output and module.endswith(KEPT_BESIDE_FP8)
            delta[module] = in_fp8 if beside else in_fp8 - nbytes
    return delta

