"""Where a search's time goes: ``vtrain search`` phase by phase, cold and warm, one worker and two.

    .venv/bin/python -m benchmarks.speed.search_phases [--gpus 3360] [--workers 1,2] [-- SEARCH FLAGS...]

The search is MT-NLG 530B (105 layers, hidden 20480, 128 heads, sequence 2048, vocabulary 51200,
fp16) on DGX A100 nodes, global batch 1920, as ``vtrain search`` runs it from the command line; flags
after ``--`` go to ``vtrain search`` (e.g. ``-- --tp 8 --recompute full`` for a smaller space). Each
case runs in a fresh interpreter (:func:`run_case`) that starts a sampling profiler before it imports
vtrain, then calls the CLI's ``main`` in process: every 5 ms the main thread's stack is read and the
sample goes to the phase of the innermost frame that names one (:data:`PHASES`), so the phases are
exclusive and add up to the wall time. "Cold" is an empty trace cache; "warm" the cache the cold run
of the same worker count left (no result is cached anywhere, so warm still estimates every plan).

With two workers the plans are evaluated in worker processes the sampler does not see: the parent's
phases show its own work (start-up, enumeration, waiting on workers, ranking, rendering), and the
CPU columns count the workers (``RUSAGE_CHILDREN``). CPU seconds are the steadier figure on a shared
machine; the load average is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
SAMPLE_S = 0.005

MT_NLG_PLAN = {
    "model": {"name": "mt-nlg-530b", "num_layers": 105, "hidden_size": 20480, "num_attention_heads": 128,
              "seq_length": 2048, "vocab_size": 51200, "dtype": "fp16"},
    "training": {"global_batch_size": 1920},
    "cluster": {"preset": "dgx-a100"},
}

# (phase, file suffix, function names or None for any): the innermost frame that matches names the
# phase of a sample. Order matters only between rules that match the same frame.
PHASES: tuple[tuple[str, str, frozenset[str] | None], ...] = (
    ("imports", "<frozen importlib._bootstrap>", None),
    ("imports", "<frozen importlib._bootstrap_external>", None),
    ("trace-cache reads", "vtrain_plugin/capture/disk_cache.py", frozenset({"load"})),
    ("trace-cache writes", "vtrain_plugin/capture/disk_cache.py", frozenset({"store", "prune"})),
    ("tracing", "vtrain_plugin/capture/megatron_chunk.py", None),
    ("tracing", "vtrain_plugin/capture/child_trace.py", None),
    ("tracing", "vtrain_plugin/capture/tracer.py", frozenset({"_chunk_traces"})),
    ("deriving traces", "vtrain_plugin/capture/rescale.py", None),
    ("prepare", "vtrain_plugin/cost/prepare.py", frozenset({"prepare", "prepare_run"})),
    ("memory", "vtrain_plugin/cost/memory.py", None),
    ("memory", "vtrain_plugin/cost/stack_memory.py", None),
    ("cost", "vtrain_plugin/cost/costing.py", frozenset({"cost"})),
    ("schedule", "vtrain_plugin/sim/array_engine.py", None),
    ("schedule", "vtrain_plugin/sim/task_graph.py", None),
    ("schedule", "vtrain_plugin/sim/schedules.py", None),
    ("estimate (rest)", "vtrain_plugin/estimate.py", frozenset({"estimate", "predict"})),
    ("result rows", "vtrain_plugin/planning/evaluate.py", frozenset({"plan_row", "expected_columns"})),
    ("enumeration", "vtrain_plugin/planning/space.py", None),
    ("enumeration", "vtrain_plugin/planning/evaluate.py", frozenset({"make_batches"})),
    ("waiting on workers", "vtrain_plugin/planning/workers.py", None),
    ("ranking", "vtrain_plugin/planning/search.py", frozenset({"rank_plans"})),
    ("rendering", "vtrain_plugin/cli/render.py", None),
)


def phase_of(frame) -> str:
    """The phase of the innermost frame of ``frame``'s stack that names one; "other" if none does."""
    while frame is not None:
        code = frame.f_code
        for phase, suffix, names in PHASES:
            if code.co_filename.endswith(suffix) and (names is None or code.co_name in names):
                return phase
        frame = frame.f_back
    return "other"


