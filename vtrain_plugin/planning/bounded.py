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
from vtrain_plugin.cost.time_floor import PlanTerms, iteration_floor_ns, plan_terms
from vtrain_plugin.planning.evaluate import Row
from vtrain_plugin.planning.space import Candidate
from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan

log = logging.getLogger(__name__)

FIRST_ROUND_PLANS = 256  # the first round's plans; each later round doubles, so rounds stay few
PER_ITERATION = ("iteration_time_ms", "cost_usd", "gpu_hours")  # else to train on the tokens
COST_COLUMNS = ("cost_usd", "gpu_hours", "train_cost_usd", "expected_train_cost_usd")


def plan_floors(model: ModelSpec, candidates: Sequence[Candidate], cluster: ClusterSpec, column: str) -> np.ndarray:
    """Each candidate's floor on ``column`` (a search's ranking column): the iteration-time floor,
    times the iterations to train (expected days and dollars count failures on top: at least the
    failure-free ones), times GPUs and price per hour for a cost."""
    terms: dict[ParallelPlan, PlanTerms] = {}
    floors = np.empty(len(candidates))
    for i, candidate in enumerate(candidates):
        training, plan = candidate.training, candidate.parallel
        if plan not in terms:
            terms[plan] = plan_terms(model, plan, cluster)
        floor_ns = iteration_floor_ns(model, plan, training, cluster, terms[plan])
        seconds = floor_ns / NS_PER_S
        if column not in PER_ITERATION:
            seconds *= training.train_iterations(model.seq_length)
        if column == "iteration_time_ms":
            floors[i] = floor_ns / NS_PER_MS
        elif column in COST_COLUMNS:
            price = 1.0 if column == "gpu_hours" else cluster.price_per_gpu_hour_usd
            floors[i] = seconds * candidate.num_gpus / SECONDS_PER_HOUR * price
        else:
            floors[i] = seconds / SECONDS_PER_DAY
    return floors


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
