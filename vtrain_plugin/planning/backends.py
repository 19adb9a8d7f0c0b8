"""Where batches of plans are evaluated: this process, local worker processes, or a Ray cluster.

Every backend returns the rows of :func:`~vtrain_plugin.planning.evaluate.evaluate_batch`, so a
search gives the same numbers whichever runs it. Local workers are forked from this process, or
fresh interpreters where a fork is unsafe (:mod:`~vtrain_plugin.planning.workers`); one worker per
batch at most. Ray runs each batch as a task, on a local Ray started with ``workers`` CPUs, or on
the cluster that ``ray.init`` connects to (``RAY_ADDRESS``) or that the caller already initialised.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.planning.evaluate import Batch, evaluate_batch
from vtrain_plugin.planning.workers import Results, WorkerPool, evaluate_in_workers

BACKENDS = ("local", "ray")


def run_batches(batches: Sequence[Batch], *, workers: int, backend: str,
                on_plans: Callable[[int], None], pool: WorkerPool | None = None) -> Results:
    """Evaluate ``batches``; ``on_plans(n)`` reports progress as plans complete. Local workers are
    ``pool``'s when given (its processes may have traced already), else started here."""
    if backend == "ray":
        return _run_ray(batches, workers, on_plans)
    if workers == 1 or len(batches) == 1:
        return [row for batch in batches for row in evaluate_batch(batch, lambda: on_plans(1))]
    return evaluate_in_workers(batches, workers, on_plans, pool=pool)


def _run_ray(batches: Sequence[Batch], workers: int, on_plans: Callable[[int], None]) -> Results:
    try:
        import ray
    except ImportError:
        raise ConfigError("backend ray needs `pip install vtrain[ray]`") from None
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=None if os.environ.get("RAY_ADDRESS") else workers, include_dashboard=False,
                 log_to_driver=False, logging_level=logging.WARNING)
    try:
        task = ray.remote(evaluate_batch)
        sizes = {task.remote(batch): len(batch.candidates) for batch in batches}
        pending = list(sizes)
        results: Results = []
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                results.extend(ray.get(ref))
                on_plans(sizes[ref])
        return results
    finally:
        if started:
            ray.shutdown()
