"""From a traced graph to the simulation's input: per-chunk, per-phase durations of one micro-batch.

This is where the hundreds of kernels of a layer are summed, once per estimate, into forward,
backward, recompute and optimizer durations (DESIGN.md, performance rules). Tensor-parallel
collectives block the compute stream (Megatron without TP overlap) and are added in place;
data-parallel gradients are grouped into buckets whose readiness follows the backward order;
pipeline transfers and the tied-embedding synchronisation are timed by the comm model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from profiler.kernel_time import Source
from vtrain_plugin.comm.model import CommModel
from vtrain_plugin.graph import (Block, BlockKind, CollectiveKind, CollectiveNode, OpGraph, OpNode, ParallelGroup,
                                 Phase, StageGraph)
from vtrain_plugin.sim.work import ChunkWork, DpBucket, PipelineWork
from vtrain_plugin.timing import KernelTimer
from vtrain_plugin.training import GradReduce, TrainingSpec

_PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE, Phase.OPTIMIZER)


@dataclass(slots=True)
class BlockCost:
    """One instance of a block (one layer of a template): kernel and blocking TP time per phase."""

    compute_ns: dict[Phase, float] = field(default_factory=lambda: dict.fromkeys(_PHASES, 0.0))
    tp_comm_ns: dict[Phase, float] = field(default_factory=lambda: dict.fromkeys(_PHASES, 0.0))
    measured_ns: dict[Phase, float] = field(default_factory=lambda: dict.fromkeys(_PHASES, 0.0))
    dp_grad_nbytes: int = 0
    embedding_sync: tuple[CollectiveNode, ...] = ()
    largest_modeled: dict = field(default_factory=dict)  # KernelKey -> (effective ns, op) for --explain

    def total(self, phase: Phase) -> float:
        return self.compute_ns[phase] + self.tp_comm_ns[phase]


@dataclass(frozen=True, slots=True)
class Costing:
    work: PipelineWork
    measured_kernel_ns: float  # per iteration on the representative ranks, all stages
    kernel_ns: float
    modeled_kernels: tuple[tuple[float, OpNode], ...]  # (total ns per iteration, op), largest first


class _Coster:
    def __init__(self, graph: OpGraph, timer: KernelTimer, comm: CommModel) -> None:
        self.graph = graph
        self.timer = timer
        self.comm = comm
        self._blocks: dict[int, BlockCost] = {}

    def block(self, block: Block, pipeline_rank: int) -> BlockCost:
        """Cost of one instance of ``block``; blocks shared between stages are costed once."""
        key = (id(block.nodes), pipeline_rank if _has_placement_dependent(block) else -1)
        cached = self._blocks.get(key)
        if cached is not None:
            return cached
        cost = BlockCost()
        for node in block.nodes:
            if isinstance(node, OpNode):
                if not node.launches_kernel:
                    continue
                t = self.timer.time(node)
                cost.compute_ns[node.phase] += t.effective_ns
                if t.source is Source.MEASURED:
                    cost.measured_ns[node.phase] += t.effective_ns
                else:
                    previous = cost.largest_modeled.get(node.key)
                    cost.largest_modeled[node.key] = ((previous[0] if previous else 0.0) + t.effective_ns, node)
            elif node.group is ParallelGroup.TP:
                cost.tp_comm_ns[node.phase] += self.comm.time_ns(node.kind, node.nbytes, node.group,
                                                                 pipeline_rank=pipeline_rank)
            elif node.group is ParallelGroup.DP:
                cost.dp_grad_nbytes += node.nbytes
            elif node.group is ParallelGroup.EMBEDDING:
                cost.embedding_sync += (node,)
        self._blocks[key] = cost
        return cost


def _has_placement_dependent(block: Block) -> bool:
    return block.kind is BlockKind.P2P


def cost_graph(graph: OpGraph, *, timer: KernelTimer, comm: CommModel, training: TrainingSpec,
               num_microbatches: int) -> Costing:
    pp = graph.parallel["pipeline_parallel"]
    vp = graph.parallel["virtual_pipeline"]
    coster = _Coster(graph, timer, comm)
    chunks: list[ChunkWork] = []
    optimizer = [0.0] * pp
    measured = kernel = 0.0
    modeled: dict = {}
    embedding_sync_ns = 0.0
    ordered = sorted(graph.stages, key=lambda s: s.chunk * pp + s.pipeline_rank)
    for stage in ordered:
        work, opt_ns, stage_measured, stage_kernel, sync_ns = _chunk_work(
            stage, coster, comm, training, num_microbatches, modeled)
        chunks.append(work)
        optimizer[stage.pipeline_rank] += opt_ns
        measured += stage_measured
        kernel += stage_kernel
        embedding_sync_ns = max(embedding_sync_ns, sync_ns)
    pipeline = PipelineWork(
        chunks=tuple(chunks), pipeline_parallel=pp, virtual_pipeline=vp, num_microbatches=num_microbatches,
        schedule=training.schedule, dp_overlap=training.grad_reduce is GradReduce.OVERLAP,
        embedding_sync_ns=embedding_sync_ns, optimizer_ns=tuple(optimizer))
    largest = tuple(sorted(modeled.values(), key=lambda x: -x[0]))
    return Costing(work=pipeline, measured_kernel_ns=measured, kernel_ns=kernel, modeled_kernels=largest)


def _chunk_work(stage: StageGraph, coster: _Coster, comm: CommModel, training: TrainingSpec,
                num_microbatches: int, modeled: dict) -> tuple[ChunkWork, float, float, float, float]:
    rank = stage.pipeline_rank
    totals = dict.fromkeys(_PHASES, 0.0)
    tp = dict.fromkeys(_PHASES, 0.0)
    measured = kernel = 0.0
    p2p_forward = p2p_backward = 0.0
    sync_ns = 0.0
    backward_order: list[tuple[float, int, int]] = []  # (backward ns incl. recompute, grad bytes, count)
    for block in stage.blocks:
        cost = coster.block(block, rank)
        n = block.count
        for phase in _PHASES:
            totals[phase] += n * cost.total(phase)
            tp[phase] += n * cost.tp_comm_ns[phase]
        for phase in _PHASES:  # per iteration: the optimizer runs once, the rest per micro-batch
            runs = n * (1 if phase is Phase.OPTIMIZER else num_microbatches)
            measured += runs * cost.measured_ns[phase]
            kernel += runs * cost.compute_ns[phase]
        for key, (ns, op) in cost.largest_modeled.items():
            previous = modeled.get(key)
            runs = n * (1 if op.phase is Phase.OPTIMIZER else num_microbatches)
            modeled[key] = ((previous[0] if previous else 0.0) + runs * ns, op)
        for node in cost.embedding_sync:
            sync_ns = max(sync_ns, comm.time_ns(node.kind, node.nbytes, node.group, pipeline_rank=rank))
        if block.kind is BlockKind.P2P:
            for node in block.collectives():
                if node.kind is CollectiveKind.SEND:
                    ns = comm.time_ns(node.kind, node.nbytes, node.group, pipeline_rank=rank)
                    if node.phase is Phase.FORWARD:
                        p2p_forward = ns
                    else:
                        p2p_backward = ns
        backward_order.append((cost.total(Phase.BACKWARD) + cost.total(Phase.RECOMPUTE), cost.dp_grad_nbytes, n))
    work = ChunkWork(
        forward_ns=totals[Phase.FORWARD], backward_ns=totals[Phase.BACKWARD],
        recompute_ns=totals[Phase.RECOMPUTE], tp_comm_forward_ns=tp[Phase.FORWARD],
        tp_comm_backward_ns=tp[Phase.BACKWARD] + tp[Phase.RECOMPUTE],
        p2p_forward_ns=p2p_forward, p2p_backward_ns=p2p_backward,
        dp_buckets=_dp_buckets(backward_order, comm, training, rank))
    return work, totals[Phase.OPTIMIZER], measured, kernel, sync_ns


def _dp_buckets(blocks: list[tuple[float, int, int]], comm: CommModel, training: TrainingSpec,
                rank: int) -> tuple[DpBucket, ...]:
    """Gradient buckets in backward order (blocks reversed), each ready when its last layer's
    backward is done. Without overlap, Megatron-DeepSpeed reduces all gradients in one message."""
    total_grad = sum(nbytes * n for _, nbytes, n in blocks)
    if total_grad == 0:
        return ()
    if training.grad_reduce is GradReduce.AFTER_BACKWARD:
        return (DpBucket(comm_ns=comm.time_ns(CollectiveKind.ALL_REDUCE, total_grad, ParallelGroup.DP,
                                              pipeline_rank=rank), ready_fraction=1.0),)
    total_time = sum(t * n for t, _, n in blocks) or 1.0
    buckets: list[DpBucket] = []
    pending = 0
    elapsed = 0.0
    limit = training.bucket_nbytes
    for t, nbytes, n in reversed(blocks):
        for _ in range(n):
            elapsed += t
            pending += nbytes
            if pending >= limit:
                buckets.append(_bucket(pending, elapsed / total_time, comm, rank))
                pending = 0
    if pending:
        buckets.append(_bucket(pending, 1.0, comm, rank))
    return tuple(buckets)


def _bucket(nbytes: int, ready: float, comm: CommModel, rank: int) -> DpBucket:
    return DpBucket(comm_ns=comm.time_ns(CollectiveKind.ALL_REDUCE, nbytes, ParallelGroup.DP, pipeline_rank=rank),
                    ready_fraction=min(1.0, ready))
