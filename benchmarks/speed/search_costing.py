"""CPU per plan of a search's estimating, in this process, with the traces in the disk cache.

    VTRAIN_CACHE_DIR=DIR .venv/bin/python -m benchmarks.speed.search_costing

MT-NLG 530B (benchmarks.speed.search_phases.MT_NLG_PLAN) on 3,360 A100, the space of TP 8, PP 35,
full recompute, SP off (48 plans, 12 trace shapes), evaluated batch by batch as one search worker
does: first each plan's traces are read (the trace cache's share), then every plan estimated twice,
the first pass preparing each chunk role, the second with every in-process cache warm. Why: the
phase benchmark samples a whole CLI run; this isolates the costing a worker repeats per plan.
"""

from __future__ import annotations

import time

from vtrain_plugin.capture.tracer import trace, trace_jobs
from vtrain_plugin.core.units import GIB
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.planning.evaluate import evaluate_batch, make_batches
from vtrain_plugin.planning.search import prune_by_memory
from vtrain_plugin.planning.space import GpuBudget, SearchSpace, enumerate_plans
from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.training import TrainingSpec

from benchmarks.speed.search_phases import MT_NLG_PLAN


def main() -> int:
    model = ModelSpec(**MT_NLG_PLAN["model"])
    cluster: ClusterSpec = get_cluster_preset(MT_NLG_PLAN["cluster"]["preset"])
    batch = MT_NLG_PLAN["training"]["global_batch_size"]
    space = SearchSpace(tensor_parallel=(8,), pipeline_parallel=(35,), recompute=("full",), sequence_parallel=(False,))
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
    passes = []
    for _ in range(2):
        start = time.process_time()
        rows = [row for b in batches for row in evaluate_batch(b)]
        passes.append(time.process_time() - start)
    n = len(candidates)
    print(f"{n} plans of {len(batches)} trace shapes: trace-cache reads {1000 * reads / n:.1f} ms per plan; "
          f"estimating {1000 * passes[0] / n:.1f} ms per plan (first pass), {1000 * passes[1] / n:.1f} ms "
          f"(caches warm); {len(rows)} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
