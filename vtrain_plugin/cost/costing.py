"""``cost()``: a prepared graph timed on one device and cluster, as the simulation's input.

This is where the hundreds of kernels of a layer are summed, once per estimate, into forward,
backward, recompute and optimizer durations per chunk (:class:`ChunkWork`), with a few array
operations per stage: kernel times (:mod:`vtrain_plugin.cost.kernels.timer`), the host/device pipeline
(:mod:`vtrain_plugin.cost.kernels.host_device`), tensor- and context-parallel collectives timed by the comm
model and entering the pipeline in place with ``collective_host_overhead_ns`` of host cost (a kernel's
when that is not modelled), blocking with their whole time or, when they run beside a kernel
(:mod:`vtrain_plugin.cost.comm.overlap`: CP ring steps, and TP collectives under
``training.tp_comm_overlap``), with what that kernel cannot hide, gradient buckets
(:mod:`vtrain_plugin.cost.comm.dp_buckets`; with the distributed optimizer Megatron-Core's reduce-scatter
and all-gather buckets), pipeline transfers and the tied-embedding synchronisation.
Each task (a forward, a recompute, a backward of one micro-batch on one chunk) starts with the
pipeline empty, as after Megatron's synchronisation around pipeline transfers, and each forward also
pays ``microbatch_overhead_ns`` of host work outside the model. Host time is spent per kernel
(the timer's), per module call and per layer (:func:`vtrain_plugin.cost.prepare.host_calls`). Activation checkpointing recomputes
each layer right before its backward, so one layer's recompute and backward form one pipelined unit;
the task's time is split between the two in proportion to their stand-alone times for the breakdown.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import ParallelGroup, Phase
from vtrain_plugin.cost.comm.collectives import CommModel
from vtrain_plugin.cost.comm.overlap import exposed_ns
from vtrain_plugin.cost.comm.dp_buckets import BlockGradients, ZeroRuntime, dp_buckets, zero_buckets
from vtrain_plugin.cost.kernels.host_device import SegmentTime, segment_sums, segment_times, sequence, then
from vtrain_plugin.cost.kernels.timer import KernelTimer
from vtrain_plugin.cost.comm.moe_dispatch import MOE_GROUPS
from vtrain_plugin.cost.prepare import PHASES, PreparedGraph, PreparedStage
from vtrain_plugin.cost.provenance import Provenance, StageProvenance, stage_provenance
from vtrain_plugin.cost.work import ChunkWork, DpBucket, ParamGather, PipelineWork
from vtrain_plugin.specs.training import GradReduce, TrainingSpec


@dataclass(frozen=True, slots=True)
class Costing:
    work: PipelineWork
    provenance: Provenance
    flops: dict[Phase, int]  # of one micro-batch through every chunk, on one tensor-parallel rank


@dataclass(frozen=True, slots=True)
class StageCost:
    """One chunk's work per micro-batch, its share of the optimizer step and its tied-embedding sync."""

    work: ChunkWork
    optimizer_ns: float
    embedding_sync_ns: float
    provenance: StageProvenance


def cost(prepared: PreparedGraph, *, timer: KernelTimer, comm: CommModel, training: TrainingSpec,
         num_microbatches: int, explain: bool = False) -> Costing:
    """Time ``prepared`` with ``timer``'s device constants (``explain``: list the modeled kernels)."""
    parallel = prepared.graph.parallel
    training.check_plan(parallel)
    pp = parallel.pipeline_parallel
    if prepared.distributed_optimizer != training.distributed_optimizer:
        raise ConfigError(f"the graph was prepared with distributed_optimizer={prepared.distributed_optimizer}, "
                          f"the training spec says {training.distributed_optimizer}")
    provenance = Provenance()
    chunks: list[ChunkWork] = []
    optimizer = [0.0] * pp
    embedding_sync_ns = 0.0
    placements = comm.rank_signatures()
    costed: dict[tuple, StageCost] = {}  # stages of one role whose ranks time every collective alike
    for stage in prepared.stages:
        rank = stage.stage.pipeline_rank
        chunk = stage.stage.chunk
        # Megatron-Core buckets the gradients of the first chunk of the first rank alone and
        # groups those of later chunks: the same role costs differently there.
        key = (id(stage.role), id(stage.runtime), placements[rank], rank == 0 and chunk == 0, chunk > 0)
        staged = costed.get(key)
        if staged is None:
            staged = costed[key] = _stage_cost(stage, timer, comm, training, num_microbatches, explain)
        provenance.add(staged.provenance)
        chunks.append(staged.work)
        optimizer[rank] += staged.optimizer_ns
        embedding_sync_ns = max(embedding_sync_ns, staged.embedding_sync_ns)
    work = PipelineWork(
        chunks=tuple(chunks), pipeline_parallel=pp, virtual_pipeline=parallel.virtual_pipeline,
        num_microbatches=num_microbatches, schedule=training.schedule,
        microbatch_group_size=training.microbatch_group_size,
        dp_overlap=training.grad_reduce is GradReduce.OVERLAP, param_gather_overlap=training.overlap_param_gather,
        embedding_sync_ns=embedding_sync_ns, optimizer_ns=tuple(optimizer))
    return Costing(work=work, provenance=provenance, flops=dict(prepared.flops))


