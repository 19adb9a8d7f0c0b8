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

The parameters of experts split by expert parallelism live in buffers of their own, sharded over
the expert data-parallel group: their kernels are cut into ``ceil(n / expert DP)`` instead
(:func:`optimizer_shards`). With the distributed optimizer in ``N`` instances
(``ParallelPlan.distributed_optimizer_instances``) each instance holds a whole copy of the state,
sharded over its ``DP / N`` (expert ``DP / N``) ranks only (megatron-core builds the optimizer on
``intra_dp_cp_group`` / ``intra_expt_dp_group``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megatron_adapters.conventions import is_expert_module
from vtrain_plugin.core.graph import KernelKey, Node, OpNode, Phase
from vtrain_plugin.specs.parallel import ParallelPlan


def optimizer_shards(plan: ParallelPlan, distributed_optimizer: bool) -> tuple[int, int]:
    """Shards of the optimizer state of the dense parameters and of the experts' parameters: the
    gradient-reduce group (DP, times CP with context parallelism) and, when expert parallelism splits
    the experts (their gradients then reduce over expert DP), expert DP; each divided by the
    distributed optimizer's instances; (1, 1) without the distributed optimizer."""
    if not distributed_optimizer:
        return 1, 1
    dense = plan.optimizer_shard_group_size  # DP x CP / instances
    instances = plan.distributed_optimizer_instances
    return dense, plan.expert_data_parallel // instances if plan.expert_parallel > 1 else dense


def shard_optimizer(nodes: Sequence[Node], shards: int, expert_shards: int | None = None) -> tuple[Node, ...]:
    """``nodes`` with the optimizer-phase kernels on one of ``shards`` shards, those of the experts'
    parameters on one of ``expert_shards`` (default ``shards``; see the module doc)."""
    expert_shards = shards if expert_shards is None else expert_shards
    if shards == expert_shards == 1:
        return tuple(nodes)
    return tuple(_shard(n, expert_shards if is_expert_module(n.module) else shards)
                 if isinstance(n, OpNode) and n.phase is Phase.OPTIMIZER else n for n in nodes)


def _shard(node: OpNode, shards: int) -> OpNode:
    if shards == 1:
        return node
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
