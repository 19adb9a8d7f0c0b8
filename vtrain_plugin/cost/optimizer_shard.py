"""The optimizer step of one data-parallel rank under the distributed optimizer: every
parameter-sized kernel on the rank's shard.

Megatron-Core's DistributedOptimizer keeps fp32 main weights and Adam state for ``1/DP`` of each
gradient bucket, and runs its step (gradient cast, unscale, norms, clipping, Adam, copy back to the
model weights) on that shard only. The traced step works on whole parameters, so each optimizer
kernel whose largest operands have ``n > 1`` elements is rewritten to ``ceil(n / DP)`` of them:
those operands (and outputs) flattened to that length, bytes and FLOPs scaled by the same ratio.
Scalar kernels (the global norm and found-inf arithmetic) are kept as they are, and so is the
number of kernels: each rank is taken to run every parameter's kernels on its slice of it (a shard
holds about ``1/DP`` of the parameters, whole or cut at its edges, so this overstates the kernel
launches, not the bytes). A sharded kernel has a new key: measured durations of the whole-parameter
kernel do not apply to it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from vtrain_plugin.core.graph import KernelKey, Node, OpNode, Phase


def shard_optimizer(nodes: Sequence[Node], shards: int) -> tuple[Node, ...]:
    """``nodes`` with the optimizer-phase kernels on one of ``shards`` shards (see the module doc)."""
    if shards == 1:
        return tuple(nodes)
    return tuple(_shard(n, shards) if isinstance(n, OpNode) and n.phase is Phase.OPTIMIZER else n for n in nodes)


def _shard(node: OpNode, shards: int) -> OpNode:
    sizes = [math.prod(shape) for shape in node.key.input_shapes]
    full = max(sizes, default=0)
    if full <= 1:
        return node
    part = -(-full // shards)

    def cut(shape: tuple[int, ...]) -> tuple[int, ...]:
        return (part,) if math.prod(shape) == full else shape

    key = KernelKey(op=node.key.op, input_shapes=tuple(cut(s) for s in node.key.input_shapes),
                    dtypes=node.key.dtypes, args=node.key.args)
    return OpNode(key=key, phase=node.phase, module=node.module,
                  output_shapes=tuple(cut(s) for s in node.output_shapes), launches_kernel=node.launches_kernel,
                  flops=node.flops * part // full, nbytes=node.nbytes * part // full)
