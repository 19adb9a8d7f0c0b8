"""Data-parallel gradient buckets: which gradients are reduced together, and when they are ready.

Without overlap, Megatron-DeepSpeed reduces all gradients in one message after the last backward.
With ``grad_reduce: overlap`` (Megatron DDP ``overlap_grad_reduce``), gradients fill buckets of
``bucket_size_mb`` (default: Megatron-Core's max(4e7, 1e6 x DP) parameters) in backward order
(blocks reversed); a bucket is ready when the backward of the last layer it holds is done, at that fraction of the chunk's backward time.

With the distributed optimizer (:func:`zero_buckets`) the buckets are Megatron-Core's
(:mod:`vtrain_plugin.cost.comm.param_buffer`): each is reduce-scattered (gradient dtype) when ready and
all-gathered (model dtype, FP8 weights with ``fp8_param_gather``) after the optimizer step; the
all-gather of a bucket is needed when the
chunk's first forward reaches the earliest of its parameters, at that fraction of the forward time.
Buckets of one group (a model chunk after the first) are communicated together. With the
distributed optimizer in ``N`` instances a bucket is padded and reduce-scattered over the ``DP / N``
ranks of the instance, its reduced shard (``1 / (DP / N)`` of it) all-reduced over the ``N``
instances right after (megatron-core issues both on one stream, in that order), and it is
all-gathered inside the instance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from vtrain_plugin.core.graph import CollectiveKind, ParallelGroup
from vtrain_plugin.cost.comm.collectives import CommModel
from vtrain_plugin.cost.comm.param_buffer import Bucket, bucket_elements, chunk_buckets
from vtrain_plugin.cost.comm.runtime_collectives import RuntimeCollectives, instance_groups
from vtrain_plugin.cost.work import DpBucket, ParamGather
from vtrain_plugin.specs.training import GradReduce, TrainingSpec


@dataclass(frozen=True, slots=True)
class BlockGradients:
    """One block of a stage in forward order: backward time and gradient bytes per instance (and,
    for the distributed optimizer, forward time and the elements of each parameter)."""

    backward_ns: float
    grad_nbytes: int
    count: int
    forward_ns: float = 0.0
    param_numels: tuple[int, ...] = ()
    # Bytes per element of each parameter's all-gather (RuntimeCollectives.gather_nbytes); empty:
    # ZeroRuntime.param_nbytes for every one.
    gather_nbytes: tuple[int, ...] = ()


def dp_buckets(blocks: Sequence[BlockGradients], comm: CommModel, training: TrainingSpec,
               pipeline_rank: int, group: ParallelGroup = ParallelGroup.DP, *, grad_nbytes: int) -> tuple[DpBucket, ...]:
    """The stage's buckets in the order they become ready (see the module doc), all-reduced over
    ``group`` (DP; expert DP for the gradients of experts split by expert parallelism, which
    megatron-core's DDP keeps in buffers and buckets of their own). ``grad_nbytes``: bytes per
    gradient element, which the default bucket size (a number of parameters) is counted in."""
    total_grad = sum(b.grad_nbytes * b.count for b in blocks)
    if total_grad == 0:
        return ()
    if training.grad_reduce is GradReduce.AFTER_BACKWARD:
        return (_bucket(total_grad, 1.0, comm, pipeline_rank, group),)
    total_time = sum(b.backward_ns * b.count for b in blocks) or 1.0
    buckets: list[DpBucket] = []
    pending = 0
    elapsed = 0.0
    limit = training.bucket_nbytes(comm.data_parallel, grad_nbytes)
    for block in reversed(blocks):
        for _ in range(block.count):
            elapsed += block.backward_ns
            pending += block.grad_nbytes
            if pending >= limit:
                buckets.append(_bucket(pending, elapsed / total_time, comm, pipeline_rank, group))
                pending = 0
    if pending:
        buckets.append(_bucket(pending, 1.0, comm, pipeline_rank, group))
    return tuple(buckets)


def _bucket(nbytes: int, ready: float, comm: CommModel, rank: int, group: ParallelGroup) -> DpBucket:
    return DpBucket(comm_ns=comm.time_ns(CollectiveKind.ALL_REDUCE, nbytes, group, pipeline_rank=rank),
                    ready_fraction=min(1.0, ready))


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroRuntime:
    """What the distributed optimizer's buckets of one chunk depend on besides its parameters."""

    data_parallel: int  # size of the group the buffer is sharded over
    pipeline_rank: int
    chunk: int
    grad_nbytes: int  # per element
    param_nbytes: int
    shared_embedding: int | None  # forward index of the parameter with a bucket of its own
    group: ParallelGroup = ParallelGroup.DP  # expert DP for the buffer of experts split by expert parallelism
    instances: int = 1  # the distributed optimizer's instances (ParallelPlan.distributed_optimizer_instances)

    @property
    def shard_group_size(self) -> int:
        """Ranks of one instance: what the buffer is padded for and sharded over."""
        return self.data_parallel // self.instances

    @classmethod
    def of(cls, runtime: RuntimeCollectives, *, pipeline_rank: int, chunk: int,
           group: ParallelGroup = ParallelGroup.DP) -> ZeroRuntime:
        return cls(data_parallel=runtime.group_size(group), pipeline_rank=pipeline_rank, chunk=chunk,
                   grad_nbytes=runtime.grad_dtype.nbytes, param_nbytes=runtime.param_dtype.nbytes,
                   shared_embedding=runtime.shared_embedding_param if group is ParallelGroup.DP else None,
                   group=group, instances=runtime.optimizer_instances)


def zero_layout(param_numels: Sequence[int], training: TrainingSpec, runtime: ZeroRuntime) -> tuple[Bucket, ...]:
    """Megatron-Core's buckets of a chunk with these parameters (forward order), in layout order:
    bucketed by size on the first chunk of the first pipeline rank with ``grad_reduce: overlap``,
    one bucket elsewhere (:mod:`vtrain_plugin.cost.comm.param_buffer`)."""
    bucketed = training.grad_reduce is GradReduce.OVERLAP and runtime.pipeline_rank == 0 and runtime.chunk == 0
    size = bucket_elements(training.bucket_size_mb, data_parallel=runtime.data_parallel,
                           grad_nbytes=runtime.grad_nbytes) if bucketed else None
    return chunk_buckets(param_numels, data_parallel=runtime.shard_group_size, bucket_size=size,
                         shared_embedding=runtime.shared_embedding)


def zero_buckets(blocks: Sequence[BlockGradients], comm: CommModel, training: TrainingSpec, runtime: ZeroRuntime
                 ) -> tuple[tuple[DpBucket, ...], tuple[ParamGather, ...]]:
    """The chunk's gradient reduce-scatters (in the order they become ready) and parameter
    all-gathers (in the order the forward needs them); see the module doc."""
    numels: list[int] = []
    gathered: list[int] = []  # bytes of each parameter's all-gather
    instance: list[int] = []  # block instance (forward order) of each parameter
    forward: list[float] = []
    backward: list[float] = []
    for block in blocks:
        for _ in range(block.count):
            numels.extend(block.param_numels)
            gathered.extend(n * b for n, b in zip(block.param_numels, block.gather_nbytes or
                                                  [runtime.param_nbytes] * len(block.param_numels)))
            instance.extend([len(forward)] * len(block.param_numels))
            forward.append(block.forward_ns)
            backward.append(block.backward_ns)
    if not numels:
        return (), ()
    buckets = zero_layout(numels, training, runtime)
    total_forward, total_backward = sum(forward) or 1.0, sum(backward) or 1.0
    before = list(accumulate(forward, initial=0.0))  # forward time before each instance
    after = list(accumulate(reversed(backward)))[::-1]  # backward time until each instance is done
    rank = runtime.pipeline_rank
    groups = [list(buckets)] if runtime.chunk > 0 else [[b] for b in buckets]

    intra, inter = instance_groups(runtime.group, runtime.instances)

    def reduce_ns(group: list[Bucket]) -> float:
        scatter = sum(comm.time_ns(CollectiveKind.REDUCE_SCATTER, b.numel * runtime.grad_nbytes, intra,
                                   pipeline_rank=rank) for b in group)
        if inter is None:
            return scatter
        shard_nbytes = (b.numel // runtime.shard_group_size * runtime.grad_nbytes for b in group)
        return scatter + sum(comm.time_ns(CollectiveKind.ALL_REDUCE, n, inter, pipeline_rank=rank)
                             for n in shard_nbytes)

    def gather_nbytes(b: Bucket) -> int:
        """The bucket's parameters at their all-gather widths, its padding at the model dtype's."""
        members = range(b.first_param, b.last_param + 1)
        return sum(gathered[i] for i in members) + (b.numel - sum(numels[i] for i in members)) * runtime.param_nbytes

    def gather_ns(group: list[Bucket]) -> float:
        return sum(comm.time_ns(CollectiveKind.ALL_GATHER, gather_nbytes(b), intra, pipeline_rank=rank)
                   for b in group)

    def first(group: list[Bucket]) -> int:
        return instance[min(b.first_param for b in group)]

    reduces = tuple(DpBucket(comm_ns=reduce_ns(g), ready_fraction=min(1.0, after[first(g)] / total_backward))
                    for g in groups)
    gathers = tuple(ParamGather(comm_ns=gather_ns(g), need_fraction=before[first(g)] / total_forward)
                    for g in reversed(groups))
    return reduces, gathers
