"""Per-step logging that adds work to the optimizer step: Megatron-LM's --log-params-norm and
--log-num-zeros-in-grad, each one more read of the rank's fp32 optimizer tensors.

Both run every iteration, so they are priced, not accepted as free. ``calc_params_l2_norm``
(megatron/training/utils.py) takes a multi-tensor L2 norm of the rank's fp32 main parameters (the
distributed optimizer's shard when it shards): a pass reading 4 bytes per parameter, the kernel of the
gradient-norm pass (``multi_tensor_l2norm``) over the same count. ``count_zeros_fp32`` (megatron-core's
optimizer) reads the rank's fp32 main gradients once (4 bytes per parameter), priced as the same
read pass. Both are appended after the block's gradient-norm pass, which gives the parameter count
(already sharded).

Not priced: the scalar all-reduces of the two results (one fp32 value over the model-parallel
group, and over the data-parallel group when the norm is sharded: a few network latencies), and
``count_zeros_fp32`` runs one ``count_nonzero`` kernel per tensor rather than one multi-tensor pass
(more launches than priced); see the assumption lines of :mod:`vtrain_plugin.specs.assumptions`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from vtrain_plugin.core.graph import Node, OpNode, Phase

NORM_PASS = "te.multi_tensor_l2norm.default"
FP32 = 4


def logging_passes(nodes: Sequence[Node], *, params_norm: bool, num_zeros: bool) -> tuple[Node, ...]:
    """``nodes`` (one block, lowered and sharded) with a read pass over its fp32 parameters after
    its gradient-norm pass for ``params_norm`` and another over its fp32 gradients for ``num_zeros``."""
    extra = int(params_norm) + int(num_zeros)
    if not extra:
        return tuple(nodes)
    out: list[Node] = []
    for node in nodes:
        out.append(node)
        if isinstance(node, OpNode) and node.phase is Phase.OPTIMIZER and node.op == NORM_PASS:
            (count,) = node.key.input_shapes[0]
            out += [replace(node, nbytes=FP32 * count)] * extra
    return tuple(out)
