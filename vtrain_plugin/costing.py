"""From a traced graph to the simulation's input: per-chunk, per-phase durations of one micro-batch.

This is where the hundreds of kernels of a layer are summed, once per estimate, into forward,
backward, recompute and optimizer durations (DESIGN.md, performance rules). It happens in two steps:

1. :func:`prepare_graph` maps each block's ops onto the kernels of the software stack
   (:mod:`profiler.software_stack`) and lays every block's phases out as segments of one
   :class:`~profiler.kernel_model.KernelBatch` per stage, with the measured durations looked up.
   This walks every node once; it depends on the graph, the stack and the profile, not on the device
   constants or the cluster.
2. :func:`cost_prepared` times all kernels of a stage with a few array operations and folds them
   into the chunks' durations. Calibration prepares each run once and re-costs it per candidate set
   of device constants; an estimate does both steps once.

Within one phase of a task, the CPU issues kernels and the GPU runs them as an in-order two-stage
pipeline (:func:`profiler.kernel_model.pipeline_ns`); on a device whose host runs the kernels itself
(``DeviceSpec.host_runs_kernels``, the CPU) the two simply add up. A segment (one phase of one block instance) is
summarised by its host total ``H``, device total ``D`` and pipelined time ``P``; ``n`` repetitions of
a layer take ``P + (n-1) max(H, D)``, and a segment followed by another takes
``max(P1 + D2, H1 + P2)``, so a phase of a chunk is timed exactly without expanding its layers. Each
task (a forward, a recompute, a backward of one micro-batch on one chunk) starts with the pipeline
empty, as after Megatron's synchronisation around pipeline transfers.

Tensor-parallel collectives block the compute stream (Megatron without TP overlap) and enter the
pipeline in place, with one kernel's host cost; data-parallel gradients are grouped into buckets
whose readiness follows the backward order; pipeline transfers and the tied-embedding
synchronisation are timed by the comm model. Each forward task also pays the device's
``microbatch_overhead_ns`` of host work outside the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from profiler.kernel_model import KernelBatch
from profiler.software_stack import SoftwareStack, map_nodes
from vtrain_plugin.comm.model import CommModel
from vtrain_plugin.graph import (BlockKind, CollectiveKind, CollectiveNode, KernelKey, OpGraph, OpNode,
                                 ParallelGroup, Phase, StageGraph)
from vtrain_plugin.sim.work import ChunkWork, DpBucket, PipelineWork
from vtrain_plugin.timing import KernelTimer
from vtrain_plugin.training import GradReduce, TrainingSpec

_PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE, Phase.OPTIMIZER)
_NO_KERNEL_KEY = KernelKey(op="aten.empty.memory_format", input_shapes=(), dtypes=())  # collective rows


@dataclass(frozen=True, slots=True)
class _Segment:
    """One phase of one block instance: rows ``[start, stop)`` of its stage's kernel batch."""

    block: int  # index in the stage's blocks
    phase: Phase
    start: int
    stop: int
    count: int  # instances of the block (layers of a folded template)


@dataclass(frozen=True, slots=True)
class PreparedStage:
    stage: StageGraph
    kernels: KernelBatch  # every segment's kernels in order; collectives are rows of kind NONE
    measured_ns: np.ndarray  # per row, NaN where unmeasured
    nodes: tuple[OpNode | None, ...]  # per row (None for a collective)
    tp_rows: tuple[tuple[int, CollectiveNode], ...]  # rows holding blocking TP collectives
    segments: tuple[_Segment, ...]  # blocks in stage order, phases in _PHASES order
    dp_grad_nbytes: tuple[int, ...]  # per block instance
    embedding_sync: tuple[CollectiveNode, ...]
    sends: tuple[CollectiveNode, ...]  # pipeline sends (forward activation, backward gradient)


@dataclass(frozen=True, slots=True)
class PreparedGraph:
    graph: OpGraph
    stack: SoftwareStack
    stages: tuple[PreparedStage, ...]  # in virtual-stage order (chunk * pp + pipeline_rank)
    flops: dict[Phase, int]  # of one micro-batch through every chunk, on one tensor-parallel rank


