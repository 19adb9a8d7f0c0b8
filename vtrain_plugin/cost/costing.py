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
pays ``microbatch_overhead_ns`` of host work outside the model, and each pipeline rank's optimizer
step ``iteration_overhead_ns`` (the loop's host work and synchronisations, once per iteration). Under CUDA graphs the captured
kernels cost the host one graph launch per region (:mod:`vtrain_plugin.cost.cuda_graphs`). Host time is spent per kernel
(the timer's), per module call and per layer (:func:`vtrain_plugin.cost.prepare.host_calls`), per
module call under DDP's parameter-gather hooks (:mod:`vtrain_plugin.cost.ddp_hooks`), every
host cost times the node's ``host_time_factor``. Where megatron-core's MoE dispatch reads token counts
back, the host waits for the device (:mod:`vtrain_plugin.cost.host_syncs`) and the host cost after it
is exposed. Activation offloading (:mod:`vtrain_plugin.cost.activation_offload`) adds, per layer, the
host-link copy time its forward cannot hide and the reloads its backward waits for. Activation checkpointing recomputes
each layer right before its backward, so one layer's recompute and backward form one pipelined unit;
the task's time is split between the two in proportion to their stand-alone times for the breakdown.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import CP_GROUPS, Block, CollectiveKind, ParallelGroup, Phase
from vtrain_plugin.cost.activation_offload import exposed_copy_ns, exposed_reload_ns, offload_groups, offloaded_by_module
from vtrain_plugin.cost.comm.collectives import CommModel
from vtrain_plugin.cost.lowering.fp8 import quantisation
from vtrain_plugin.cost.comm.overlap import exposed_ns
from vtrain_plugin.cost.comm.ep_overlap import OverlapParts, pair_saving_ns, steady_pairs
from vtrain_plugin.cost.cuda_graphs import graphed, graphed_host_ns
from vtrain_plugin.cost.ddp_hooks import PRE_HOOK_NS, forward_pre_hooks, hook_calls
from vtrain_plugin.cost.comm.dp_buckets import BlockGradients, ZeroRuntime, dp_buckets, zero_buckets
from vtrain_plugin.cost.comm.fsdp import FsdpUnit, exposed_per_microbatch, prefetch_units
from vtrain_plugin.cost.host_syncs import all_to_all_rows, dispatch_waits, host_copy_rows
from vtrain_plugin.cost.step_checks import gc_host_factor, gc_step_ns, holds_loss, loss_pieces, pieces_ns, step_pieces
from vtrain_plugin.cost.kernels.host_device import (SegmentTime, segment_sums, segment_times, sequence, split_times,
                                                     then)
from vtrain_plugin.cost.kernels.op_classes import OpClass, classify
from vtrain_plugin.cost.kernels.timer import KernelTimer
from vtrain_plugin.cost.comm.moe_dispatch import MOE_GROUPS
from vtrain_plugin.cost.prepare import PHASES, PreparedGraph, PreparedStage
from vtrain_plugin.cost.provenance import Provenance, StageProvenance, counted_provenance, stage_provenance
from vtrain_plugin.cost.work import ChunkWork, DpBucket, ParamGather, PipelineWork
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import GradReduce, SoftwareStack, TrainingSpec


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
    if prepared.distributed_optimizer != training.shards_optimizer:
        raise ConfigError(f"the graph was prepared with a sharded optimizer={prepared.distributed_optimizer}, "
                          f"the training spec says {training.shards_optimizer}")
    provenance = Provenance()
    chunks: list[ChunkWork] = []
    # once per rank, every chunk's step after it
    optimizer = [timer.constants.iteration_overhead_ns * timer.constants.host_time_factor
                 + gc_step_ns(training, timer.constants.host_time_factor)] * pp
    embedding_sync_ns = 0.0
    classes = comm.rank_classes()
    ep_overlap = _ep_overlap(parallel, timer)
    costed: dict[tuple, StageCost] = {}  # stages of one role whose ranks time every collective alike
    for stage in prepared.stages:
        rank = stage.stage.pipeline_rank
        chunk = stage.stage.chunk
        # Megatron-Core buckets the gradients of the first chunk of the first rank alone and
        # groups those of later chunks: the same role costs differently there. The EP overlap merges
        # fewer pairs on earlier ranks (steady_pairs): with it, each rank costs its own.
        key = (id(stage.role), id(stage.runtime), classes[rank] if ep_overlap is None else (classes[rank], rank),
               rank == 0 and chunk == 0, chunk > 0)
        staged = costed.get(key)
        if staged is None:
            staged = costed[key] = _stage_cost(stage, timer, comm, training, num_microbatches, explain, ep_overlap,
                                               _offload_nbytes(prepared, stage, training), prepared.graph.model,
                                               parallel, prepared.stack)
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


@dataclass(frozen=True, slots=True)
class _EpOverlap:
    """The plan's EP all-to-all overlap (:mod:`vtrain_plugin.cost.comm.ep_overlap`)."""

    delay_wgrad: bool
    comm_sm_share: float  # of the device's SMs the dispatch kernels occupy while compute runs beside them
    pipeline_parallel: int
    virtual_pipeline: int


def _ep_overlap(parallel, timer: KernelTimer) -> _EpOverlap | None:
    if not parallel.overlap_moe_expert_parallel_comm:
        return None
    flex = parallel.moe_token_dispatcher.value == "flex"
    share = min(1.0, parallel.flex_num_sms / timer.device.sm_count) if flex else 0.0
    return _EpOverlap(delay_wgrad=parallel.delay_wgrad_compute, comm_sm_share=share,
                      pipeline_parallel=parallel.pipeline_parallel, virtual_pipeline=parallel.virtual_pipeline)


def _offload_nbytes(prepared: PreparedGraph, stage: PreparedStage, training: TrainingSpec
                    ) -> tuple[dict[str, float], ...]:
    """Bytes each block of ``stage`` offloads per instance and micro-batch, by module
    (:mod:`~vtrain_plugin.cost.activation_offload`)."""
    settings = training.fp8_settings
    return tuple(offloaded_by_module(
        block, training.activation_offload, te=prepared.stack.value == "megatron_core_te",
        element_nbytes=prepared.graph.dtype.nbytes, fp8=settings is not None,
        quantised_nbytes=quantisation(settings).nbytes if settings is not None else 1.0,
        unfused_attention=training.unfused_attention) for block in stage.stage.blocks)


def _row_modules(role) -> list[str]:
    """Each row's module, the collectives' included."""
    modules = [n.module if n is not None else "" for n in role.nodes]
    for c in role.comm_rows:
        modules[c.row] = c.node.module
    return modules


def _reload_exposed_ns(modules: Sequence[str], device: np.ndarray, segments, blocks, b: int,
                       offloaded: dict[str, float], link: float) -> float:
    """The reloads of one instance of block ``b`` its backward waits for (:func:`exposed_reload_ns`):
    the backward's (and recompute's) device time by module, collectives included."""
    by_module: dict[str, float] = {}
    for s in segments:
        if s.block == b and s.phase in (Phase.BACKWARD, Phase.RECOMPUTE):
            for row in range(s.start, s.stop):
                by_module[modules[row]] = by_module.get(modules[row], 0.0) + float(device[row])
    forward = list(dict.fromkeys(n.module for n in blocks[b].nodes if n.phase is Phase.FORWARD))
    return exposed_reload_ns(offload_groups(forward, offloaded), by_module, link)


@dataclass(frozen=True, slots=True, eq=False)
class RoleTimes:
    """A chunk role's kernels timed on one device with one set of constants and one placement of
    its collectives: every per-row array and per-segment sum of :func:`_stage_cost` that does not
    depend on the block counts, the micro-batches or the data-parallel side of the plan. Plans of a
    search that share a traced shape share these (:func:`role_times`)."""

    kernels: object  # the role's KernelBatch and measured array, held so their ids stay theirs
    measured: np.ndarray
    device: np.ndarray  # per row, collectives' exposed time included
    host: np.ndarray
    is_comm: np.ndarray
    is_ep: np.ndarray
    modules: list[str]
    h: np.ndarray  # per segment: host total, device total, pipelined time of one instance
    d: np.ndarray
    p: np.ndarray
    pieces: dict[int, tuple]  # per segment with host waits inside: its pieces (split_times)
    tp_comm: np.ndarray  # per segment
    cp_comm: np.ndarray
    ep_comm: np.ndarray
    kernel: np.ndarray  # per segment: kernel time and its measured part (provenance)
    measured_kernel: np.ndarray


_ROLE_TIMES_CACHE_SIZE = 512
_role_times: OrderedDict[tuple, RoleTimes] = OrderedDict()


def role_times(prepared: PreparedStage, timer: KernelTimer, comm: CommModel, training: TrainingSpec,
               model: ModelSpec | None, parallel: ParallelPlan | None) -> RoleTimes:
    """:class:`RoleTimes` of ``prepared``'s role on its pipeline rank, looked up when a plan before
    timed the same lowered role with the same device, constants, collective times and options."""
    role, rank = prepared.role, prepared.stage.pipeline_rank
    messages, of_row = _messages(role.comm_rows)
    message_ns = [comm.time_ns(kind, nbytes, group, pipeline_rank=rank) for kind, nbytes, group in messages]
    comm_ns = tuple([message_ns[i] for i in of_row])
    if graphed(training):  # graphed host times read the stage's blocks and the graph scope: never shared
        return _time_role(role, timer, comm_ns, training, model, parallel, prepared.stage.blocks)
    waits_on = model if model is not None and model.num_experts and parallel is not None else None
    key = (id(role.kernels), id(role.measured_ns), timer.device, timer.constants, timer.model.allow_tf32,
           timer.slowdown, comm_ns, training.tp_comm_overlap, waits_on, parallel if waits_on is not None else None,
           forward_pre_hooks(training), training.manual_gc)
    hit = _role_times.get(key)
    if hit is not None and hit.kernels is role.kernels and hit.measured is role.measured_ns:
        _role_times.move_to_end(key)
        return hit
    times = _role_times[key] = _time_role(role, timer, comm_ns, training, model, parallel, prepared.stage.blocks)
    if len(_role_times) > _ROLE_TIMES_CACHE_SIZE:
        _role_times.popitem(last=False)
    return times


_MESSAGES_CACHE_SIZE = 512
_role_messages: OrderedDict[int, tuple[tuple, tuple, tuple[int, ...]]] = OrderedDict()


def _messages(comm_rows: tuple) -> tuple[tuple, tuple[int, ...]]:
    """The distinct messages (kind, bytes, group) of a role's collectives, and each row's among
    them: a layer repeats a few messages many times, and every stage of every plan times its role's.
    Kept per tuple of rows (by identity; the entry holds it)."""
    hit = _role_messages.get(id(comm_rows))
    if hit is not None and hit[0] is comm_rows:
        _role_messages.move_to_end(id(comm_rows))
        return hit[1], hit[2]
    index: dict[tuple, int] = {}
    of_row = tuple(index.setdefault((c.node.kind, c.node.nbytes, c.node.group), len(index)) for c in comm_rows)
    _role_messages[id(comm_rows)] = (comm_rows, tuple(index), of_row)
    if len(_role_messages) > _MESSAGES_CACHE_SIZE:
        _role_messages.popitem(last=False)
    return tuple(index), of_row


def _time_role(role, timer: KernelTimer, comm_ns: tuple[float, ...], training: TrainingSpec,
               model: ModelSpec | None, parallel: ParallelPlan | None, blocks: tuple[Block, ...]) -> RoleTimes:
    constants = timer.constants
    device, host = timer.times_ns(role.kernels, role.measured_ns)
    slow = constants.host_time_factor  # every host cost below runs on the node's CPU
    host += slow * (constants.module_host_overhead_ns * role.module_calls
                    + constants.layer_host_overhead_ns * role.layer_calls)
    host *= gc_host_factor(training)  # --manual-gc: no automatic collections in the step
    is_comm = np.zeros(len(device), bool)
    is_cp = np.zeros(len(device), bool)
    is_ep = np.zeros(len(device), bool)
    for c, ns in zip(role.comm_rows, comm_ns):
        node = c.node
        on_cp = node.group in CP_GROUPS
        # CP and MoE partners exist only where they overlap; TP ones with TE's userbuffers.
        overlapped = c.partner >= 0 and (on_cp or node.group in MOE_GROUPS or training.tp_comm_overlap)
        device[c.row] = exposed_ns(ns, device[c.partner]) if overlapped else ns
        host[c.row] = slow * (constants.collective_host_overhead_ns or (
            constants.backward_host_overhead_ns if node.phase is Phase.BACKWARD else constants.host_overhead_ns))
        is_comm[c.row] = True
        is_cp[c.row] = on_cp
        is_ep[c.row] = node.group in MOE_GROUPS
    modules = _row_modules(role)
    if forward_pre_hooks(training):  # DDP's parameter-gather hook on every module call
        host += slow * PRE_HOOK_NS * hook_calls(modules, role.segments, blocks)
    if graphed(training):  # captured kernels replayed by one graph launch each region
        host = graphed_host_ns(host, modules, role.segments, blocks, training, slow * constants.host_overhead_ns,
                               all_to_all_rows=all_to_all_rows(role.comm_rows), host_copy_rows=host_copy_rows(role.nodes),
                               shared_expert_overlap=model is not None and model.moe_shared_expert_overlap)
    if timer.device.host_runs_kernels:  # a CPU issues and runs each op: no overlap to model
        device, host = device + host, np.zeros_like(host)
    segments = role.segments
    h, d, p = segment_times(host, device, segments)
    waits = {} if model is None or parallel is None else dispatch_waits(
        modules, all_to_all_rows(role.comm_rows), segments, model, parallel)
    measured_rows = ~np.isnan(role.measured_ns)
    for shared in (device, host, is_comm, is_ep):  # shared by the plans that look them up
        shared.setflags(write=False)
    return RoleTimes(
        kernels=role.kernels, measured=role.measured_ns, device=device, host=host, is_comm=is_comm, is_ep=is_ep,
        modules=modules, h=h, d=d, p=p,
        pieces={i: split_times(host, device, segments[i], w) for i, w in waits.items()},
        tp_comm=segment_sums(np.where(is_comm & ~is_cp & ~is_ep, device, 0.0), segments),
        cp_comm=segment_sums(np.where(is_cp, device, 0.0), segments),
        ep_comm=segment_sums(np.where(is_ep, device, 0.0), segments),
        kernel=segment_sums(np.where(is_comm, 0.0, device), segments),
        measured_kernel=segment_sums(np.where(measured_rows, device, 0.0), segments))


def _stage_cost(prepared: PreparedStage, timer: KernelTimer, comm: CommModel, training: TrainingSpec,
                num_microbatches: int, explain: bool, ep_overlap: _EpOverlap | None = None,
                offload_nbytes: Sequence[dict[str, float]] = (), model: ModelSpec | None = None,
                parallel: ParallelPlan | None = None, stack: SoftwareStack | None = None) -> StageCost:
    stage, role = prepared.stage, prepared.role
    rank = stage.pipeline_rank
    constants = timer.constants
    slow = constants.host_time_factor
    times = role_times(prepared, timer, comm, training, model, parallel)
    device, is_comm, is_ep, modules = times.device, times.is_comm, times.is_ep, times.modules
    segments = role.segments
    h, d, p = times.h, times.d, times.p
    tp_comm, cp_comm, ep_comm = times.tp_comm, times.cp_comm, times.ep_comm
    provenance = (stage_provenance(role, device, is_comm, num_microbatches, track_modeled=True) if explain
                  else counted_provenance(segments, times.kernel, times.measured_kernel, num_microbatches))

    index = {(s.block, s.phase): i for i, s in enumerate(segments)}
    blocks = stage.blocks

    def time(b: int, phase: Phase) -> SegmentTime:
        i = index[b, phase]
        return SegmentTime(host_ns=h[i], device_ns=d[i], pipelined_ns=p[i], count=blocks[b].count,
                           pieces=times.pieces.get(i, ()))

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

    forward_total = totals[Phase.FORWARD] + slow * constants.microbatch_overhead_ns
    if holds_loss(stage) and stack is not None:  # the loss's scaling and NaN checks, each micro-batch
        forward_total += pieces_ns(loss_pieces(training, stack), timer, comm, rank)
    step_ns = 0.0 if parallel is None or stack is None else pieces_ns(
        step_pieces(stage, training, parallel, prepared.runtime.grad_dtype.nbytes, stack), timer, comm, rank)
    backward_total = totals[Phase.BACKWARD]
    ep_forward, ep_backward = ep[Phase.FORWARD], ep[Phase.BACKWARD] + ep[Phase.RECOMPUTE]
    if ep_overlap is not None and ep_forward + ep_backward > 0:
        moe_ns, expert_gemm_ns = _moe_mlp_ns(role, device, is_comm, is_ep, segments)
        parts = OverlapParts(
            forward_other_ns=max(0.0, forward_total - moe_ns[Phase.FORWARD] - ep_forward),
            forward_moe_ns=moe_ns[Phase.FORWARD],
            backward_other_ns=max(0.0, backward_total + totals[Phase.RECOMPUTE] - moe_ns[Phase.BACKWARD] - ep_backward),
            backward_moe_ns=moe_ns[Phase.BACKWARD], backward_expert_gemm_ns=expert_gemm_ns,
            ep_forward_ns=ep_forward, ep_backward_ns=ep_backward)
        saving = pair_saving_ns(parts, delay_wgrad=ep_overlap.delay_wgrad, comm_sm_share=ep_overlap.comm_sm_share)
        saving *= steady_pairs(pipeline_parallel=ep_overlap.pipeline_parallel,
                               virtual_pipeline=ep_overlap.virtual_pipeline, num_microbatches=num_microbatches,
                               pipeline_rank=rank)
        saved_forward = saving * ep_forward / (ep_forward + ep_backward)
        saved_backward = min(saving - saved_forward, backward_total, ep_backward)
        forward_total, ep_forward = forward_total - saved_forward, ep_forward - saved_forward
        backward_total, ep_backward = backward_total - saved_backward, ep_backward - saved_backward

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
    link = comm.cluster.host_copy_gbytes_per_s(timer.device.host_copy_gbytes_per_s)
    for b, by_module in enumerate(offload_nbytes):  # device-to-host beside forward, host-to-device in the backward
        if by_module:
            forward_total += blocks[b].count * exposed_copy_ns(sum(by_module.values()), forward_ns[b], link)
            backward_total += blocks[b].count * _reload_exposed_ns(modules, device, segments, blocks, b, by_module, link)
    fsdp_forward = fsdp_backward = 0.0
    if training.fsdp is not None:
        fsdp_forward, fsdp_backward = _fsdp_exposed(gradients, expert_gradients, prepared, comm, training)
    work = ChunkWork(
        forward_ns=forward_total + fsdp_forward, backward_ns=backward_total + fsdp_backward,
        dp_comm_forward_ns=fsdp_forward, dp_comm_backward_ns=fsdp_backward,
        recompute_ns=totals[Phase.RECOMPUTE], tp_comm_forward_ns=tp[Phase.FORWARD],
        tp_comm_backward_ns=tp[Phase.BACKWARD] + tp[Phase.RECOMPUTE], cp_comm_forward_ns=cp[Phase.FORWARD],
        cp_comm_backward_ns=cp[Phase.BACKWARD] + cp[Phase.RECOMPUTE], ep_comm_forward_ns=ep_forward,
        ep_comm_backward_ns=ep_backward,
        p2p_forward_ns=p2p[Phase.FORWARD], p2p_backward_ns=p2p[Phase.BACKWARD],
        dp_buckets=sorted(reduces + expert_reduces, key=lambda b: b.ready_fraction),
        param_gathers=sorted(gathers + expert_gathers, key=lambda g: g.need_fraction))
    return StageCost(work=work, optimizer_ns=totals[Phase.OPTIMIZER] + step_ns, embedding_sync_ns=sync_ns,
                     provenance=provenance)


def _gradient_buckets(gradients: Sequence[BlockGradients], prepared: PreparedStage, comm: CommModel,
                      training: TrainingSpec, group: ParallelGroup
                      ) -> tuple[tuple[DpBucket, ...], tuple[ParamGather, ...]]:
    """The stage's gradient reductions over ``group`` (DP, or expert DP for the parameters of experts
    split by expert parallelism: Megatron-Core's DDP keeps them in buffers of their own) and, with
    the distributed optimizer, its parameter all-gathers."""
    runtime, stage = prepared.runtime, prepared.stage
    fsdp = training.fsdp
    if fsdp is not None and fsdp.sharding_strategy.shards_parameters:
        return (), ()  # every collective per micro-batch: _fsdp_exposed
    if runtime.distributed_optimizer and runtime.group_size(group) > 1:
        zero = ZeroRuntime.of(runtime, pipeline_rank=stage.pipeline_rank, chunk=stage.chunk, group=group)
        reduces, gathers = zero_buckets(gradients, comm, training, zero)
        if fsdp is not None and fsdp.sharding_strategy.shards_gradients:
            return (), gathers  # reduce-scattered per micro-batch: _fsdp_exposed
        return reduces, gathers
    return dp_buckets(gradients, comm, training, stage.pipeline_rank, group, grad_nbytes=runtime.grad_dtype.nbytes), ()


def _fsdp_exposed(gradients: Sequence[BlockGradients], expert_gradients: Sequence[BlockGradients],
                  prepared: PreparedStage, comm: CommModel, training: TrainingSpec) -> tuple[float, float]:
    """(forward, backward) time one micro-batch of the stage waits for FSDP's per-unit collectives
    (:mod:`vtrain_plugin.cost.comm.fsdp`): every block instance a unit, its dense parameters over DP,
    its experts' over expert DP, one link."""
    rank = prepared.stage.pipeline_rank
    runtime = prepared.runtime
    wire = Dtype(training.fsdp.grad_comm_dtype) if training.fsdp.grad_comm_dtype else runtime.grad_dtype

    def unit_comm(kind: CollectiveKind, block: BlockGradients, expert: BlockGradients, grads: bool) -> float:
        total = 0.0
        for parts, group in ((block, ParallelGroup.DP), (expert, ParallelGroup.EXPERT_DP)):
            if grads:  # in the run's gradient dtype, or Megatron-FSDP's grad_comm_dtype
                nbytes = parts.grad_nbytes * wire.nbytes // runtime.grad_dtype.nbytes
            else:
                widths = parts.gather_nbytes or (runtime.param_dtype.nbytes,) * len(parts.param_numels)
                nbytes = sum(n * w for n, w in zip(parts.param_numels, widths))
            total += comm.time_ns(kind, nbytes, group, pipeline_rank=rank)
        return total

    units: list[FsdpUnit] = []
    numels: list[int] = []
    for block, expert in zip(gradients, expert_gradients):
        unit = FsdpUnit(forward_ns=block.forward_ns, backward_ns=block.backward_ns,
                        gather_ns=unit_comm(CollectiveKind.ALL_GATHER, block, expert, grads=False),
                        reduce_ns=unit_comm(CollectiveKind.REDUCE_SCATTER, block, expert, grads=True))
        units.extend([unit] * block.count)
        numels.extend([sum(block.param_numels) + sum(expert.param_numels)] * block.count)
    return exposed_per_microbatch(units, training.fsdp, prefetch_units(training.fsdp, numels))


def _moe_mlp_ns(role, device: np.ndarray, is_comm: np.ndarray, is_ep: np.ndarray, segments
                ) -> tuple[dict[Phase, float], float]:
    """Per phase (recompute counted with backward), the compute of one micro-batch inside the MoE
    layers' MLPs (the ``.mlp`` modules of the blocks with EP collectives), and the backward time of
    their experts' GEMMs."""
    in_mlp = np.array([n is not None and ".mlp" in n.module for n in role.nodes], bool)
    expert_gemm = np.array([n is not None and ".mlp.experts" in n.module and classify(n.op) is OpClass.GEMM
                            for n in role.nodes], bool)
    has_ep = segment_sums(is_ep.astype(float), segments) > 0
    mlp = segment_sums(np.where(in_mlp & ~is_comm, device, 0.0), segments)
    gemms = segment_sums(np.where(expert_gemm, device, 0.0), segments)
    out = dict.fromkeys(PHASES, 0.0)
    expert_gemm_ns = 0.0
    for i, s in enumerate(segments):
        if has_ep[i]:
            out[s.phase] += s.count * mlp[i]
            if s.phase is Phase.BACKWARD:
                expert_gemm_ns += s.count * gemms[i]
    return {Phase.FORWARD: out[Phase.FORWARD], Phase.BACKWARD: out[Phase.BACKWARD] + out[Phase.RECOMPUTE]}, \
        expert_gemm_ns


def _busy(t: SegmentTime) -> float:
    """Steady-state time of one instance: the busier of host and device."""
    return max(t.host_ns, t.device_ns)
