"""``estimate()``: the predicted time, throughput and cost of one training iteration.

Inputs are the traced graph (or a plan to trace), the cluster and the training spec; kernel
durations come from a profile database when it has them for the target GPU, from the analytical
device model otherwise; the pipeline schedule is simulated by :mod:`vtrain_plugin.sim`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from profiler.devices import DeviceSpec, get_device
from vtrain_plugin.cluster import ClusterSpec
from vtrain_plugin.comm.model import CommModel
from vtrain_plugin.comm.nccl_table import NcclTable
from vtrain_plugin.config import RunConfig
from vtrain_plugin.costing import cost_graph
from vtrain_plugin.errors import ConfigError
from vtrain_plugin.graph import CollectiveKind, KernelKey, OpGraph, Phase
from vtrain_plugin.plan import ParallelPlan
from vtrain_plugin.memory import RankMemory, rank_memory
from vtrain_plugin.sim.engine import RankBreakdown, simulate
from vtrain_plugin.sim.schedules import build_schedule
from vtrain_plugin.sim.timeline import Timeline, write_chrome_trace
from vtrain_plugin.timing import KernelTimer
from vtrain_plugin.training import TrainingSpec

NS_PER_MS = 1e6
BREAKDOWN_FIELDS = ("forward", "backward", "recompute", "tp_comm", "pp_comm", "dp_comm",
                    "embedding_sync", "optimizer", "bubble")


@dataclass(frozen=True, slots=True, kw_only=True)
class UnmeasuredKernel:
    op: str
    input_shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    phase: str
    module: str
    time_ms: float  # modeled time per iteration, all occurrences on the representative ranks


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """One iteration of one plan on one cluster. Times in milliseconds."""

    iteration_time_ms: float
    breakdown_ms: dict[str, float]  # of the bottleneck pipeline stage (the one with most compute)
    stage_breakdown_ms: tuple[dict[str, float], ...]  # per pipeline rank; each sums to the iteration
    num_gpus: int
    num_microbatches: int
    global_batch_size: int
    tokens_per_second: float
    tflops_per_gpu: float  # model FLOPs (recompute excluded) per second per GPU
    hardware_tflops_per_gpu: float  # recompute included
    mfu: float  # model FLOPs utilization against the GPU's dense peak for the model dtype
    gpu: str
    cost_usd: float | None  # of this iteration, at the cluster's price per GPU-hour
    measured_fraction: float  # share of kernel time from measured profiles (0..1)
    memory_gib: tuple[RankMemory, ...]  # per pipeline rank, see vtrain_plugin.memory
    gpu_memory_gib: float  # capacity of one GPU
    largest_unmeasured: tuple[UnmeasuredKernel, ...] = ()
    timeline: Timeline | None = field(default=None, repr=False, compare=False)

    @property
    def peak_memory_gib(self) -> float:
        return max(m.total_gib for m in self.memory_gib)

    @property
    def fits_in_memory(self) -> bool:
        return self.peak_memory_gib <= self.gpu_memory_gib

    @property
    def cost_per_hour_usd(self) -> float | None:
        return None if self.cost_usd is None else self.cost_usd * 3.6e6 / self.iteration_time_ms

    def to_dict(self) -> dict[str, Any]:
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
            "gpu": self.gpu,
            "cost_usd": self.cost_usd,
            "measured_fraction": self.measured_fraction,
            "peak_memory_gib": self.peak_memory_gib,
            "gpu_memory_gib": self.gpu_memory_gib,
            "fits_in_memory": self.fits_in_memory,
            "memory_gib_per_stage": [m.to_dict() for m in self.memory_gib],
        }

    def write_timeline(self, path: str | os.PathLike, *, max_ranks: int | None = None,
                       max_microbatches: int | None = None) -> None:
        if self.timeline is None:
            raise ConfigError("this estimate has no timeline; call estimate(..., timeline=True)")
        write_chrome_trace(self.timeline, path, max_ranks=max_ranks, max_microbatches=max_microbatches)


def estimate(graph_or_run: OpGraph | RunConfig, *, cluster: ClusterSpec | None = None,
             training: TrainingSpec | None = None, global_batch_size: int | None = None,
             measured: Mapping[KernelKey, float] | None = None,
             measured_comm: Mapping[tuple[CollectiveKind, int], NcclTable] | None = None,
             timeline: bool = False, explain: int = 0) -> Estimate:
    """Estimate one iteration.

    ``graph_or_run`` is a traced :class:`OpGraph` (then ``cluster`` and ``training`` or
    ``global_batch_size`` are required) or a :class:`RunConfig` (traced here, cached by shape).
    ``measured`` maps kernel keys to measured durations on the cluster's GPU (see
    :func:`vtrain_plugin.profiles.measured_durations`); ``measured_comm`` maps (collective kind,
    group size) to measured tables (:func:`vtrain_plugin.profiles.measured_comm_tables`).
    ``explain`` lists that many of the largest unmeasured kernels.
    """
    if isinstance(graph_or_run, RunConfig):
        from vtrain_plugin.tracer import trace

        run = graph_or_run
        graph = trace(run.model, run.parallel)
        cluster = cluster or run.cluster
        training = training or run.training
    else:
        graph = graph_or_run
        if cluster is None:
            raise ConfigError("estimate: cluster is required with a traced graph")
    if training is None:
        if global_batch_size is None:
            raise ConfigError("estimate: give training=TrainingSpec(...) or global_batch_size")
        training = TrainingSpec(global_batch_size=global_batch_size)
    plan = ParallelPlan(**graph.parallel)
    device = get_device(cluster.gpu)
    num_microbatches = training.num_microbatches(plan.data_parallel, plan.micro_batch_size)
    comm = CommModel.for_plan(cluster, plan, measured_comm=measured_comm,
                              network_efficiency=device.constants.network_efficiency)
    costing = cost_graph(graph, timer=KernelTimer(device, measured), comm=comm, training=training,
                         num_microbatches=num_microbatches, explain=explain > 0)
    result = simulate(costing.work, record_timeline=timeline)
    return _summarize(graph, plan, device, cluster, training, num_microbatches, result, costing, explain)


def _summarize(graph: OpGraph, plan: ParallelPlan, device: DeviceSpec, cluster: ClusterSpec,
               training: TrainingSpec, num_microbatches: int, result, costing, explain: int) -> Estimate:
    seconds = result.iteration_ns / 1e9
    gpus = plan.world_size
    stage_breakdowns = tuple(_breakdown_ms(r) for r in result.ranks)
    bottleneck = max(range(len(result.ranks)), key=lambda i: _busy(result.ranks[i]))
    per_microbatch = (costing.flops[Phase.FORWARD] + costing.flops[Phase.BACKWARD]) * plan.tensor_parallel
    recompute = costing.flops[Phase.RECOMPUTE] * plan.tensor_parallel
    replicas_work = num_microbatches * plan.data_parallel
    model_flops = per_microbatch * replicas_work
    hardware_flops = (per_microbatch + recompute) * replicas_work
    dtype = graph.model.get("dtype", "fp16")
    peak_flop_per_s = device.tensor_flop_per_ns(dtype) * 1e9
    tflops = model_flops / seconds / gpus / 1e12
    price = cluster.price_per_gpu_hour_usd
    unmeasured = tuple(
        UnmeasuredKernel(op=op.op, input_shapes=op.key.input_shapes, dtypes=op.key.dtypes, phase=op.phase.value,
                         module=op.module, time_ms=ns / NS_PER_MS)
        for ns, op in costing.modeled_kernels[:explain])
    return Estimate(
        iteration_time_ms=result.iteration_ns / NS_PER_MS,
        breakdown_ms=stage_breakdowns[bottleneck],
        stage_breakdown_ms=stage_breakdowns,
        num_gpus=gpus,
        num_microbatches=num_microbatches,
        global_batch_size=training.global_batch_size,
        tokens_per_second=training.global_batch_size * graph.seq_length / seconds,
        tflops_per_gpu=tflops,
        hardware_tflops_per_gpu=hardware_flops / seconds / gpus / 1e12,
        mfu=tflops * 1e12 / peak_flop_per_s,
        gpu=device.name,
        cost_usd=None if price is None else price * gpus * seconds / 3600,
        measured_fraction=costing.measured_kernel_ns / costing.kernel_ns if costing.kernel_ns else 0.0,
        largest_unmeasured=unmeasured,
        memory_gib=rank_memory(graph, build_schedule(training.schedule, plan.pipeline_parallel,
                                                     plan.virtual_pipeline, num_microbatches)),
        gpu_memory_gib=device.memory_bytes / 2**30,
        timeline=result.timeline,
    )


def _breakdown_ms(rank: RankBreakdown) -> dict[str, float]:
    return {name: getattr(rank, f"{name}_ns") / NS_PER_MS for name in BREAKDOWN_FIELDS}


def _busy(rank: RankBreakdown) -> float:
    return rank.forward_ns + rank.backward_ns + rank.recompute_ns + rank.tp_comm_ns
