"""``estimate()``: the predicted time, throughput and cost of one training iteration, and of the whole
run when the training spec says how many tokens it consumes.

Inputs are the traced graph (or a plan to trace), the cluster and the training spec; kernel
durations come from the profile database (``vtrain profile``) when it has them for the target GPU,
from the analytical device model otherwise; the pipeline schedule is simulated by :mod:`vtrain_plugin.sim`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal

from profiler.lookup import measured_for_graph
from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import CollectiveKind, KernelKey, OpGraph, Phase
from vtrain_plugin.core.units import GIB, MS_PER_S, NS_PER_MS, NS_PER_S, SECONDS_PER_DAY, SECONDS_PER_HOUR
from vtrain_plugin.cost.checkpoint import CheckpointSize, checkpoint_size, model_checkpoint_size
from vtrain_plugin.cost.lowering.fp8 import recipe_assumptions
from vtrain_plugin.cost.comm.collectives import CommModel
from vtrain_plugin.cost.comm.context_parallel import ContextParallel
from vtrain_plugin.cost.comm.context_parallel import model_flops as blocks_model_flops
from vtrain_plugin.cost.costing import Costing, cost
from vtrain_plugin.cost.megatron_flops import megatron_model_flops
from vtrain_plugin.cost.kernels.timer import KernelTimer
from vtrain_plugin.cost.memory import RankMemory
from vtrain_plugin.cost.prepare import PreparedGraph, prepare_run
from vtrain_plugin.cost.stack_memory import stack_rank_memory
from vtrain_plugin.cost.time_floor import gemm_peak_flop_per_ns, gemm_precision
from vtrain_plugin.cost.kernels.stragglers import slowest_gpu_factor
from vtrain_plugin.hardware.calibration import DeviceConstants, calibration_for
from vtrain_plugin.hardware.devices import DeviceSpec, get_device
from vtrain_plugin.hardware.error_bands import ErrorBand, error_band
from vtrain_plugin.hardware.nccl import NcclTable
from vtrain_plugin.sim.engine import BREAKDOWN_FIELDS, RankBreakdown, SimResult, simulate
from vtrain_plugin.sim.run_totals import TrainTotals, train_totals
from vtrain_plugin.sim.schedules import schedule_occupancy
from vtrain_plugin.sim.timeline import Timeline, write_chrome_trace
from vtrain_plugin.specs.assumptions import assumptions, training_assumptions
from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.reliability import ReliabilitySpec
from vtrain_plugin.specs.run import RunConfig
from vtrain_plugin.specs.training import SoftwareStack, TrainingSpec

if TYPE_CHECKING:
    import pandas as pd

_RUN_RELIABILITY = object()  # Estimate.train_totals: the reliability the estimate was made with


@dataclass(frozen=True, slots=True, kw_only=True)
class UnmeasuredKernel:
    op: str
    input_shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    phase: str
    module: str
    time_ms: float  # modeled time per iteration of this (kernel, phase, module) on the stage that spends the most on it


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """One iteration of one plan on one cluster. Times in milliseconds.

    With ``total_tokens`` (``TrainingSpec.total_tokens``), also the whole run: ``iterations``
    (:meth:`TrainingSpec.train_iterations`, rounded up) times the iteration, in days, GPU-hours and
    dollars; steady-state iterations only (no start-up, checkpoints, evaluation or restarts). All
    four are None without ``total_tokens``, and ``train_cost_usd`` also without a price. What
    failures, restarts and checkpoints add is :meth:`train_totals` (``expected_train_*`` in
    :meth:`to_dict`), with the training spec's ``reliability`` unless told otherwise.
    """

    iteration_time_ms: float
    breakdown_ms: dict[str, float]  # of the bottleneck pipeline stage (the one with most compute)
    stage_breakdown_ms: tuple[dict[str, float], ...]  # per pipeline rank; each sums to the iteration
    num_gpus: int
    num_microbatches: int
    global_batch_size: int
    tokens_per_second: float | None  # None for a plain module traced without a known sequence length
    # Model FLOPs per second per GPU, the FLOPs as Megatron-LM counts them (model_flops_per_iteration;
    # the traced ones for a plain module): the TFLOP/s of Megatron's log line
    tflops_per_gpu: float
    hardware_tflops_per_gpu: float  # the traced kernels' FLOPs, recompute included
    mfu: float  # tflops_per_gpu over mfu_peak_tflop_per_s: the GPU's dense peak for the GEMMs' precision
    gpu: str
    software_stack: str  # the kernels assumed (TrainingSpec.stack_for)
    fp8: str | None = None  # FP8 format of the GEMMs (TrainingSpec.fp8); MFU is then against the FP8 peak
    # FLOPs of one iteration behind tflops_per_gpu: Megatron-LM's num_floating_point_operations of the
    # global batch (vtrain_plugin.cost.megatron_flops), or the traced model FLOPs of a plain module
    model_flops_per_iteration: float | None = None
    model_flops_counted_as: str = ""  # "megatron-lm" or "traced"
    mfu_peak_tflop_per_s: float | None = None  # the peak MFU is against
    mfu_peak: str = ""  # that peak in words, e.g. "h100-sxm dense bf16 peak 989 TFLOP/s", "... dense fp8 peak 1,979 ..."
    distributed_optimizer: bool = False  # Megatron-Core's distributed optimizer (TrainingSpec.distributed_optimizer)
    fsdp: str | None = None  # FSDP implementation and strategy (FsdpSettings.label); None: DDP
    cost_usd: float | None  # of this iteration, at the cluster's price per GPU-hour
    measured_fraction: float  # share of kernel time from measured profiles (0..1)
    memory_gib: tuple[RankMemory, ...]  # per pipeline rank, see vtrain_plugin.cost.memory
    gpu_memory_gib: float  # capacity of one GPU, the datasheet's
    # what "fits" is checked against: the capacity CUDA reports (DeviceSpec.usable_memory_gib); None: gpu_memory_gib
    gpu_usable_memory_gib: float | None = None
    largest_unmeasured: tuple[UnmeasuredKernel, ...] = ()
    total_tokens: float | None = None  # of the whole run
    iterations: int | None = None  # that train total_tokens
    seq_length: int | None = None  # tokens per sequence (None: a plain module without one)
    gpus_per_node: int = 8
    price_per_gpu_hour_usd: float | None = None
    checkpoint: CheckpointSize | None = None  # what a checkpoint of the model holds
    reliability: ReliabilitySpec | None = None  # TrainingSpec.reliability (None: failures off)
    # What the estimate assumed or costed other than by tracing (vtrain_plugin.specs.assumptions)
    assumptions: tuple[str, ...] = ()
    # How far off the iteration time (and cost) likely is: the errors of the published runs of its
    # regime (vtrain_plugin.hardware.error_bands); None: no error-band file
    error_band: ErrorBand | None = None
    timeline: Timeline | None = field(default=None, repr=False, compare=False)

    @property
    def peak_memory_gib(self) -> float:
        """The most one GPU needs: peak allocated plus the allowance, on the stage that needs most."""
        return max(m.total_gib for m in self.memory_gib)

    @property
    def peak_allocated_gib(self) -> float:
        """The most the tensors of one GPU take at once: what Megatron-LM's ``max allocated`` and
        ``torch.cuda.max_memory_allocated`` report (the allowance left out)."""
        return max(m.tensors_gib for m in self.memory_gib)

    @property
    def usable_memory_gib(self) -> float:
        return self.gpu_memory_gib if self.gpu_usable_memory_gib is None else self.gpu_usable_memory_gib

    @property
    def fits_in_memory(self) -> bool:
        return self.peak_memory_gib <= self.usable_memory_gib

    @property
    def iteration_time_band_ms(self) -> tuple[float, float] | None:
        """The iteration time likely measured, low and high (None: no band)."""
        return None if self.error_band is None else self.error_band.measured(self.iteration_time_ms)

    @property
    def cost_band_usd(self) -> tuple[float, float] | None:
        """The cost of an iteration likely measured, low and high (None: no band or no price)."""
        return None if self.error_band is None or self.cost_usd is None else self.error_band.measured(self.cost_usd)

    @property
    def train_days(self) -> float | None:
        if self.iterations is None:
            return None
        return self.iterations * self.iteration_time_ms / MS_PER_S / SECONDS_PER_DAY

    @property
    def train_gpu_hours(self) -> float | None:
        if self.iterations is None:
            return None
        return self.iterations * self.iteration_time_ms / MS_PER_S * self.num_gpus / SECONDS_PER_HOUR

    @property
    def train_cost_usd(self) -> float | None:
        if self.iterations is None or self.cost_usd is None:
            return None
        return self.iterations * self.cost_usd

    def train_totals(self, tokens: float | None = None, *, reliability: ReliabilitySpec | None | object = _RUN_RELIABILITY
                     ) -> TrainTotals:
        """Time and cost to train ``tokens`` (default: ``total_tokens``), failure-free and expected
        with the failures, restarts and checkpoints of ``reliability`` (default: the estimate's;
        None: failures off). See :mod:`vtrain_plugin.sim.goodput`."""
        if tokens is None:
            if self.total_tokens is None:
                raise ConfigError("train_totals: give tokens, or estimate with training.total_tokens")
            tokens, iterations = self.total_tokens, self.iterations
        else:
            tokens = v.positive_finite_number("tokens", tokens)
            if self.seq_length is None:
                raise ConfigError("train_totals: this estimate has no sequence length to count iterations with")
            iterations = math.ceil(tokens / (self.global_batch_size * self.seq_length))
        if self.checkpoint is None:
            raise ConfigError("train_totals: this estimate has no checkpoint size")
        return train_totals(tokens=tokens, iterations=iterations, iteration_s=self.iteration_time_ms / MS_PER_S,
                            num_gpus=self.num_gpus, gpus_per_node=self.gpus_per_node,
                            price_per_gpu_hour_usd=self.price_per_gpu_hour_usd, checkpoint_size=self.checkpoint,
                            host_link_gbytes_per_s=get_device(self.gpu).host_copy_gbytes_per_s,
                            reliability=self.reliability if reliability is _RUN_RELIABILITY else reliability)

    def to_dict(self) -> dict[str, Any]:
        expected = self.iterations is not None and self.checkpoint is not None and self.reliability is not None
        totals = self.train_totals() if expected else None
        return {
            "iteration_time_ms": self.iteration_time_ms,
            "breakdown_ms": self.breakdown_ms,
            "stage_breakdown_ms": list(self.stage_breakdown_ms),
            "num_gpus": self.num_gpus,
            "num_microbatches": self.num_microbatches,
            "global_batch_size": self.global_batch_size,
            "tokens_per_second": self.tokens_per_second,
            "tflops_per_gpu": self.tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "mfu": self.mfu,
            "model_flops_per_iteration": self.model_flops_per_iteration,
            "model_flops_counted_as": self.model_flops_counted_as,
            "mfu_peak_tflop_per_s": self.mfu_peak_tflop_per_s,
            "mfu_peak": self.mfu_peak,
            "gpu": self.gpu,
            "software_stack": self.software_stack,
            "fp8": self.fp8,
            "distributed_optimizer": self.distributed_optimizer,
            "fsdp": self.fsdp,
            "cost_usd": self.cost_usd,
            "measured_fraction": self.measured_fraction,
            "peak_memory_gib": self.peak_memory_gib,
            "peak_allocated_gib": self.peak_allocated_gib,
            "gpu_memory_gib": self.gpu_memory_gib,
            "gpu_usable_memory_gib": self.usable_memory_gib,
            "fits_in_memory": self.fits_in_memory,
            "memory_gib_per_stage": [m.to_dict() for m in self.memory_gib],
            "total_tokens": self.total_tokens,
            "iterations": self.iterations,
            "train_days": self.train_days,
            "train_gpu_hours": self.train_gpu_hours,
            "train_cost_usd": self.train_cost_usd,
            "expected_train_days": totals.days if expected else None,
            "expected_train_gpu_hours": totals.gpu_hours if expected else None,
            "expected_train_cost_usd": totals.cost_usd if expected else None,
            "goodput": totals.goodput if expected else None,
            "failures": totals.failures.to_dict() if expected else None,
            "assumptions": list(self.assumptions),
            "error_band": None if self.error_band is None else self.error_band.to_dict(self.iteration_time_ms,
                                                                                       self.cost_usd),
        }

    def to_row(self) -> dict[str, Any]:
        """The scalar fields of :meth:`to_dict`, with the bottleneck stage's breakdown flattened to
        ``<part>_ms`` columns: one row of a table of estimates."""
        row = {k: v for k, v in self.to_dict().items()
               if k not in ("breakdown_ms", "stage_breakdown_ms", "memory_gib_per_stage", "failures", "assumptions",
                            "error_band")}
        band = self.iteration_time_band_ms
        row.update({"iteration_time_low_ms": None if band is None else band[0],
                    "iteration_time_high_ms": None if band is None else band[1],
                    "far_from_calibration": None if self.error_band is None else self.error_band.far})
        row.update({f"{part}_ms": ms for part, ms in self.breakdown_ms.items()})
        return row

    def to_frame(self) -> pd.DataFrame:
        """This estimate as a one-row pandas DataFrame (see :func:`estimates_frame`)."""
        return estimates_frame([self])

    def write_timeline(self, path: str | os.PathLike, *, max_ranks: int | None = None,
                       max_microbatches: int | None = None) -> None:
        if self.timeline is None:
            raise ConfigError("this estimate has no timeline; call estimate(..., timeline=True)")
        write_chrome_trace(self.timeline, path, max_ranks=max_ranks, max_microbatches=max_microbatches)


def estimates_frame(estimates: Iterable[Estimate], *, index: Iterable[str] | None = None) -> pd.DataFrame:
    """Many estimates as one DataFrame, a row each (:meth:`Estimate.to_row`); ``index`` names the
    rows (e.g. the config paths)."""
    import pandas as pd  # here: it takes a third of a second to load, and an estimate needs none of it

    rows = [e.to_row() for e in estimates]
    return pd.DataFrame(rows, index=None if index is None else list(index))


def estimate(graph_or_run: OpGraph | RunConfig, *, cluster: ClusterSpec | None = None,
             training: TrainingSpec | None = None, global_batch_size: int | None = None,
             measured: Mapping[KernelKey, float] | None = None,
             measured_comm: Mapping[tuple[CollectiveKind, int], NcclTable] | None = None,
             profile_db: str | os.PathLike | Literal[False] | None = None,
             timeline: bool = False, explain: int = 0) -> Estimate:
    """Estimate one iteration.

    ``graph_or_run`` is a traced :class:`OpGraph` (then ``cluster`` and ``training`` or
    ``global_batch_size`` are required) or a :class:`RunConfig` (traced here, cached by shape).
    Kernel and collective times come from the profile database where it measured them on the
    cluster's GPU, as ``vtrain estimate`` reads it: ``profile_db`` (a path), by default
    ``$VTRAIN_PROFILE_DB``, else the user cache (``~/.cache/vtrain/profiles.sqlite``); ``False``
    reads none (the analytical model alone). ``measured`` (kernel keys to durations, see
    :func:`profiler.lookup.measured_durations`) and ``measured_comm`` ((collective kind, group
    size) to tables, :func:`profiler.lookup.measured_comm_tables`) replace what the database has.
    ``explain`` lists that many of the largest unmeasured kernels.
    """
    if isinstance(graph_or_run, RunConfig):
        run = graph_or_run
        cluster = cluster or run.cluster
        training = training or run.training
        get_device(cluster.gpu).require_recipe(training)  # before tracing: the GPU cannot run it
        graph = trace(run.model, run.parallel)
    else:
        graph = graph_or_run
        if cluster is None:
            raise ConfigError("estimate: cluster is required with a traced graph")
    if training is None:
        if global_batch_size is None:
            raise ConfigError("estimate: give training=TrainingSpec(...) or global_batch_size")
        training = _plain_training(global_batch_size) if type(global_batch_size) is int else TrainingSpec(
            global_batch_size=global_batch_size)  # the spec refuses what is no int
    if profile_db is not False and (measured is None or measured_comm is None):
        kernels, tables = measured_for_graph(graph, cluster, db_path=profile_db)
        measured = kernels if measured is None else measured
        measured_comm = tables if measured_comm is None else measured_comm
    stack = run_stack(graph, cluster, training)
    prepared = prepare_run(graph, stack, training, measured)
    return estimate_prepared(prepared, cluster=cluster, training=training, measured_comm=measured_comm,
                             timeline=timeline, explain=explain)


def run_stack(graph: OpGraph, cluster: ClusterSpec, training: TrainingSpec) -> SoftwareStack:
    """The software stack ``training`` runs ``graph`` with on ``cluster``'s GPU (refused where that
    GPU cannot run its recipe): the one :func:`estimate` prepares the graph for."""
    device = get_device(cluster.gpu)
    device.require_recipe(training)
    return training.stack_for(graph.model, device.architecture, graph.parallel)


def estimate_prepared(prepared: PreparedGraph, *, cluster: ClusterSpec, training: TrainingSpec,
                      measured_comm: Mapping[tuple[CollectiveKind, int], NcclTable] | None = None,
                      timeline: bool = False, explain: int = 0) -> Estimate:
    """:func:`estimate` of a graph prepared as it prepares one (:func:`run_stack`, then
    :func:`~vtrain_plugin.cost.prepare.prepare_run` with the measured kernels): plans that share a
    graph and what preparing reads of their training spec share the prepared graph (a plan search)."""
    graph, stack = prepared.graph, prepared.stack
    device = get_device(cluster.gpu)
    calibration = calibration_for(device.name, stack)
    costing, result = predict(prepared, cluster=cluster, training=training, constants=calibration.constants,
                              measured_comm=measured_comm, timeline=timeline, explain=explain > 0)
    return _summarize(graph, device, cluster, training, result, costing, explain, stack)


def predict(prepared: PreparedGraph, *, cluster: ClusterSpec, training: TrainingSpec, constants: DeviceConstants,
            measured_comm: Mapping[tuple[CollectiveKind, int], NcclTable] | None = None, timeline: bool = False,
            explain: bool = False) -> tuple[Costing, SimResult]:
    """Cost a prepared graph with ``constants`` and simulate it: the one path of every estimate
    (calibration calls it with candidate constants). The cluster's network efficiency, when it
    states none, is the calibrated one."""
    plan = prepared.graph.parallel
    device = get_device(cluster.gpu)
    efficiency = cluster.network_efficiency if cluster.network_efficiency is not None else constants.network_efficiency
    comm = CommModel.for_plan(cluster, plan, measured_comm=measured_comm, network_efficiency=efficiency,
                              ring_only=training.deterministic, model=prepared.graph.model)
    num_microbatches = training.num_microbatches(plan.data_parallel, plan.micro_batch_size)
    timer = KernelTimer(device, constants, slowdown=slowest_gpu_factor(constants.gpu_speed_spread, plan.world_size))
    costing = cost(prepared, timer=timer, comm=comm, training=training,
                   num_microbatches=num_microbatches, explain=explain)
    return costing, simulate(costing.work, record_timeline=timeline)


def _summarize(graph: OpGraph, device: DeviceSpec, cluster: ClusterSpec, training: TrainingSpec,
               result: SimResult, costing: Costing, explain: int, stack: SoftwareStack) -> Estimate:
    plan = graph.parallel
    num_microbatches = costing.work.num_microbatches
    seconds = result.iteration_ns / NS_PER_S
    occupancy = schedule_occupancy(training.schedule, plan.pipeline_parallel, plan.virtual_pipeline,
                                   num_microbatches, training.microbatch_group_size)
    gpus = plan.world_size
    stage_breakdowns = tuple(dict(zip(BREAKDOWN_FIELDS, [ns / NS_PER_MS for ns in r])) for r in result.ranks)
    busy = [_busy(r) for r in result.ranks]
    bottleneck = busy.index(max(busy))  # the first of the busiest
    flops = _traced_flops(graph, costing)
    ranks_per_replica = plan.tensor_parallel * plan.context_parallel  # that split one micro-batch of a stage
    per_microbatch = (flops[Phase.FORWARD] + flops[Phase.BACKWARD]) * ranks_per_replica
    recompute = flops[Phase.RECOMPUTE] * ranks_per_replica
    replicas_work = num_microbatches * plan.data_parallel
    hardware_flops = (per_microbatch + recompute) * replicas_work
    if graph.model is not None:
        checkpoint, model_flops = _model_counts(graph.model, plan.tensor_parallel, training.global_batch_size)
    else:  # a plain module: no Megatron-LM count, the traced forward and backward
        checkpoint, model_flops = checkpoint_size(graph), per_microbatch * replicas_work
    peak_tflop_per_s, peak_words = _mfu_peak(device, graph.dtype, training)
    tflops = model_flops / seconds / gpus / 1e12
    price = cluster.price_per_gpu_hour_usd
    unmeasured = tuple(
        UnmeasuredKernel(op=op.op, input_shapes=op.key.input_shapes, dtypes=op.key.dtypes, phase=op.phase.value,
                         module=op.module, time_ms=ns / NS_PER_MS)
        for ns, op in costing.provenance.largest_modeled(explain))
    return Estimate(
        iteration_time_ms=result.iteration_ns / NS_PER_MS,
        breakdown_ms=stage_breakdowns[bottleneck],
        stage_breakdown_ms=stage_breakdowns,
        num_gpus=gpus,
        num_microbatches=num_microbatches,
        global_batch_size=training.global_batch_size,
        tokens_per_second=training.global_batch_size * graph.seq_length / seconds if graph.seq_length else None,
        tflops_per_gpu=tflops,
        hardware_tflops_per_gpu=hardware_flops / seconds / gpus / 1e12,
        mfu=tflops / peak_tflop_per_s,
        model_flops_per_iteration=float(model_flops),
        model_flops_counted_as="traced" if graph.model is None else "megatron-lm",
        mfu_peak_tflop_per_s=peak_tflop_per_s,
        mfu_peak=peak_words,
        gpu=device.name,
        software_stack=stack.value,
        fp8=None if training.fp8 is None else training.fp8.value,
        distributed_optimizer=training.distributed_optimizer,
        fsdp=None if training.fsdp is None else training.fsdp.label,
        cost_usd=None if price is None else price * gpus * seconds / SECONDS_PER_HOUR,
        measured_fraction=costing.provenance.measured_fraction,
        largest_unmeasured=unmeasured,
        memory_gib=stack_rank_memory(graph, occupancy.peak_live, stack, training, device.architecture),
        gpu_memory_gib=device.memory_bytes / GIB,
        gpu_usable_memory_gib=device.usable_memory_gib,
        total_tokens=training.total_tokens,
        iterations=training.train_iterations(graph.seq_length),
        seq_length=graph.seq_length,
        gpus_per_node=cluster.gpus_per_node,
        price_per_gpu_hour_usd=price,
        checkpoint=checkpoint,
        reliability=training.reliability,
        assumptions=(assumptions(graph.model, plan) + training_assumptions(training)
                     + device.unvalidated_rates(training) + recipe_assumptions(training.fp8_settings)
                     + device.unmeasured_capacity()),
        error_band=error_band(architecture=device.architecture.value, software_stack=stack.value, num_gpus=gpus,
                              parameters=checkpoint.parameters, moe=graph.model is not None and graph.model.is_moe),
        timeline=result.timeline,
    )


@lru_cache(maxsize=256)
def _plain_training(global_batch_size: int) -> TrainingSpec:
    """The training spec of a global batch size alone (frozen: the estimates given only a batch
    size share it)."""
    return TrainingSpec(global_batch_size=global_batch_size)


@lru_cache(maxsize=256)
def _model_counts(model: ModelSpec, tensor_parallel: int, global_batch_size: int) -> tuple[CheckpointSize, int]:
    """The checkpoint size (:func:`~vtrain_plugin.cost.checkpoint.checkpoint_size`) and Megatron-LM's
    FLOPs of a global batch of ``model`` at ``tensor_parallel``: sums over the model's layers that
    the plans of a search sharing these three would otherwise repeat."""
    return (model_checkpoint_size(model, tensor_parallel=tensor_parallel),
            megatron_model_flops(model, sequences=global_batch_size, tensor_parallel=tensor_parallel))


def _traced_flops(graph: OpGraph, costing: Costing) -> dict[Phase, int]:
    """Traced FLOPs per phase of one micro-batch through every chunk on one TP and CP rank, the traced
    rank's. Under a skewed MoE routing assumption the traced rank is the busiest one, and the model's
    FLOPs are those of balanced routing (skew moves expert work between ranks, it adds none): traced
    again with skew 1 (cached by shape), counted as the costing counts them (the CP attention's
    included)."""
    model = graph.model
    if model is None or not model.is_moe or model.moe_routing_skew == 1.0:
        return costing.flops
    balanced = trace(replace(model, moe_routing_skew=1.0), graph.parallel)
    cp = ContextParallel.of(balanced)
    return {phase: sum(blocks_model_flops(s.blocks, cp, phase) for s in balanced.stages) for phase in Phase}


def _mfu_peak(device: DeviceSpec, dtype: str, training: TrainingSpec) -> tuple[float, str]:
    """The peak MFU is against: the device's dense tensor-core rate for the precision the GEMMs run
    in (:func:`~vtrain_plugin.cost.time_floor.gemm_precision`). Layers kept in bf16 under FP8 do not
    change the peak named: the output says which one it is, as Megatron-LM logs TFLOP/s only."""
    kind = gemm_precision(dtype, training)[1]
    tflop_per_s = gemm_peak_flop_per_ns(device, dtype, training) * NS_PER_S / 1e12
    return tflop_per_s, f"{device.name} dense {kind} peak {tflop_per_s:,.0f} TFLOP/s"


def _busy(rank: RankBreakdown) -> float:
    return (rank.forward_ns + rank.backward_ns + rank.recompute_ns + rank.tp_comm_ns + rank.cp_comm_ns
            + rank.ep_comm_ns)
