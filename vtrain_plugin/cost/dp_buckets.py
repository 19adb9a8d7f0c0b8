"""Data-parallel gradient buckets: which gradients are reduced together, and when they are ready.

Without overlap, Megatron-DeepSpeed reduces all gradients in one message after the last backward.
With ``grad_reduce: overlap`` (Megatron DDP ``overlap_grad_reduce``), gradients fill buckets of
``bucket_size_mb`` in backward order (blocks reversed); a bucket is ready when the backward of the
last layer it holds is done, at that fraction of the chunk's backward time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vtrain_plugin.core.graph import CollectiveKind, ParallelGroup
from vtrain_plugin.cost.comm import CommModel
from vtrain_plugin.cost.work import DpBucket
from vtrain_plugin.specs.training import GradReduce, TrainingSpec


@dataclass(frozen=True, slots=True)
class BlockGradients:
    """One block of a stage in forward order: backward time and gradient bytes per instance."""

    backward_ns: float
    grad_nbytes: int
    count: int


def dp_buckets(blocks: Sequence[BlockGradients], comm: CommModel, training: TrainingSpec,
               pipeline_rank: int) -> tuple[DpBucket, ...]:
    """The stage's buckets in the order they become ready (see the module doc)."""
    total_grad = sum(b.grad_nbytes * b.count for b in blocks)
    if total_grad == 0:
        return ()
    if training.grad_reduce is GradReduce.AFTER_BACKWARD:
        return (_bucket(total_grad, 1.0, comm, pipeline_rank),)
    total_time = sum(b.backward_ns * b.count for b in blocks) or 1.0
    buckets: list[DpBucket] = []
    pending = 0
    elapsed = 0.0
    limit = training.bucket_nbytes
    for block in reversed(blocks):
        for _ in range(block.count):
            elapsed += block.backward_ns
            pending += block.grad_nbytes
            if pending >= limit:
                buckets.append(_bucket(pending, elapsed / total_time, comm, pipeline_rank))
                pending = 0
    if pending:
        buckets.append(_bucket(pending, 1.0, comm, pipeline_rank))
    return tuple(buckets)


def _bucket(nbytes: int, ready: float, comm: CommModel, rank: int) -> DpBucket:
    return DpBucket(comm_ns=comm.time_ns(CollectiveKind.ALL_REDUCE, nbytes, ParallelGroup.DP, pipeline_rank=rank),
                    ready_fraction=min(1.0, ready))
