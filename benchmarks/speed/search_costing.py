"""CPU per plan of a search's estimating, in this process, with the traces in the disk cache.

    VTRAIN_CACHE_DIR=DIR .venv/bin/python -m benchmarks.speed.search_costing [--pp 35,105] [--phases]
        [--repeat N] [--one N]

MT-NLG 530B (benchmarks.speed.search_phases.MT_NLG_PLAN) on 3,360 A100, the space of TP 8, full
recompute, SP off and the given pipeline sizes (PP 35 alone: 48 plans, 12 trace shapes; ``--pp 105``:
96 plans of one layer per stage, 24 shapes), evaluated batch by batch as one search worker does:
first each plan's traces are read (the trace cache's share), then every plan estimated twice, the
first pass preparing each chunk role, the second with every in-process cache warm; of the first pass,
the memory (``stack_rank_memory``) and the rest of the summary apart. ``--phases`` also splits each
pass into trace() (stage assembly), prepare and cost() per plan; ``--repeat N`` times one traced
plan's estimate (TP 8 PP 35 DP 12) repeated N times, ``--one N`` the same with its trace() each time.
Why: the phase benchmark samples a whole CLI run; this isolates the costing a worker repeats per plan.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections.abc import Callable

from vtrain_plugin.capture.tracer import trace, trace_jobs
from vtrain_plugin.core.units import GIB
from vtrain_plugin.cost.prepare import prepare_run
from vtrain_plugin.estimate import estimate, estimate_prepared, run_stack
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.planning.evaluate import evaluate_batch, make_batches
from vtrain_plugin.planning.search import prune_by_memory
from vtrain_plugin.planning.space import GpuBudget, SearchSpace, enumerate_plans
from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan, Recompute
from vtrain_plugin.specs.training import TrainingSpec

from benchmarks.speed.search_phases import MT_NLG_PLAN

# the module, not the function vtrain_plugin exports under its name
estimate_module = importlib.import_module("vtrain_plugin.estimate")


def _timed(name: str, spent: dict[str, float]) -> Callable[[], None]:
    """Wrap ``vtrain_plugin.estimate.<name>`` to add its CPU seconds to ``spent[name]``; returns the undo."""
    original = getattr(estimate_module, name)

    def wrapper(*args, **kwargs):
        start = time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            spent[name] += time.process_time() - start

    setattr(estimate_module, name, wrapper)
    return lambda: setattr(estimate_module, name, original)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", default="35", help="pipeline sizes of the space, comma-separated (default 35)")
    parser.add_argument("--phases", action="store_true", help="split each pass into trace, prepare and cost")
    parser.add_argument("--repeat", type=int, default=100, metavar="N",
                        help="calls of one traced plan's estimate, repeated (default 100; 0: none)")
    parser.add_argument("--one", type=int, default=0, metavar="N",
                        help="calls of one plan's trace() and estimate, repeated (default 0: none)")
    args = parser.parse_args(argv)
    model = ModelSpec(**MT_NLG_PLAN["model"])
    cluster: ClusterSpec = get_cluster_preset(MT_NLG_PLAN["cluster"]["preset"])
    batch = MT_NLG_PLAN["training"]["global_batch_size"]
    space = SearchSpace(tensor_parallel=(8,), pipeline_parallel=tuple(int(n) for n in args.pp.split(",")),
                        recompute=("full",), sequence_parallel=(False,))
    enumeration = enumerate_plans(model, space, global_batch_size=batch, budget=GpuBudget.of(3360),
                                  training=TrainingSpec(global_batch_size=batch), gpus_per_node=cluster.gpus_per_node)
    candidates, _ = prune_by_memory(model, enumeration.candidates, get_device(cluster.gpu).memory_bytes / GIB)
    if trace_jobs(model, [c.parallel for c in candidates]):
        raise SystemExit("the trace cache lacks this space's traces: run the search once with this VTRAIN_CACHE_DIR")
    batches = make_batches(model, cluster, candidates)
    start = time.process_time()
    for c in candidates:
        trace(model, c.parallel)
    reads = time.process_time() - start
    n = len(candidates)
    if args.phases:
        for name in ("first pass", "second pass"):
            print(f"{name}: " + ", ".join(f"{phase} {1000 * s / n:.2f}" for phase, s in _phases(batches).items())
                  + " ms per plan")
    passes = []
    spent = {"stack_rank_memory": 0.0, "_summarize": 0.0}
    undo = [_timed(name, spent) for name in spent]
    for _ in range(2):
        start = time.process_time()
        rows = [row for b in batches for row in evaluate_batch(b)]
        passes.append(time.process_time() - start)
        if not _:
            first = dict(spent)
    for u in undo:
        u()
    memory, summary = first["stack_rank_memory"], first["_summarize"] - first["stack_rank_memory"]
    stages = sum(c.parallel.pipeline_parallel * c.parallel.virtual_pipeline for c in candidates) / n
    print(f"{n} plans of {len(batches)} trace shapes ({stages:.0f} stages per plan): trace-cache reads "
          f"{1000 * reads / n:.2f} ms per plan; estimating {1000 * passes[0] / n:.2f} ms per plan (first pass; "
          f"memory {1000 * memory / n:.2f}, summary less memory {1000 * summary / n:.2f}), "
          f"{1000 * passes[1] / n:.2f} ms (caches warm); {len(rows)} rows")
    if args.repeat:
        plan = ParallelPlan(tensor_parallel=8, pipeline_parallel=35, data_parallel=12, micro_batch_size=1,
                            recompute=Recompute.FULL)
        graph = trace(model, plan)
        estimate(graph, cluster=cluster, global_batch_size=batch)
        calls = []
        for _ in range(args.repeat):
            start = time.process_time()
            estimate(graph, cluster=cluster, global_batch_size=batch)
            calls.append(time.process_time() - start)
        print(f"one estimate (TP 8 PP 35 DP 12 mbs 1), repeated: {1000 * statistics.mean(calls):.2f} ms per call, "
              f"median {1000 * statistics.median(calls):.2f}")
    if args.one:
        print(f"one trace() and estimate repeated: {_one(model, cluster, batch, args.one)}")
    return 0


def _phases(batches) -> dict[str, float]:
    """CPU seconds of trace() (stage assembly: each batch's traces are read first, untimed), prepare,
    cost() and the whole estimate over every plan of ``batches``, each plan traced, prepared and
    estimated as :func:`evaluate_batch` does (no measured kernels)."""
    spent = dict.fromkeys(("trace", "prepare", "cost", "estimate"), 0.0)
    undo = _timed("cost", spent)
    try:
        for b in batches:
            for candidate in b.candidates:  # the batch's chunk traces read first, untimed
                trace(b.model, candidate.parallel)
            for candidate in b.candidates:
                start = time.process_time()
                graph = trace(b.model, candidate.parallel)
                spent["trace"] += time.process_time() - start
                stack = run_stack(graph, b.cluster, candidate.training)
                start = time.process_time()
                prepared = prepare_run(graph, stack, candidate.training)
                spent["prepare"] += time.process_time() - start
                start = time.process_time()
                estimate_prepared(prepared, cluster=b.cluster, training=candidate.training)
                spent["estimate"] += time.process_time() - start
    finally:
        undo()
    return spent


def _one(model: ModelSpec, cluster: ClusterSpec, batch: int, repeats: int) -> str:
    """CPU per call of one MT-NLG estimate (TP 8, PP 35, DP 12, full recompute) after a first one."""
    plan = ParallelPlan(tensor_parallel=8, pipeline_parallel=35, data_parallel=12, recompute="full")
    training = TrainingSpec(global_batch_size=batch)
    estimate(trace(model, plan), cluster=cluster, training=training)
    times = []
    for _ in range(repeats):
        start = time.process_time()
        estimate(trace(model, plan), cluster=cluster, training=training)
        times.append(time.process_time() - start)
    return f"{1000 * statistics.mean(times):.2f} ms mean, {1000 * statistics.median(times):.2f} ms median CPU"


if __name__ == "__main__":
    raise SystemExit(main())
