"""Best-first search: cost plans in the order of a proven floor on their measure, stop once none can win.

:func:`plan_floors` puts :func:`~vtrain_plugin.cost.time_floor.iteration_floor_ns` in the units of a
search's ranking column (iteration time, days or dollars to train); :func:`best_first` costs plans in
rounds, lowest floor first, until the next floor exceeds the ``top_k``-th best fitting plan's value.

Why: ``vtrain size`` needs only each shape's fastest plan, and an exhaustive search costs (and traces
for) every plan of ~100,000. A plan left uncosted has a floor above the ``top_k``-th best value, so
its measure is too: the best ``top_k`` rows, ties included, are those of the exhaustive search.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from vtrain_plugin.core.units import NS_PER_MS, NS_PER_S, SECONDS_PER_DAY, SECONDS_PER_HOUR
from vtrain_plugin.cost.time_floor import (PlanTerms, combine_floor_ns, compute_floor_ns, compute_key, dp_floor_ns,
                                           dp_key, plan_terms, terms_key)
from vtrain_plugin.planning.evaluate import Row
from vtrain_plugin.planning.space import Candidate
from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.model import ModelSpec

log = logging.getLogger(__name__)

FIRST_ROUND_PLANS = 256  # the first round's plans; each later round doubles, so rounds stay few
PER_ITERATION = ("iteration_time_ms", "cost_usd", "gpu_hours")  # else to train on the tokens
COST_COLUMNS = ("cost_usd", "gpu_hours", "train_cost_usd", "expected_train_cost_usd")


def plan_floors(model: ModelSpec, candidates: Sequence[Candidate], cluster: ClusterSpec, column: str) -> np.ndarray:
    """Each candidate's floor on ``column`` (a search's ranking column): the iteration-time floor,
    times the iterations to train (expected days and dollars count failures on top: at least the
    failure-free ones), times GPUs and price per hour for a cost. Each term of the floor is computed
    once per distinct input it reads (:func:`~vtrain_plugin.cost.time_floor.terms_key`, ``compute_key``,
    ``dp_key``), then combined per plan: the values of :func:`iteration_floor_ns`."""
    terms: dict[tuple, PlanTerms] = {}
    compute: dict[tuple, tuple[tuple[float, ...], float]] = {}
    dp: dict[tuple, tuple[tuple[float, ...], tuple[float, ...]]] = {}
    keys: dict[int, tuple[tuple, tuple]] = {}  # by id: plans share their training specs, each read once
    floor_ns, iterations, gpus = np.empty(len(candidates)), np.ones(len(candidates)), np.empty(len(candidates))
    for i, candidate in enumerate(candidates):
        training, plan = candidate.training, candidate.parallel
        if id(training) not in keys:
            keys[id(training)] = compute_key(model, training), dp_key(model, training)
        training_compute, training_dp = keys[id(training)]
        layout = terms_key(plan)
        if layout not in terms:
            terms[layout] = plan_terms(model, plan, cluster)
        compute_at = (layout, plan.micro_batch_size, plan.recompute, plan.recompute_modules, training_compute)
        if compute_at not in compute:
            compute[compute_at] = compute_floor_ns(model, plan, training, cluster, terms[layout])
        if (layout, training_dp) not in dp:
            dp[layout, training_dp] = dp_floor_ns(model, plan, training, terms[layout])
        floor_ns[i] = combine_floor_ns(training, *compute[compute_at], *dp[layout, training_dp])
        if column not in PER_ITERATION:
            iterations[i] = training.train_iterations(model.seq_length)
        gpus[i] = candidate.num_gpus
    log.debug("floors of %d plans: %d layouts, %d compute and %d DP terms", len(candidates), len(terms),
              len(compute), len(dp))
    if column == "iteration_time_ms":
        return floor_ns / NS_PER_MS
    seconds = floor_ns / NS_PER_S * iterations
    if column in COST_COLUMNS:
        price = 1.0 if column == "gpu_hours" else cluster.price_per_gpu_hour_usd
        return seconds * gpus / SECONDS_PER_HOUR * price
    return seconds / SECONDS_PER_DAY


def best_first(floors: np.ndarray, evaluate: Callable[[Sequence[int]], list[tuple[int, Row]]], *,
               column: str, top_k: int) -> list[tuple[int, Row]]:
    """``(position, row)`` of every plan costed, by ``evaluate(positions)`` in rounds of doubling size
    (:data:`FIRST_ROUND_PLANS` first),
    lowest floor first (then position), each round only the plans whose floor is at most the
    ``top_k``-th best ``column`` value of the fitting plans so far; stops when the next floor exceeds
    it. A row whose value is below its floor means the floor is wrong for it: the rest are then all
    costed, so the result is the exhaustive one's all the same."""
    order = np.lexsort((np.arange(len(floors)), floors))
    done: list[tuple[int, Row]] = []
    best: list[float] = []  # the fitting plans' values, the top_k smallest, sorted
    start, size, trusted = 0, FIRST_ROUND_PLANS, True
    while start < len(order) and trusted:
        cutoff = best[-1] if len(best) == top_k else math.inf
        chunk = order[start:start + size]
        chunk = chunk[floors[chunk] <= cutoff]
        if not len(chunk):
            break
        start += len(chunk)
        size *= 2
        log.info("best-first: costing %d plans with floors %.4g to %.4g %s (best so far %.4g)", len(chunk),
                 floors[chunk[0]], floors[chunk[-1]], column, best[0] if best else math.nan)
        for position, row in evaluate(chunk.tolist()):
            done.append((position, row))
            value = float(row[column])
            if value < floors[position]:
                log.warning("plan %d: %s %.6g below its floor %.6g; costing every plan", position, column, value,
                            floors[position])
                trusted = False
            if row["fits_in_memory"] and not math.isnan(value):
                best = sorted([*best, value])[:top_k]
    if not trusted:
        done += evaluate(order[start:].tolist())
    log.info("best-first: %d of %d plans costed", len(done), len(floors))
    return done


def rows_in_order(results: list[tuple[int, Any]]) -> list[Any]:
    """The rows of ``(position, row)`` pairs in the order of their positions."""
    return [row for _, row in sorted(results, key=lambda item: item[0])]
