"""``search()``: estimate every valid plan of a space, rank them, and mark the Pareto front.

Each plan is estimated exactly as ``estimate(trace(model, plan), cluster=..., training=...)``
would, so a row of the result has the numbers of that plan run on its own. Plans whose model
states alone exceed a GPU's memory are pruned before anything is traced (counted in ``skipped``
under :data:`MEMORY_RULE`); the chunk shapes of the rest are traced next
(:func:`~vtrain_plugin.capture.tracer.trace_jobs`: micro-batch sizes derived where that traces
fewer), by the worker processes, each job by one, and the workers then estimate, reading the
traces from the trace cache. The other plans that do not fit in GPU memory
are kept (``fits_in_memory`` False), ranked after every plan that fits and never on the front. The
front is of time against cost, per iteration or, with ``tokens``, to train on them; without a price
on the cluster, of time against GPU-hours per iteration (the same front for any price).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from vtrain_plugin.planning.progress import ProgressBar

from vtrain_plugin.capture import disk_cache
from vtrain_plugin.capture.tracer import run_trace_job, trace_jobs
from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.units import GIB
from vtrain_plugin.cost.memory import memory_floor_gib
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.planning.backends import BACKENDS, run_batches
from vtrain_plugin.planning.bounded import best_first, plan_floors, rows_in_order
from vtrain_plugin.planning.evaluate import (ESTIMATE_COLUMNS, EXPECTED_COLUMNS, PLAN_COLUMNS, TRAIN_COLUMNS,
                                            evaluate, make_batches, plan_row)
from vtrain_plugin.planning.pareto import pareto_front
from vtrain_plugin.planning.space import Candidate, GpuBudget, SearchSpace, enumerate_plans
from vtrain_plugin.planning.workers import WorkerPool
from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.training import TrainingSpec

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

OBJECTIVES = ("time", "days", "cost")
# The skip rule of plans pruned before tracing: their model states alone exceed a GPU's memory.
MEMORY_RULE = "model states > gpu memory"


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchResult:
    """``table``: one row per evaluated plan, in the order of ``rank`` (see :func:`search`)."""

    table: pd.DataFrame = field(repr=False)
    skipped: dict[str, int]  # rule -> combinations skipped (vtrain_plugin.planning.space)
    objective: str
    time_column: str  # the time and cost the ranking and the front use: per iteration, or to train
    cost_column: str
    top_k: int = 10
    num_candidates: int = 0  # plans after memory pruning; the table has them all unless the search was best-first
    trace_jobs: int = 0  # chunk roles traced (or derived) for the plans costed
    lowest_floor: float | None = None  # best-first: the lowest floor of the ranking column (bounded.plan_floors)

    def top(self, k: int | None = None) -> pd.DataFrame:
        """The ``k`` best plans (default ``top_k``), those that fit first."""
        return self.table.head(self.top_k if k is None else k)

    @property
    def front(self) -> pd.DataFrame:
        """The plans on the Pareto front, fastest first."""
        return self.table[self.table["pareto"]].sort_values(self.time_column, kind="stable")

    @property
    def num_fitting(self) -> int:
        return int(self.table["fits_in_memory"].sum())


def search(model: ModelSpec, *, cluster: ClusterSpec, global_batch_size: int,
           gpus: GpuBudget | int | str | Iterable[int], space: SearchSpace | None = None,
           training: TrainingSpec | None = None, objective: str = "time", top_k: int = 10,
           workers: int | None = None, backend: str = "local", progress: bool = False,
           tokens: float | None = None, profile_db: str | None | Literal[False] = None,
           exhaustive: bool = True, give_up_above: float | None = None) -> SearchResult:
    """Estimate every valid plan of ``space`` (default: every axis over its whole range) for
    ``model`` on ``cluster`` with ``global_batch_size`` sequences per iteration and a GPU count
    in ``gpus`` (a :class:`GpuBudget`, a count, ``"1024:4096"``, ``"2240,2800,3360"``, or counts).

    ``training`` is the base training spec (schedule, gradient bucket size, software stack).
    ``objective`` ranks the plans that fit: ``"time"`` (iteration time, or with ``tokens`` days to
    train; ``"days"`` says the latter and needs ``tokens``) or ``"cost"`` (per iteration, or to
    train; needs a price on the cluster). With ``tokens`` and ``training.reliability`` (the default)
    the days and cost to train are the expected ones, failures, restarts and checkpoints counted. ``workers`` processes (default: the CPU count; 1
    evaluates in this process) or, with ``backend="ray"``, Ray tasks; the processes are forked from
    this one, or fresh interpreters that import vtrain alone where a fork is unsafe
    (:mod:`~vtrain_plugin.planning.workers`); neither imports the caller's main script, so a script
    may call this at its top level, without an ``if __name__ == "__main__":`` guard.
    ``progress`` draws a bar on stderr. ``tokens`` adds ``train_days`` and ``train_cost_usd`` for
    training on that many tokens. ``profile_db``: the profile database every estimate reads, as
    :func:`~vtrain_plugin.estimate.estimate` takes it (default ``$VTRAIN_PROFILE_DB``, else the
    user cache; False: none). ``exhaustive=False``: only the ``top_k`` best plans are wanted; plans
    are costed best-first (:mod:`~vtrain_plugin.planning.bounded`) and the table holds those costed,
    its ``top_k`` first rows those of the exhaustive search and the front that of the plans costed.
    ``give_up_above`` (best-first only): when every plan's floor on the ranking column exceeds it, no
    plan is traced nor costed, and the table is empty (``lowest_floor`` says how far above it is).

    Columns: the plan (``tensor_parallel, context_parallel, pipeline_parallel, data_parallel,
    expert_parallel, micro_batch_size, virtual_pipeline, sequence_parallel, recompute, grad_reduce,
    distributed_optimizer, schedule, software_stack, fp8``), its estimate
    (``num_gpus, num_microbatches, iteration_time_ms, tokens_per_second, tflops_per_gpu, mfu,
    peak_memory_gib, fits_in_memory, cost_usd`` (NaN without a price), ``gpu_hours`` per
    iteration), then ``iterations, train_days, train_cost_usd`` with ``tokens`` (failure-free), and
    with failures on ``expected_train_days, expected_train_cost_usd, goodput,
    checkpoint_interval_iterations``, then ``pareto`` and ``rank``.
    """
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective must be one of {', '.join(OBJECTIVES)}; got {objective!r}")
    if objective == "cost" and cluster.price_per_gpu_hour_usd is None:
        raise ConfigError(f"objective cost needs a price: cluster {cluster.name or cluster.gpu!r} has no "
                          f"price_per_gpu_hour_usd")
    v.one_of("backend", backend, BACKENDS)
    v.positive_int("top_k", top_k)
    workers = v.positive_int("workers", workers) if workers is not None else os.cpu_count() or 1
    base = training or TrainingSpec(global_batch_size=global_batch_size)
    if tokens is not None:
        base = replace(base, total_tokens=v.positive_number("tokens", tokens))
    tokens = base.total_tokens
    if objective == "days" and tokens is None:
        raise ConfigError("objective days needs tokens (--tokens): the days to train on them")
    failures = tokens is not None and base.reliability is not None
    space = space or SearchSpace()
    fp8 = next((f for f in (space.fp8 if space.fp8 is not None else (base.fp8,)) if f is not None), None)
    if fp8 is not None:
        get_device(cluster.gpu).require_fp8("fp8", fp8.value)
    get_device(cluster.gpu).require_recipe(base)
    enumeration = enumerate_plans(model, space, global_batch_size=global_batch_size,
                                  budget=GpuBudget.of(gpus), training=base, gpus_per_node=cluster.gpus_per_node)
    candidates, pruned = prune_by_memory(model, enumeration.candidates, get_device(cluster.gpu).memory_bytes / GIB)
    skipped = {**enumeration.skipped, **({MEMORY_RULE: pruned} if pruned else {})}
    time_column, cost_column = measures(priced=cluster.price_per_gpu_hour_usd is not None, tokens=tokens,
                                        failures=failures)
    column = cost_column if objective == "cost" else time_column
    traced = [0]
    lowest: float | None = None

    def evaluate_plans(positions: Sequence[int]) -> list[tuple[int, dict[str, Any]]]:
        chosen = [candidates[p] for p in positions]
        results, jobs = _trace_and_evaluate(model, cluster, chosen, workers=workers, backend=backend, pool=pool,
                                            progress=progress, profile_db=profile_db)
        traced[0] += jobs
        return [(positions[p], row) for p, row in results]

    with WorkerPool(workers) as pool:  # started by the first evaluation that needs it
        pool.meanwhile(_import_pandas)  # while workers estimate, if any do; else below
        if exhaustive:
            results = evaluate_plans(range(len(candidates)))
        else:
            floors = plan_floors(model, candidates, cluster, column)
            lowest = float(floors.min()) if len(floors) else None
            if give_up_above is not None and lowest is not None and lowest > give_up_above:
                log.info("best-first: every floor is above %.4g %s (the lowest %.4g); none costed", give_up_above,
                         column, lowest)
                results = []
            else:
                results = best_first(floors, evaluate_plans, column=column, top_k=top_k)
    import pandas as pd  # here, not at module level: the CLI imports this module for every command

    log.info("%s search: %d of %d plans costed, %d trace jobs", "exhaustive" if exhaustive else "best-first",
             len(results), len(candidates), traced[0])
    table = pd.DataFrame(rows_in_order(results),
                         columns=[*PLAN_COLUMNS, *ESTIMATE_COLUMNS, *(TRAIN_COLUMNS if tokens else ()),
                                  *(EXPECTED_COLUMNS if failures else ())])
    table = rank_plans(table, "time" if objective == "days" else objective, time_column=time_column, cost_column=cost_column)
    return SearchResult(table=table, skipped=skipped, objective=objective, time_column=time_column,
                        cost_column=cost_column, top_k=top_k, num_candidates=len(candidates), trace_jobs=traced[0],
                        lowest_floor=lowest)


def _trace_and_evaluate(model: ModelSpec, cluster: ClusterSpec, candidates: Sequence[Candidate], *, workers: int,
                        backend: str, pool: WorkerPool, progress: bool, profile_db: str | None | Literal[False]
                        ) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """``(position in candidates, row)`` of each candidate, and the trace jobs run for them: their
    chunk shapes traced first, by ``pool``'s workers, each job by one, then the plans estimated by the
    workers, reading the traces from the trace cache."""
    jobs = trace_jobs(model, [c.parallel for c in candidates])
    batches = make_batches(model, cluster, candidates, profile_db=profile_db)
    local = backend == "local" and workers > 1 and len(batches) > 1  # else evaluated here, or by Ray
    # Forked workers share the imports of tracing when there is some to do (else they need none).
    pool.before_start(size=max(len(jobs), len(batches)), preload=_load_tracing if jobs else None)
    if local:
        pool.start()  # before the progress bars' thread, which would rule out forking them
    # Traced before the fan-out, so the workers that estimate only read: by those workers, each
    # job by one, when they share the disk cache (without it they trace their own batches).
    with ProgressBar(total=len(jobs), unit="trace", desc="tracing", file=sys.stderr, disable=not progress) as bar:
        if not local:
            for job in jobs:
                run_trace_job(job)
                bar.update()
        elif disk_cache.enabled():
            log.info("tracing %d chunk roles in %d workers", len(jobs), pool.size)
            pool.map(run_trace_job, jobs, lambda job: bar.update())
    log.info("evaluating %d plans of %d trace shapes (%s, %d workers)", len(candidates), len(batches),
             backend, workers)
    with ProgressBar(total=len(candidates), unit="plan", file=sys.stderr, disable=not progress) as bar:
        results = run_batches(batches, workers=workers, backend=backend, on_plans=bar.update,
                              pool=pool if local else None)
    return results, len(jobs)


def _import_pandas() -> None:
    """Import pandas (about 0.15 CPU-s), which only the table needs: done while the workers
    estimate, it is off the serial part of the search."""
    import importlib

    importlib.import_module("pandas")


def _load_tracing() -> None:
    """Import what tracing a chunk imports (torch, megatron-core's models), as tracing does, so the
    workers forked from this process share the imports instead of each paying them."""
    import importlib

    from megatron_adapters.fake_world import quiet_megatron

    importlib.import_module("vtrain_plugin.capture.megatron_chunk")
    with quiet_megatron():
        for name in ("megatron.core.models.gpt", "megatron.core.transformer.transformer_config"):
            importlib.import_module(name)


def prune_by_memory(model: ModelSpec, candidates: Sequence[Candidate], gpu_memory_gib: float
                    ) -> tuple[tuple[Candidate, ...], int]:
    """The candidates whose memory floor (:func:`~vtrain_plugin.cost.memory.memory_floor_gib`, no
    trace needed) fits in ``gpu_memory_gib``, and how many were pruned: a pruned plan could only
    have been a row that does not fit."""
    kept = tuple(c for c in candidates
                 if (floor := memory_floor_gib(model, c.parallel, c.training)) is None or floor <= gpu_memory_gib)
    return kept, len(candidates) - len(kept)


def measures(*, priced: bool, tokens: float | None, failures: bool = False) -> tuple[str, str]:
    """The (time, cost) columns that rank plans and draw the front: to train on ``tokens`` when
    given (expected with ``failures``, else failure-free), else per iteration; without a price,
    GPU-hours per iteration stand for the cost and, with ``tokens``, days to train for the time."""
    if tokens is None:
        return "iteration_time_ms", "cost_usd" if priced else "gpu_hours"
    days = "expected_train_days" if failures else "train_days"
    if not priced:
        return days, "gpu_hours"
    return days, "expected_train_cost_usd" if failures else "train_cost_usd"


def evaluate_baseline(model: ModelSpec, candidate: Candidate, cluster: ClusterSpec,
                      tokens: float | None = None, profile_db: str | None | Literal[False] = None
                      ) -> dict[str, Any]:
    """The row of one given plan, with the columns of a search's table (bar ``pareto`` and ``rank``)."""
    if tokens is not None:
        candidate = replace(candidate, training=replace(candidate.training, total_tokens=tokens))
    return plan_row(candidate, evaluate(model, candidate, cluster, profile_db=profile_db))


def rank_plans(table: pd.DataFrame, objective: str, *, time_column: str, cost_column: str) -> pd.DataFrame:
    """Mark the Pareto front and rank: fitting plans first, by the objective's measure, then the
    other, then the table's order; the table comes back sorted by rank."""
    time = table[time_column].to_numpy(dtype=float)
    cost = table[cost_column].to_numpy(dtype=float)
    fits = table["fits_in_memory"].to_numpy(dtype=bool)
    first, second = (time, cost) if objective == "time" else (cost, time)
    order = np.lexsort((np.arange(len(table)), second, first, ~fits))
    rank = np.empty(len(table), dtype=int)
    rank[order] = np.arange(1, len(table) + 1)
    table = table.assign(pareto=pareto_front(time, cost, fits), rank=rank)
    return table.sort_values("rank", kind="stable").reset_index(drop=True)
