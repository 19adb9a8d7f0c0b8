"""What a simulation comes to, per policy: deadlines met, rejections, completion times, makespan,
utilization and cost, as pandas tables and JSON-ready data.

- ``deadline_satisfaction``: jobs finished by their deadline over all jobs (rejected ones count as
  missed), ElasticFlow's deadline satisfactory ratio;
- ``rejected``: jobs rejected, by the policy or because no plan fits them anywhere; ``late``: jobs
  finished after their deadline;
- ``mean_jct_hours``, ``p95_jct_hours``: completion time (submit to finish) of the finished jobs,
  the 95th percentile interpolated linearly between ranks; null when none finished;
- ``makespan_hours``: from the first submission to the last finish;
- ``utilization``: GPU-hours held by jobs (restarts included) over the cluster's GPU-hours in the
  makespan; ``gpu_hours`` and ``cost_usd`` (at the cluster's price; null without one) of those;
- with failures on, ``failures`` and ``lost_gpu_hours``: the jobs' failures, and the GPU-hours of
  the work they threw away and of the restarts they caused (part of ``gpu_hours``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from vtrain_plugin.core.units import SECONDS_PER_HOUR
from vtrain_plugin.planning.cluster.simulator import JobOutcome, SimulationResult

if TYPE_CHECKING:
    import pandas as pd

SUMMARY_COLUMNS = ("policy", "jobs", "deadline_satisfaction", "rejected", "late", "mean_jct_hours", "p95_jct_hours",
                   "makespan_hours", "utilization", "gpu_hours", "cost_usd")
FAILURE_COLUMNS = ("failures", "lost_gpu_hours")


def summarize(result: SimulationResult) -> dict[str, Any]:
    """The summary row of one simulation (see the module doc)."""
    outcomes = result.outcomes
    jct = np.array([o.jct_s for o in outcomes if o.finish_s is not None]) / SECONDS_PER_HOUR
    finishes = [o.finish_s for o in outcomes if o.finish_s is not None]
    makespan_s = max(finishes) - min(o.submit_s for o in outcomes) if finishes else math.nan
    gpu_hours = sum(o.gpu_seconds for o in outcomes) / SECONDS_PER_HOUR
    available = result.cluster.total_gpus * makespan_s / SECONDS_PER_HOUR
    price = result.cluster.price_per_gpu_hour_usd
    return {
        "policy": result.policy,
        "jobs": len(outcomes),
        "deadline_satisfaction": sum(o.met_deadline for o in outcomes) / len(outcomes),
        "rejected": sum(bool(o.rejected) for o in outcomes),
        "late": sum(o.finish_s is not None and not o.met_deadline for o in outcomes),
        "mean_jct_hours": float(jct.mean()) if len(jct) else math.nan,
        "p95_jct_hours": float(np.percentile(jct, 95)) if len(jct) else math.nan,
        "makespan_hours": makespan_s / SECONDS_PER_HOUR,
        "utilization": gpu_hours / available if available > 0 else math.nan,
        "gpu_hours": gpu_hours,
        "cost_usd": math.nan if price is None else gpu_hours * price,
        **({} if result.failures is None else {
            "failures": sum(o.failures for o in outcomes),
            "lost_gpu_hours": sum(o.lost_gpu_seconds for o in outcomes) / SECONDS_PER_HOUR}),
    }


def summary_table(results: Sequence[SimulationResult]) -> pd.DataFrame:
    """One row per policy, side by side on the same jobs."""
    import pandas as pd  # here: a third of a second to load; `vtrain --help` and a config error need none of it

    failures = results[0].failures is not None
    return pd.DataFrame([summarize(r) for r in results],
                        columns=[*SUMMARY_COLUMNS, *(FAILURE_COLUMNS if failures else ())])


def outcome_row(outcome: JobOutcome) -> dict[str, Any]:
    def hours(seconds: float | None) -> float | None:
        return None if seconds is None else seconds / SECONDS_PER_HOUR
    return {"name": outcome.name, "submit_hours": hours(outcome.submit_s), "deadline_hours": hours(outcome.deadline_s),
            "start_hours": hours(outcome.start_s), "finish_hours": hours(outcome.finish_s),
            "jct_hours": None if outcome.finish_s is None else hours(outcome.jct_s),
            "met_deadline": outcome.met_deadline,
            "rejected": outcome.rejected or None, "gpu_hours": outcome.gpu_seconds / SECONDS_PER_HOUR,
            "resizes": outcome.resizes, "failures": outcome.failures,
            "lost_gpu_hours": outcome.lost_gpu_seconds / SECONDS_PER_HOUR}


def report_dict(results: Sequence[SimulationResult]) -> dict[str, Any]:
    """The whole report as JSON-ready data (NaN as None): the cluster, then per policy its summary
    and every job's outcome."""
    cluster = results[0].cluster
    policies = [{**summarize(r), "outcomes": [outcome_row(o) for o in r.outcomes]} for r in results]
    return _no_nan({
        "cluster": {"gpu": cluster.spec.gpu, "nodes": cluster.nodes, "gpus_per_node": cluster.spec.gpus_per_node,
                    "total_gpus": cluster.total_gpus, "granularity": cluster.granularity.value,
                    "price_per_gpu_hour_usd": cluster.price_per_gpu_hour_usd},
        "restart_s": results[0].restart_s,
        "failures": None if results[0].failures is None else {
            "failure_rate_per_gpu_hour": results[0].failures.reliability.rate_per_gpu_hour,
            "checkpoint": results[0].failures.reliability.checkpoint.value, "seed": results[0].failures.seed},
        "policies": policies,
    })


def format_summary(table: pd.DataFrame) -> str:
    """The summary table as text, numbers rounded for reading."""
    formats = {"deadline_satisfaction": "{:.1%}", "mean_jct_hours": "{:,.2f}", "p95_jct_hours": "{:,.2f}",
               "makespan_hours": "{:,.2f}", "utilization": "{:.1%}", "gpu_hours": "{:,.0f}", "cost_usd": "${:,.0f}",
               "lost_gpu_hours": "{:,.0f}"}
    shown = table.copy()
    for column, form in formats.items():
        if column not in table:
            continue
        shown[column] = [("-" if isinstance(x, float) and math.isnan(x) else form.format(x)) for x in table[column]]
    return shown.to_string(index=False)


def _no_nan(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(x) for k, x in value.items()}
    if isinstance(value, list):
        return [_no_nan(x) for x in value]
    if isinstance(value, np.generic):
        return _no_nan(value.item())
    return value