@dataclass(frozen=True, slots=True)
class Costing:
    work: PipelineWork
    measured_kernel_ns: float  # per iteration on the representative ranks, all stages
    kernel_ns: float
    modeled_kernels: tuple[tuple[float, OpNode], ...]  # (total ns per iteration, op), largest first
    flops: dict[Phase, int]  # of one micro-batch through every chunk, on one tensor-parallel rank


def prepare_graph(graph: OpGraph, timer: KernelTimer, stack: SoftwareStack | str) -> PreparedGraph:
    pp = graph.parallel["pipeline_parallel"]
    ordered = sorted(graph.stages, key=lambda s: s.chunk * pp + s.pipeline_rank)
    flops = dict.fromkeys(_PHASES, 0)
    for stage in ordered:
        for phase in _PHASES:
            flops[phase] += stage.flops(phase)
    stack = SoftwareStack(stack)
    return PreparedGraph(graph=graph, stack=stack, stages=tuple(_prepare_stage(s, timer, stack) for s in ordered),
                         flops=flops)


def _prepare_stage(stage: StageGraph, timer: KernelTimer, stack: SoftwareStack) -> PreparedStage:
    rows: list[OpNode | None] = []
    phases: list[Phase] = []
    tp_rows: list[tuple[int, CollectiveNode]] = []
    segments: list[_Segment] = []
    grads: list[int] = []
    sync: list[CollectiveNode] = []
    sends: list[CollectiveNode] = []
    for b, block in enumerate(stage.blocks):
        nodes = map_nodes(block.nodes, stack)
        by_phase: dict[Phase, list[OpNode | CollectiveNode]] = {p: [] for p in _PHASES}
        grad = 0
        for node in nodes:
            if isinstance(node, OpNode):
                if node.launches_kernel:
                    by_phase[node.phase].append(node)
            elif node.group is ParallelGroup.TP:
                by_phase[node.phase].append(node)
            elif node.group is ParallelGroup.DP:
                grad += node.nbytes
            elif node.group is ParallelGroup.EMBEDDING:
                sync.append(node)
            elif block.kind is BlockKind.P2P and node.kind is CollectiveKind.SEND:
                sends.append(node)
        grads.append(grad)
        for phase in _PHASES:
            start = len(rows)
            for node in by_phase[phase]:
                if isinstance(node, CollectiveNode):
                    tp_rows.append((len(rows), node))
                    rows.append(None)
                else:
                    rows.append(node)
                phases.append(phase)
            segments.append(_Segment(block=b, phase=phase, start=start, stop=len(rows), count=block.count))
    placeholder = OpNode(key=_NO_KERNEL_KEY, phase=Phase.FORWARD, module="", launches_kernel=False)
    kernels = KernelBatch.of([n if n is not None else placeholder for n in rows])
    backward = np.array([p is Phase.BACKWARD for p in phases], bool)
    kernels = KernelBatch(kind=kernels.kind, dtype=kernels.dtype, flops=kernels.flops, nbytes=kernels.nbytes,
                          batch=kernels.batch, m=kernels.m, n=kernels.n, k=kernels.k, backward=backward)
    return PreparedStage(stage=stage, kernels=kernels, measured_ns=timer.measured_ns(rows), nodes=tuple(rows),
                         tp_rows=tuple(tp_rows), segments=tuple(segments), dp_grad_nbytes=tuple(grads),
                         embedding_sync=tuple(sync), sends=tuple(sends))


def cost_graph(graph: OpGraph, *, timer: KernelTimer, comm: CommModel, training: TrainingSpec,
               num_microbatches: int, explain: bool = False) -> Costing:
    prepared = prepare_graph(graph, timer, training.software_stack)
    return cost_prepared(prepared, timer=timer, comm=comm, training=training, num_microbatches=num_microbatches,
                         explain=explain)


