"""The dropout masks a step keeps for backward on a GPU, where the traced CPU step keeps them wider.

Each dropout the trace records draws its mask with ``bernoulli_`` in the input's dtype and the
product saves that mask (2 bytes per element in bf16); on CUDA, ``torch.nn.Dropout`` runs
``native_dropout``, whose backward keeps a ``bool`` mask, and Megatron-Core's bias-dropout-add
(``torch.compile``d, ``megatron.core.jit.jit_fuser``) keeps the boolean it compares its random
numbers with: one byte per element (:data:`~vtrain_plugin.cost.lowering.fusion.MASK_NBYTES`).
Why: every stack vtrain prices runs on a GPU, so every stack keeps the narrow mask; left as
traced, a GPT with attention dropout counts its score-sized masks twice over.
"""

from __future__ import annotations

from vtrain_plugin.core.graph import Block, Phase
from vtrain_plugin.cost.lowering.fusion import MASK_NBYTES, dtype_nbytes, numel, op_name


def dropout_mask_delta(block: Block) -> int:
    """Bytes per micro-batch that one instance of ``block`` keeps on a GPU minus what the trace
    recorded (see :func:`dropout_mask_delta_by_module`)."""
    return sum(dropout_mask_delta_by_module(block).values())


def dropout_mask_delta_by_module(block: Block) -> dict[str, int]:
    """:func:`dropout_mask_delta` module by module: for each module whose forward drew dropout masks
    and saved at least their bytes (a module recomputed in backward saves none), ``MASK_NBYTES - e``
    per mask element of ``e`` bytes."""
    drawn: dict[str, tuple[int, int]] = {}  # module -> (mask elements, traced bytes)
    for node in block.ops(Phase.FORWARD):
        if op_name(node) == "bernoulli_":
            elements = numel(node.key.input_shapes[0])
            count, nbytes = drawn.get(node.module, (0, 0))
            drawn[node.module] = (count + elements, nbytes + elements * dtype_nbytes(node))
    saved: dict[str, int] = {}
    for module, nbytes in block.saved_by_module:
        saved[module] = saved.get(module, 0) + nbytes
    return {module: count * MASK_NBYTES - nbytes for module, (count, nbytes) in drawn.items()
            if saved.get(module, 0) >= nbytes}
