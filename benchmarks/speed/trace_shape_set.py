"""CPU-seconds and entry sizes of tracing one MT-NLG shape set cold: its roles under each recompute mode.

    .venv/bin/python -m benchmarks.speed.trace_shape_set [--tp 8] [--pp 35] [--micro-batch 1] [--sp]

MT-NLG 530B (benchmarks.speed.search_phases.MT_NLG_PLAN) at one parallel shape: the trace jobs of its
first, middle and last pipeline stages under no, selective and full recompute, run one after another
into an empty trace cache (capture/tracer.py ``prepare_traces``, as a search's trace phase does). Prints,
per recompute mode, the CPU-seconds of tracing (this process and its children), the nodes recorded,
the bytes of the cache entries written and the CPU-milliseconds of reading them back.
Why: traces are most of a cold search's time; this is the unit a search multiplies by its shapes.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from dataclasses import replace


def _cpu_s() -> float:
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=35)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--sp", action="store_true", help="sequence parallelism")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["VTRAIN_CACHE_DIR"] = cache
        os.environ.pop("VTRAIN_NO_CACHE", None)
        from vtrain_plugin.capture import disk_cache, tracer
        from vtrain_plugin.specs.model import ModelSpec
        from vtrain_plugin.specs.parallel import ParallelPlan

        from benchmarks.speed.search_phases import MT_NLG_PLAN

        model = ModelSpec(**MT_NLG_PLAN["model"])
        base = ParallelPlan(tensor_parallel=args.tp, pipeline_parallel=args.pp, sequence_parallel=args.sp,
                            micro_batch_size=args.micro_batch)
        print(f"MT-NLG 530B, TP {args.tp}, PP {args.pp}, SP {args.sp}, micro-batch {args.micro_batch}")
        print(f"{'recompute':10} {'jobs':>4} {'trace CPU-s':>11} {'nodes':>7} {'entry KiB':>9} {'read CPU-ms':>11}")
        total = 0.0
        for mode in ("none", "selective", "full"):
            plan = replace(base, recompute=mode)
            before = set(disk_cache.traces_dir().glob(f"*{disk_cache.SUFFIX}")) if disk_cache.traces_dir().exists() \
                else set()
            jobs = tracer.trace_jobs(model, [plan])
            start = _cpu_s()
            for job in jobs:
                tracer.run_trace_job(job)
            spent = _cpu_s() - start
            total += spent
            entries = sorted(set(disk_cache.traces_dir().glob(f"*{disk_cache.SUFFIX}")) - before)
            tracer.clear_cache()
            start = time.process_time()
            keys = [tracer.shape_key(model, job.plans[0], *job.role) for job in jobs]
            read = [disk_cache.load(key) for key in keys]
            read_ms = (time.process_time() - start) * 1e3
            nodes = sum(len(b.nodes) for chunk in read for b in chunk.blocks)
            size_kib = sum(p.stat().st_size for p in entries) / 1024
            print(f"{mode:10} {len(jobs):>4} {spent:>11.1f} {nodes:>7} {size_kib:>9.1f} {read_ms:>11.1f}")
        print(f"{'all':10} {'':>4} {total:>11.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