def _stage_cost(prepared: PreparedStage, timer: KernelTimer, comm: CommModel, training: TrainingSpec,
                num_microbatches: int, explain: bool) -> StageCost:
    stage, role = prepared.stage, prepared.role
    rank = stage.pipeline_rank
    constants = timer.constants
    device, host = timer.times_ns(role.kernels, role.measured_ns)
    host += constants.module_host_overhead_ns * role.module_calls + constants.layer_host_overhead_ns * role.layer_calls
    is_comm = np.zeros(len(device), bool)
    is_cp = np.zeros(len(device), bool)
    is_ep = np.zeros(len(device), bool)
    for c in role.comm_rows:
        node = c.node
        comm_ns = comm.time_ns(node.kind, node.nbytes, node.group, pipeline_rank=rank)
        on_cp = node.group is ParallelGroup.CP
        # CP and MoE partners exist only where they overlap; TP ones with TE's userbuffers.
        overlapped = c.partner >= 0 and (on_cp or node.group in MOE_GROUPS or training.tp_comm_overlap)
        device[c.row] = exposed_ns(comm_ns, device[c.partner]) if overlapped else comm_ns
        host[c.row] = constants.collective_host_overhead_ns or (
            constants.backward_host_overhead_ns if node.phase is Phase.BACKWARD else constants.host_overhead_ns)
        is_comm[c.row] = True
        is_cp[c.row] = on_cp
        is_ep[c.row] = node.group in MOE_GROUPS
    if timer.device.host_runs_kernels:  # a CPU issues and runs each op: no overlap to model
        device, host = device + host, np.zeros_like(host)
    segments = role.segments
    h, d, p = segment_times(host, device, segments)
    tp_comm = segment_sums(np.where(is_comm & ~is_cp & ~is_ep, device, 0.0), segments)
    cp_comm = segment_sums(np.where(is_cp, device, 0.0), segments)
    ep_comm = segment_sums(np.where(is_ep, device, 0.0), segments)
    provenance = stage_provenance(role, device, is_comm, num_microbatches, track_modeled=explain)

    index = {(s.block, s.phase): i for i, s in enumerate(segments)}
    blocks = stage.blocks

    def time(b: int, phase: Phase) -> SegmentTime:
        i = index[b, phase]
        return SegmentTime(host_ns=h[i], device_ns=d[i], pipelined_ns=p[i], count=blocks[b].count)

    forward_order = range(len(blocks))
    backward_order = range(len(blocks) - 1, -1, -1)
    totals = {Phase.FORWARD: sequence(time(b, Phase.FORWARD) for b in forward_order),
              Phase.BACKWARD: sequence(time(b, Phase.BACKWARD) for b in backward_order),
              Phase.RECOMPUTE: sequence(time(b, Phase.RECOMPUTE) for b in backward_order),
              Phase.OPTIMIZER: sequence(time(b, Phase.OPTIMIZER) for b in forward_order)}
    combined = sequence(then(time(b, Phase.RECOMPUTE), time(b, Phase.BACKWARD)) for b in backward_order)
    alone = totals[Phase.RECOMPUTE] + totals[Phase.BACKWARD]
    if alone:
        totals[Phase.RECOMPUTE] = combined * totals[Phase.RECOMPUTE] / alone
        totals[Phase.BACKWARD] = combined - totals[Phase.RECOMPUTE]
    tp = dict.fromkeys(PHASES, 0.0)
    cp = dict.fromkeys(PHASES, 0.0)
    ep = dict.fromkeys(PHASES, 0.0)
    for i, s in enumerate(segments):
        tp[s.phase] += s.count * tp_comm[i]
        cp[s.phase] += s.count * cp_comm[i]
        ep[s.phase] += s.count * ep_comm[i]

    runtime = prepared.runtime
    sync_ns = max((comm.time_ns(n.kind, n.nbytes, n.group, pipeline_rank=rank) for n in runtime.embedding_sync),
                  default=0.0)
    p2p = {Phase.FORWARD: 0.0, Phase.BACKWARD: 0.0}
    for node in runtime.sends:
        p2p[node.phase] = comm.time_ns(node.kind, node.nbytes, node.group, pipeline_rank=rank)
    backward_ns = [_busy(time(b, Phase.BACKWARD)) + _busy(time(b, Phase.RECOMPUTE)) for b in range(len(blocks))]
    forward_ns = [_busy(time(b, Phase.FORWARD)) for b in range(len(blocks))]
    gradients = [BlockGradients(backward_ns=backward_ns[b], grad_nbytes=runtime.dp_grad_nbytes[b], count=blocks[b].count,
                                forward_ns=forward_ns[b], param_numels=blocks[b].parameter_sizes,
                                gather_nbytes=runtime.gather_nbytes(blocks[b], blocks[b].parameter_sizes))
                 for b in range(len(blocks))]
    expert_gradients = [BlockGradients(backward_ns=backward_ns[b], grad_nbytes=runtime.expert_dp_grad_nbytes[b],
                                       count=blocks[b].count, forward_ns=forward_ns[b],
                                       param_numels=blocks[b].expert_parameter_numels,
                                       gather_nbytes=runtime.gather_nbytes(blocks[b], blocks[b].expert_parameter_numels))
                        for b in range(len(blocks))]
    reduces, gathers = _gradient_buckets(gradients, prepared, comm, training, ParallelGroup.DP)
    expert_reduces, expert_gathers = _gradient_buckets(expert_gradients, prepared, comm, training,
                                                       ParallelGroup.EXPERT_DP)
    work = ChunkWork(
        forward_ns=totals[Phase.FORWARD] + constants.microbatch_overhead_ns, backward_ns=totals[Phase.BACKWARD],
        recompute_ns=totals[Phase.RECOMPUTE], tp_comm_forward_ns=tp[Phase.FORWARD],
        tp_comm_backward_ns=tp[Phase.BACKWARD] + tp[Phase.RECOMPUTE], cp_comm_forward_ns=cp[Phase.FORWARD],
        cp_comm_backward_ns=cp[Phase.BACKWARD] + cp[Phase.RECOMPUTE], ep_comm_forward_ns=ep[Phase.FORWARD],
        ep_comm_backward_ns=ep[Phase.BACKWARD] + ep[Phase.RECOMPUTE],
        p2p_forward_ns=p2p[Phase.FORWARD], p2p_backward_ns=p2p[Phase.BACKWARD],
        dp_buckets=sorted(reduces + expert_reduces, key=lambda b: b.ready_fraction),
        param_gathers=sorted(gathers + expert_gathers, key=lambda g: g.need_fraction))
    return StageCost(work=work, optimizer_ns=totals[Phase.OPTIMIZER], embedding_sync_ns=sync_ns,
                     provenance=provenance)


def _gradient_buckets(gradients: Sequence[BlockGradients], prepared: PreparedStage, comm: CommModel,
                      training: TrainingSpec, group: ParallelGroup
                      ) -> tuple[tuple[DpBucket, ...], tuple[ParamGather, ...]]:
    """The stage's gradient reductions over ``group`` (DP, or expert DP for the parameters of experts
    split by expert parallelism: Megatron-Core's DDP keeps them in buffers of their own) and, with
    the distributed optimizer, its parameter all-gathers."""
    runtime, stage = prepared.runtime, prepared.stage
    if runtime.distributed_optimizer and runtime.group_size(group) > 1:
        zero = ZeroRuntime.of(runtime, pipeline_rank=stage.pipeline_rank, chunk=stage.chunk, group=group)
        return zero_buckets(gradients, comm, training, zero)
    return dp_buckets(gradients, comm, training, stage.pipeline_rank, group), ()


def _busy(t: SegmentTime) -> float:
    """Steady-state time of one instance: the busier of host and device."""
    return max(t.host_ns, t.device_ns)