class Sampler(threading.Thread):
    """Counts, every :data:`SAMPLE_S` seconds, the phase the main thread is in."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.counts: Counter[str] = Counter()
        self.main_id = threading.main_thread().ident
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            frame = sys._current_frames().get(self.main_id)
            if frame is not None:
                self.counts[phase_of(frame)] += 1


def run_case(argv: list[str]) -> dict:
    """One search in this process, sampled from before vtrain is imported; its figures as a dict."""
    sampler = Sampler()
    start, start_cpu = time.perf_counter(), time.process_time()
    sampler.start()
    from vtrain_plugin.cli import main  # sampled: the CLI's start-up is one of the phases

    with open(os.devnull, "w") as sink:
        saved, sys.stdout = sys.stdout, sink
        try:
            code = main(argv)
        finally:
            sys.stdout = saved
    sampler.stop.set()
    sampler.join()
    wall = time.perf_counter() - start
    total = sum(sampler.counts.values()) or 1
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"exit": code, "wall_s": wall, "cpu_self_s": time.process_time() - start_cpu,
            "cpu_workers_s": children.ru_utime + children.ru_stime,
            "phases_s": {phase: wall * n / total for phase, n in sampler.counts.items()}}


def plans_in(table_csv: Path) -> int:
    with open(table_csv) as f:
        return sum(1 for _ in f) - 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", default="3360", help="GPU budget of the search (default 3360)")
    parser.add_argument("--workers", default="1,2", help="worker counts to run (default 1,2)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    parser.add_argument("search_flags", nargs="*", help="more flags for vtrain search, after --")
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return 0

    from vtrain_plugin.cli.render import render_table

    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "mt_nlg.yaml"
        plan.write_text(yaml.safe_dump(MT_NLG_PLAN))
        results = []
        for workers in [int(w) for w in args.workers.split(",")]:
            cache = Path(tmp) / f"cache-{workers}"
            for label in ("cold", "warm"):
                table = Path(tmp) / f"table-{workers}-{label}.csv"
                search = ["search", str(plan), "--gpus", args.gpus, "--workers", str(workers), "--format", "csv",
                          "--output", str(table), "--cache-dir", str(cache), *args.search_flags]
                load = os.getloadavg()[0]
                proc = subprocess.run([sys.executable, "-m", "benchmarks.speed.search_phases", "--case",
                                       json.dumps(search)], cwd=REPO, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(proc.stderr, file=sys.stderr)
                    return 1
                case = json.loads(proc.stdout.strip().splitlines()[-1])
                case.update(workers=workers, label=label, load=load, plans=plans_in(table))
                results.append(case)
                print(f"{label} search, {workers} worker(s): {case['plans']:,} plans in {case['wall_s']:.1f} s "
                      f"(load {load:.2f})", file=sys.stderr)
    phases = sorted({p for c in results for p in c["phases_s"]}, key=lambda p: -max(c["phases_s"].get(p, 0)
                                                                                     for c in results))
    head = ["", *[f"{c['label']} x{c['workers']}" for c in results]]
    rows = [["plans", *[f"{c['plans']:,}" for c in results]],
            ["wall s", *[f"{c['wall_s']:.1f}" for c in results]],
            ["plans per wall-minute", *[f"{60 * c['plans'] / c['wall_s']:,.0f}" for c in results]],
            ["CPU s (this process)", *[f"{c['cpu_self_s']:.1f}" for c in results]],
            ["CPU s (workers)", *[f"{c['cpu_workers_s']:.1f}" for c in results]],
            ["CPU ms per plan", *[f"{1000 * (c['cpu_self_s'] + c['cpu_workers_s']) / c['plans']:.1f}"
                                  for c in results]],
            ["load average", *[f"{c['load']:.2f}" for c in results]]]
    rows += [[f"  {p} s", *[f"{c['phases_s'].get(p, 0.0):.2f}" for c in results]] for p in phases]
    print(f"vtrain search MT-NLG 530B --gpus {args.gpus} {' '.join(args.search_flags)} on {os.cpu_count()} CPUs; "
          f"phases: wall seconds of this process, sampled every {1000 * SAMPLE_S:g} ms")
    print(render_table(rows, head))
    return 0


if __name__ == "__main__":
    sys.exit(main())
