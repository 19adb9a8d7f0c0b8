"""What a GPU's fused norm keeps for backward against what the traced CPU norm kept, per block instance.

A norm's fused kernel on a GPU keeps its input and fp32 statistics per row: ``e n + 4 n / h`` bytes
(RMSNorm's ``rstd``) or ``e n + 8 n / h`` (LayerNorm's ``mu`` and ``rsigma``) for an input of ``n``
elements of ``e`` bytes in rows of ``h``. That is TransformerEngine's norm (``TENorm``, the norm of
``TELayerNormColumnParallelLinear``), apex's fused norms (Megatron-Core's local spec), and torch's
own ``RMSNorm`` on CUDA, which runs ``aten._fused_rms_norm`` (torch 2.11 on the lent H100/H200:
two blocks per norm at the peak, the output and ``rstd``). The traced CPU step runs torch's
composite RMSNorm, which keeps two fp32 copies of its input instead (its ``float()`` and the
normalised product): 8 bytes per element where the GPU keeps 2 in bf16. LayerNorm traces as
``native_layer_norm``, which keeps what the fused kernels keep. The norm's output is kept by the
linear it feeds, as traced.

Why: every stack vtrain prices on a GPU fuses its norms; left as traced, a bf16 RMSNorm model counts
three times its norms' inputs (4.6 GiB of Qwen3 1.7B's 41.5 GiB peak at 4,096 tokens).
"""

from __future__ import annotations

from vtrain_plugin.core.graph import Block, OpNode, Phase
from vtrain_plugin.cost.lowering.fusion import dtype_nbytes, numel, op_name
from vtrain_plugin.cost.lowering.megatron_core_te import FP32, is_layer_norm_slot

NORMS = ("input_layernorm", "pre_mlp_layernorm", "final_layernorm", "final_norm", "q_layernorm", "k_layernorm",
         "kv_layernorm")  # kv_layernorm: MLA's latent norm


def is_norm_module(module: str) -> bool:
    """A norm of a layer or of the head (the modules :func:`fused_norm_saved_by_module` reads)."""
    return module.rpartition(".")[2] in NORMS or is_layer_norm_slot(module)


def fused_norm_saved_delta(block: Block) -> int:
    """What a GPU's fused norms keep per instance of ``block`` minus what the trace recorded for them."""
    return sum(fused_norm_saved_by_module(block).values())


def fused_norm_saved_by_module(block: Block) -> dict[str, int]:
    """:func:`fused_norm_saved_delta` norm by norm (module path -> bytes), for each norm that saved
    anything in the trace (a norm recomputed in backward saves nothing and is left as traced)."""
    first: dict[str, OpNode] = {}  # module -> its first forward kernel
    for node in block.ops(Phase.FORWARD):
        first.setdefault(node.module, node)
    return {module: norm_keeps(first[module]) - nbytes for module, nbytes in block.saved_by_module
            if is_norm_module(module) and module in first}


def norm_keeps(norm: OpNode) -> int:
    """A fused norm's saved bytes: its input and fp32 statistics per row (``norm`` is its first forward kernel)."""
    shape = norm.key.input_shapes[0]
    rows = numel(shape) // shape[-1]
    statistics = 2 if op_name(norm) == "native_layer_norm" else 1
    return dtype_nbytes(norm) * numel(shape) + FP32 * statistics * rows
