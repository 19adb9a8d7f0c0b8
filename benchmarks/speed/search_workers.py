"""One search worker against two: wall time and CPU-seconds of whole search processes, warm.

    VTRAIN_CACHE_DIR=DIR .venv/bin/python -m benchmarks.speed.search_workers [--tree DIR] [--repeat N]

Two spaces: the dense llama-like space of :mod:`benchmarks.speed.search_equality` (400 plans, small
traces: start-up dominates) and MT-NLG 530B on 3,360 A100 reduced to TP 8, PP 35, full recompute,
SP off (48 plans of :mod:`benchmarks.speed.search_costing`). Each case is a new interpreter, run
from ``--tree`` (default: this one; a ``git archive`` of another commit measures "before"), that
imports vtrain and calls ``search()``; its CPU-seconds are user + sys of it and of its reaped
workers, imports included, since what two workers must not cost is more of the whole. "Warm" is
the trace cache of ``VTRAIN_CACHE_DIR`` filled (the first, untimed, two-worker run of each space
fills it) and no result cached. The tables' digests show that every case gives the same rows.
Why: workers used to be fresh interpreters, each paying vtrain's imports and compiles.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Run in the case's interpreter: argv[1] the space, argv[2] the workers; prints the table's digest.
CASE = """
import hashlib, resource, sys
from benchmarks.speed import search_equality as eq
from benchmarks.speed.search_phases import MT_NLG_PLAN
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.planning.search import search
from vtrain_plugin.planning.space import SearchSpace
from vtrain_plugin.specs.model import ModelSpec

space, workers = sys.argv[1], int(sys.argv[2])
if space == "dense":
    result = search(eq.MODELS["dense"], cluster=eq.CLUSTER, global_batch_size=eq.GLOBAL_BATCH, gpus=eq.GPUS,
                    space=eq.space_of("dense"), workers=workers, profile_db=False)
else:
    result = search(ModelSpec(**MT_NLG_PLAN["model"]), cluster=get_cluster_preset("dgx-a100"),
                    global_batch_size=MT_NLG_PLAN["training"]["global_batch_size"], gpus=3360,
                    space=SearchSpace(tensor_parallel=(8,), pipeline_parallel=(35,), recompute=("full",),
                                      sequence_parallel=(False,)), workers=workers)
own, workers_cpu = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(own.ru_utime + own.ru_stime, workers_cpu.ru_utime + workers_cpu.ru_stime, len(result.table),
      hashlib.sha256(result.table.to_csv().encode()).hexdigest()[:12])
"""
SPACES = ("dense", "mt-nlg-48")


def run_case(tree: Path, space: str, workers: int) -> dict:
    """One search process: its wall time, CPU-seconds (with its workers), rows and table digest."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CASE, space, str(workers)], cwd=tree, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{space} x{workers} failed:\n{proc.stderr}")
    own, in_workers, rows, digest = proc.stdout.split()[-4:]
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"space": space, "workers": workers, "wall_s": wall, "cpu_s": cpu, "parent_cpu_s": float(own),
            "workers_cpu_s": float(in_workers), "rows": int(rows), "digest": digest}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=REPO, help="the source tree to run (default: this one)")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each case (default 2)")
    parser.add_argument("--spaces", default=",".join(SPACES), help=f"of {', '.join(SPACES)} (default both)")
    args = parser.parse_args(argv)
    if not os.environ.get("VTRAIN_CACHE_DIR"):
        raise SystemExit("set VTRAIN_CACHE_DIR: the warm runs read (and the first fills) that trace cache")
    results = []
    for space in args.spaces.split(","):
        run_case(args.tree, space, 2)  # fills the trace cache where it lacks this space's traces
        for _ in range(args.repeat):
            for workers in (1, 2):  # interleaved: the machine's load drifts
                case = run_case(args.tree, space, workers)
                results.append(case)
                print(json.dumps({**case, "load": os.getloadavg()[0]}), flush=True)
    print(f"\ntree {args.tree}; {os.cpu_count()} CPUs; CPU s: user + sys of the search process and its workers")
    print("parent / workers: the CPU s of the search process alone and of its workers; on two idle cores the")
    print("wall time is at least parent + workers / 2 (the workers' share, if their batches balance)")
    print(f"{'space':<10} {'workers':>7} {'rows':>5} {'wall s':>7} {'CPU s':>6} {'parent':>6} {'workers':>7}  table")
    for c in results:
        print(f"{c['space']:<10} {c['workers']:>7} {c['rows']:>5} {c['wall_s']:>7.2f} {c['cpu_s']:>6.2f} "
              f"{c['parent_cpu_s']:>6.2f} {c['workers_cpu_s']:>7.2f}  {c['digest']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