def cost_prepared(prepared: PreparedGraph, *, timer: KernelTimer, comm: CommModel, training: TrainingSpec,
                  num_microbatches: int, explain: bool = False) -> Costing:
    """Cost a prepared graph with ``timer``'s device constants (``explain``: list modeled kernels)."""
    graph = prepared.graph
    pp = graph.parallel["pipeline_parallel"]
    vp = graph.parallel["virtual_pipeline"]
    chunks: list[ChunkWork] = []
    optimizer = [0.0] * pp
    measured = kernel = 0.0
    modeled: dict = {}
    embedding_sync_ns = 0.0
    for prepared_stage in prepared.stages:
        work, opt_ns, stage_measured, stage_kernel, sync_ns = _chunk_work(
            prepared_stage, timer, comm, training, num_microbatches, modeled if explain else None)
        chunks.append(work)
        optimizer[prepared_stage.stage.pipeline_rank] += opt_ns
        measured += stage_measured
        kernel += stage_kernel
        embedding_sync_ns = max(embedding_sync_ns, sync_ns)
    pipeline = PipelineWork(
        chunks=tuple(chunks), pipeline_parallel=pp, virtual_pipeline=vp, num_microbatches=num_microbatches,
        schedule=training.schedule, dp_overlap=training.grad_reduce is GradReduce.OVERLAP,
        embedding_sync_ns=embedding_sync_ns, optimizer_ns=tuple(optimizer))
    largest = tuple(sorted(modeled.values(), key=lambda x: -x[0]))
    return Costing(work=pipeline, measured_kernel_ns=measured, kernel_ns=kernel, modeled_kernels=largest,
                   flops=dict(prepared.flops))


def _chunk_work(prepared: PreparedStage, timer: KernelTimer, comm: CommModel, training: TrainingSpec,
                num_microbatches: int, modeled: dict | None) -> tuple[ChunkWork, float, float, float, float]:
    stage = prepared.stage
    rank = stage.pipeline_rank
    constants = timer.constants
    device = timer.device_ns(prepared.kernels, prepared.measured_ns)
    host = timer.host_ns(prepared.kernels)
    is_comm = np.zeros(len(device), bool)
    for row, node in prepared.tp_rows:
        device[row] = comm.time_ns(node.kind, node.nbytes, node.group, pipeline_rank=rank)
        host[row] = constants.backward_host_overhead_ns if node.phase is Phase.BACKWARD else constants.host_overhead_ns
        is_comm[row] = True
    if timer.device.host_runs_kernels:  # a CPU issues and runs each op: no overlap to model
        device, host = device + host, np.zeros_like(host)
    segments = prepared.segments
    h, d, p = _segment_times(host, device, segments)
    comm_ns = _segment_sums(np.where(is_comm, device, 0.0), segments)
    measured_rows = ~np.isnan(prepared.measured_ns)
    kernel_ns = _segment_sums(np.where(is_comm, 0.0, device), segments)
    measured_ns = _segment_sums(np.where(measured_rows, device, 0.0), segments)

    num_blocks = len(stage.blocks)
    index = {(s.block, s.phase): i for i, s in enumerate(segments)}

    def phase_time(phase: Phase, blocks: Sequence[int]) -> float:
        return _sequence((h[index[b, phase]], d[index[b, phase]], p[index[b, phase]], stage.blocks[b].count)
                         for b in blocks)

    def recompute_then_backward(b: int) -> tuple[float, float, float, int]:
        """One layer's recompute followed by its backward, as one pipelined unit."""
        r, k = index[b, Phase.RECOMPUTE], index[b, Phase.BACKWARD]
        unit_p = max(p[r] + d[k], h[r] + p[k]) if p[r] and p[k] else p[r] + p[k]
        return h[r] + h[k], d[r] + d[k], unit_p, stage.blocks[b].count

    forward_order = range(num_blocks)
    backward_order = range(num_blocks - 1, -1, -1)
    totals = {Phase.FORWARD: phase_time(Phase.FORWARD, forward_order),
              Phase.BACKWARD: phase_time(Phase.BACKWARD, backward_order),
              Phase.RECOMPUTE: phase_time(Phase.RECOMPUTE, backward_order),
              Phase.OPTIMIZER: phase_time(Phase.OPTIMIZER, forward_order)}
    # Activation checkpointing recomputes each layer right before its backward, so the host's work
    # on one layer's recompute overlaps the device's work on the previous layer's backward: the
    # backward task is one pipeline over (recompute, backward) units; its time is split between the
    # two in proportion to their stand-alone times for the breakdown.
    combined = _sequence(recompute_then_backward(b) for b in backward_order)
    alone = totals[Phase.RECOMPUTE] + totals[Phase.BACKWARD]
    if alone:
        totals[Phase.RECOMPUTE] = combined * totals[Phase.RECOMPUTE] / alone
        totals[Phase.BACKWARD] = combined - totals[Phase.RECOMPUTE]
    tp = dict.fromkeys(_PHASES, 0.0)
    measured = kernel = 0.0
    for i, s in enumerate(segments):
        tp[s.phase] += s.count * comm_ns[i]
        runs = s.count * (1 if s.phase is Phase.OPTIMIZER else num_microbatches)
        measured += runs * measured_ns[i]
        kernel += runs * kernel_ns[i]
        if modeled is not None:
            for row in range(s.start, s.stop):
                node = prepared.nodes[row]
                if node is not None and not measured_rows[row]:
                    previous = modeled.get(node.key)
                    modeled[node.key] = ((previous[0] if previous else 0.0) + runs * device[row], node)
    sync_ns = max((comm.time_ns(n.kind, n.nbytes, n.group, pipeline_rank=rank) for n in prepared.embedding_sync),
                  default=0.0)
    p2p = {Phase.FORWARD: 0.0, Phase.BACKWARD: 0.0}
    for node in prepared.sends:
        p2p[node.phase] = comm.time_ns(node.kind, node.nbytes, node.group, pipeline_rank=rank)
    per_block = [(max(h[index[b, Phase.BACKWARD]], d[index[b, Phase.BACKWARD]])
                  + max(h[index[b, Phase.RECOMPUTE]], d[index[b, Phase.RECOMPUTE]]),
                  prepared.dp_grad_nbytes[b], stage.blocks[b].count) for b in range(num_blocks)]
    work = ChunkWork(
        forward_ns=totals[Phase.FORWARD] + constants.microbatch_overhead_ns, backward_ns=totals[Phase.BACKWARD],
        recompute_ns=totals[Phase.RECOMPUTE], tp_comm_forward_ns=tp[Phase.FORWARD],
        tp_comm_backward_ns=tp[Phase.BACKWARD] + tp[Phase.RECOMPUTE],
        p2p_forward_ns=p2p[Phase.FORWARD], p2p_backward_ns=p2p[Phase.BACKWARD],
        dp_buckets=_dp_buckets(per_block, comm, training, rank))
    return work, totals[Phase.OPTIMIZER], measured, kernel, sync_ns


