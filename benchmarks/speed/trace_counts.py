"""How many chunk traces a cold search of the whole default space needs, counted without tracing.

    VTRAIN_CACHE_DIR=EMPTY_DIR .venv/bin/python -m benchmarks.speed.trace_counts

MT-NLG 530B (benchmarks.speed.search_phases.MT_NLG_PLAN) on exactly 3,360 A100, the default
SearchSpace, pruned by memory as a search prunes: the trace jobs (capture/tracer.py ``trace_jobs``),
the traces they run (a deriving job traces size 1 and the two probe sizes), both by recompute mode,
and the jobs left were the recompute modes of one role derived from one trace. Why: traces are most of
a cold search's time, and each axis of the shape key multiplies them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from vtrain_plugin.capture.chunk import shape_key
from vtrain_plugin.capture.rescale import PROBES
from vtrain_plugin.capture.tracer import TraceJob, trace_jobs
from vtrain_plugin.core.units import GIB
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.planning.search import prune_by_memory
from vtrain_plugin.planning.space import GpuBudget, SearchSpace, enumerate_plans
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import Recompute
from vtrain_plugin.specs.training import TrainingSpec

from benchmarks.speed.search_phases import MT_NLG_PLAN

GPUS = 3360


def traces_of(job: TraceJob) -> int:
    """The traces ``job`` runs: each size it wants, but the probes in place of those it derives."""
    sizes = {plan.micro_batch_size for plan in job.plans}
    return len({s for s in sizes if s < PROBES[0]} | set(PROBES)) if job.derives else len(sizes)


def main() -> int:
    model = ModelSpec(**MT_NLG_PLAN["model"])
    cluster = get_cluster_preset(MT_NLG_PLAN["cluster"]["preset"])
    batch = MT_NLG_PLAN["training"]["global_batch_size"]
    enumeration = enumerate_plans(model, SearchSpace(), global_batch_size=batch, budget=GpuBudget.of(GPUS),
                                  training=TrainingSpec(global_batch_size=batch), gpus_per_node=cluster.gpus_per_node)
    candidates, _ = prune_by_memory(model, enumeration.candidates, get_device(cluster.gpu).memory_bytes / GIB)
    jobs = trace_jobs(model, [c.parallel for c in candidates])
    by_mode = Counter(job.plans[0].recompute.value for job in jobs)
    traces = Counter()
    for job in jobs:
        traces[job.plans[0].recompute.value] += traces_of(job)
    one_mode = {shape_key(model, replace(job.plans[0], micro_batch_size=1, recompute=Recompute.NONE,
                                         recompute_modules=None), *job.role) for job in jobs}
    print(f"plans {len(enumeration.candidates)}, {len(candidates)} after pruning by memory")
    print(f"trace jobs {len(jobs)} {dict(by_mode)}; traces {sum(traces.values())} {dict(traces)}")
    print(f"trace jobs were the recompute modes of a role derived from one: {len(one_mode)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
