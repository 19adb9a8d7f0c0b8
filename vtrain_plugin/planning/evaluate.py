"""Evaluating candidate plans: trace and estimate each one, the one path of the search and its workers.

Plans are grouped into batches by the shape their chunk traces depend on
(:func:`~vtrain_plugin.capture.chunk.plan_shape_key`): batches share no trace, so a process that
evaluates a whole batch traces each of its shapes once, and no two processes trace the same one.
A batch is plain data and :func:`evaluate_batch` a module-level function, so both travel to
worker processes and Ray workers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from profiler.lookup import measured_for_graph
from vtrain_plugin.capture.chunk import plan_shape_key
from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.units import SECONDS_PER_HOUR
from vtrain_plugin.core.graph import OpGraph
from vtrain_plugin.cost.prepare import PreparedGraph, prepare_run, run_options_key
from vtrain_plugin.estimate import Estimate, estimate, estimate_prepared, run_stack
from vtrain_plugin.planning.space import Candidate
from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan

Row = dict[str, Any]

PLAN_COLUMNS = ("tensor_parallel", "context_parallel", "pipeline_parallel", "data_parallel", "expert_parallel",
                "micro_batch_size", "virtual_pipeline", "sequence_parallel", "recompute", "grad_reduce",
                "distributed_optimizer", "schedule", "software_stack", "fp8")
ESTIMATE_COLUMNS = ("num_gpus", "num_microbatches", "iteration_time_ms", "iteration_time_low_ms",
                    "iteration_time_high_ms", "tokens_per_second", "tflops_per_gpu", "mfu", "peak_memory_gib",
                    "fits_in_memory", "cost_usd", "gpu_hours")
TRAIN_COLUMNS = ("iterations", "train_days", "train_cost_usd")  # with TrainingSpec.total_tokens
# With total_tokens and TrainingSpec.reliability: the run with failures, restarts and checkpoints.
EXPECTED_COLUMNS = ("expected_train_days", "expected_train_cost_usd", "goodput", "checkpoint_interval_iterations")


@dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    """Plans of one trace shape, with their positions in the enumeration."""

    model: ModelSpec
    cluster: ClusterSpec
    candidates: tuple[Candidate, ...]
    positions: tuple[int, ...]
    profile_db: str | None | Literal[False] = None  # estimate()'s: None the default database, False none


def evaluate(model: ModelSpec, candidate: Candidate, cluster: ClusterSpec, *,
             profile_db: str | None | Literal[False] = None) -> Estimate:
    """The estimate of one plan, exactly as a user gets it from ``trace`` and ``estimate``."""
    return estimate(trace(model, candidate.parallel), cluster=cluster, training=candidate.training,
                    profile_db=profile_db)


def plan_row(candidate: Candidate, est: Estimate) -> Row:
    """One row of the search table: the plan's columns, then its estimate's."""
    plan, training = candidate.parallel, candidate.training
    peak = est.peak_memory_gib  # a maximum over the stages, once: Estimate.fits_in_memory's comparison below
    return {
        "tensor_parallel": plan.tensor_parallel,
        "context_parallel": plan.context_parallel,
        "pipeline_parallel": plan.pipeline_parallel,
        "data_parallel": plan.data_parallel,
        "expert_parallel": plan.expert_parallel,
        "micro_batch_size": plan.micro_batch_size,
        "virtual_pipeline": plan.virtual_pipeline,
        "sequence_parallel": plan.sequence_parallel,
        "recompute": plan.recompute.value,
        "grad_reduce": training.grad_reduce.value,
        "distributed_optimizer": training.distributed_optimizer,
        "schedule": training.schedule.value,
        "software_stack": est.software_stack,  # the one the plan ran: given, or its default
        "fp8": est.fp8,
        "num_gpus": est.num_gpus,
        "num_microbatches": est.num_microbatches,
        "iteration_time_ms": est.iteration_time_ms,
        # the iteration time likely measured (Estimate.error_band; NaN without the band file)
        **dict(zip(("iteration_time_low_ms", "iteration_time_high_ms"), est.iteration_time_band_ms or (math.nan,) * 2)),
        "tokens_per_second": est.tokens_per_second,
        "tflops_per_gpu": est.tflops_per_gpu,
        "mfu": est.mfu,
        "peak_memory_gib": peak,
        "fits_in_memory": peak <= est.usable_memory_gib,
        "cost_usd": math.nan if est.cost_usd is None else est.cost_usd,
        "gpu_hours": est.num_gpus * est.iteration_time_ms / 1000 / SECONDS_PER_HOUR,
        **({} if est.iterations is None else {
            "iterations": est.iterations, "train_days": est.train_days,
            "train_cost_usd": math.nan if est.train_cost_usd is None else est.train_cost_usd}),
        **expected_columns(est),
    }


def expected_columns(est: Estimate) -> Row:
    """The :data:`EXPECTED_COLUMNS` of an estimate of the whole run with failures on (else none)."""
    if est.iterations is None or est.reliability is None:
        return {}
    totals = est.train_totals()
    return {"expected_train_days": totals.days,
            "expected_train_cost_usd": math.nan if totals.cost_usd is None else totals.cost_usd,
            "goodput": totals.goodput, "checkpoint_interval_iterations": totals.failures.interval_iterations}


def make_batches(model: ModelSpec, cluster: ClusterSpec, candidates: Sequence[Candidate], *,
                 profile_db: str | None | Literal[False] = None) -> list[Batch]:
    """The candidates grouped by trace shape, largest batch first (it bounds a parallel run)."""
    groups: dict[tuple, list[int]] = {}
    for position, candidate in enumerate(candidates):
        groups.setdefault(plan_shape_key(candidate.parallel), []).append(position)
    ordered = sorted(groups.values(), key=len, reverse=True)
    return [Batch(model=model, cluster=cluster, candidates=tuple(candidates[p] for p in positions),
                  positions=tuple(positions), profile_db=profile_db) for positions in ordered]


def evaluate_batch(batch: Batch, on_plan: Callable[[], None] | None = None) -> list[tuple[int, Row]]:
    """``(position, row)`` for every plan of ``batch``; ``on_plan`` is called after each one.

    Each row is :func:`evaluate`'s estimate; plans of one parallel plan share its graph and the
    measured durations looked up for it, and those that also share what preparing reads of their
    training spec share the prepared graph (:func:`~vtrain_plugin.estimate.estimate_prepared`)."""
    graphs: dict[ParallelPlan, tuple[OpGraph, Any, Any]] = {}
    prepared: dict[tuple, PreparedGraph] = {}
    out = []
    for position, candidate in zip(batch.positions, batch.candidates):
        plan, training = candidate.parallel, candidate.training
        if plan not in graphs:
            graph = trace(batch.model, plan)
            measured = (None, None) if batch.profile_db is False else measured_for_graph(
                graph, batch.cluster, db_path=batch.profile_db)
            graphs[plan] = (graph, *measured)
        graph, kernels, tables = graphs[plan]
        stack = run_stack(graph, batch.cluster, training)
        key = (plan, stack, run_options_key(training, graph.dtype, stack))
        if key not in prepared:
            prepared[key] = prepare_run(graph, stack, training, kernels)
        est = estimate_prepared(prepared[key], cluster=batch.cluster, training=training, measured_comm=tables)
        out.append((position, plan_row(candidate, est)))
        if on_plan is not None:
            on_plan()
    return out