def _segment_sums(values: np.ndarray, segments: Sequence[_Segment]) -> np.ndarray:
    c = np.concatenate(([0.0], np.cumsum(values)))
    starts = np.fromiter((s.start for s in segments), int, len(segments))
    stops = np.fromiter((s.stop for s in segments), int, len(segments))
    return c[stops] - c[starts]


def _segment_times(host: np.ndarray, device: np.ndarray, segments: Sequence[_Segment]
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per segment: host total, device total and the two-stage pipeline time of its kernels.

    ``P = max_k (sum_{i<=k} host_i + sum_{i>=k} device_i)`` over the segment's rows; with global
    prefix sums that is ``max_i (CH_i - CD_{i-1}) - CH_{start-1} + CD_{stop-1}``.
    """
    ch = np.concatenate(([0.0], np.cumsum(host)))
    cd = np.concatenate(([0.0], np.cumsum(device)))
    starts = np.fromiter((s.start for s in segments), int, len(segments))
    stops = np.fromiter((s.stop for s in segments), int, len(segments))
    h = ch[stops] - ch[starts]
    d = cd[stops] - cd[starts]
    p = np.zeros(len(segments))
    nonempty = stops > starts
    if nonempty.any() and len(host):
        value = ch[1:] - cd[:-1]  # CH_i - CD_{i-1} for row i (inclusive prefix of host)
        peak = np.maximum.reduceat(value, starts[nonempty])
        p[nonempty] = peak - ch[starts[nonempty]] + cd[stops[nonempty]]
    return h, d, p


def _sequence(parts) -> float:
    """Pipelined time of segments run one after another, each repeated ``n`` times."""
    total_h = total_d = total_p = 0.0
    for h, d, p, n in parts:
        if n == 0 or p == 0.0:
            continue
        rep_h, rep_d, rep_p = n * h, n * d, p + (n - 1) * max(h, d)
        total_p = max(total_p + rep_d, total_h + rep_p)
        total_h += rep_h
        total_d += rep_d
    return total_p


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
