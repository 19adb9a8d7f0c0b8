"""Speed of estimates: MT-NLG 530B on 3,360 A100 with the trace cached, and a 300-layout sweep.

Prints tables (not a pass/fail test). Targets (issue 9): at most 2 ms per MT-NLG estimate with the
trace cached, at least 10,000 plans per minute per core in a sweep. Reference points on this kind of
machine: the vTrain reference simulator needs about 11 s for this MT-NLG run (kernels already
profiled); Calculon about 2 ms per configuration. The sweep runs twice: first tracing every new
chunk shape, then with the traces cached (as a search does once each shape is traced). Run with
``.venv/bin/python -m benchmarks.speed.estimate_speed`` (one process, so one core).
"""

from __future__ import annotations

import argparse
import os
import itertools
import statistics
import time

from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.cost.prepare import prepare
from vtrain_plugin.estimate import estimate, predict
from vtrain_plugin.hardware.calibration import calibration_for
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.planning.search import search
from vtrain_plugin.planning.space import SearchSpace
from vtrain_plugin.sim.engine import simulate
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.cli.render import render_table
from vtrain_plugin.capture.tracer import clear_cache, trace
from vtrain_plugin.specs.training import TrainingSpec

# Tracing is what is timed: the on-disk trace cache would answer from disk instead.
os.environ["VTRAIN_NO_CACHE"] = "1"

MT_NLG = ModelSpec(name="mt-nlg-530b", num_layers=105, hidden_size=20480, num_attention_heads=128,
                   seq_length=2048, vocab_size=51200, dtype="fp16")
GLOBAL_BATCH = 1920
CLUSTER = get_cluster_preset("dgx-a100")


def sweep_layouts(count: int) -> list[ParallelPlan]:
    """The first ``count`` valid (TP, PP, DP, micro-batch) layouts of MT-NLG on 280 to 6,720 GPUs."""
    layouts = []
    for tp, pp, dp, mbs in itertools.product((8, 4, 2, 1), (35, 21, 15, 7, 5), (12, 16, 8, 20, 24, 32, 40, 4, 6, 10),
                                             (1, 2, 4)):
        if GLOBAL_BATCH % (dp * mbs) or not 280 <= tp * pp * dp <= 6720:
            continue
        layouts.append(ParallelPlan(tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp,
                                    micro_batch_size=mbs, recompute="full"))
    return layouts[:count]


def single_estimate(repeats: int) -> list[list[str]]:
    plan = ParallelPlan(tensor_parallel=8, pipeline_parallel=35, data_parallel=12, micro_batch_size=1,
                        recompute="full")
    training = TrainingSpec(global_batch_size=GLOBAL_BATCH)
    start = time.perf_counter()
    graph = trace(MT_NLG, plan)
    trace_s = time.perf_counter() - start
    result = estimate(graph, cluster=CLUSTER, training=training)
    stack = training.stack_for(MT_NLG, get_device(CLUSTER.gpu).architecture)
    work = predict(prepare(graph, stack), cluster=CLUSTER, training=training,
                   constants=calibration_for(result.gpu, stack).constants)[0].work
    rows = []
    for label, run in (("estimate()", lambda: estimate(graph, cluster=CLUSTER, training=training)),
                       ("  of which simulate (array engine)", lambda: simulate(work)),
                       ("  simulate, event engine (reference)", lambda: simulate(work, reference=True))):
        times = _timed(run, repeats)
        rows.append([label, f"{1000 * statistics.median(times):.2f}", f"{1000 * min(times):.2f}"])
    rows.append([f"MT-NLG 530B, TP 8 PP 35 DP 12, {plan.world_size} GPUs: trace {trace_s:.1f} s, "
                 f"iteration {result.iteration_time_ms / 1000:.2f} s", "", ""])
    return rows


def _timed(run, repeats: int) -> list[float]:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def sweep(count: int) -> list[list[str]]:
    clear_cache()
    layouts = sweep_layouts(count)
    training = TrainingSpec(global_batch_size=GLOBAL_BATCH)
    rows = []
    for label in ("tracing new shapes", "traces cached"):
        start = time.perf_counter()
        best = None
        for plan in layouts:
            result = estimate(trace(MT_NLG, plan), cluster=CLUSTER, training=training)
            if best is None or result.iteration_time_ms < best[0]:
                best = (result.iteration_time_ms, plan)
        elapsed = time.perf_counter() - start
        ms, plan = best
        rows.append([f"{len(layouts)} MT-NLG layouts, {label}", f"{elapsed:.2f}",
                     f"{1000 * elapsed / len(layouts):.2f}", f"{60 * len(layouts) / elapsed:,.0f}",
                     f"tp {plan.tensor_parallel} pp {plan.pipeline_parallel} dp {plan.data_parallel} "
                     f"mb {plan.micro_batch_size}: {ms / 1000:.2f} s"])
    return rows


def search_rate() -> list[str]:
    """``search()`` over the sweep's space in one process, timed on its second run (the first traces
    the shapes the sweep's first layouts did not have)."""
    space = SearchSpace(tensor_parallel=(8, 4, 2, 1), pipeline_parallel=(35, 21, 15, 7, 5),
                        data_parallel=(12, 16, 8, 20, 24, 32, 40, 4, 6, 10), micro_batch_size=(1, 2, 4),
                        virtual_pipeline=(1,), sequence_parallel=(False,), recompute=("full",),
                        grad_reduce=("after_backward",), distributed_optimizer=(False,))
    def run():
        return search(MT_NLG, cluster=CLUSTER, global_batch_size=GLOBAL_BATCH, gpus="280:6720", space=space,
                      workers=1)

    run()
    start = time.perf_counter()
    result = run()
    elapsed = time.perf_counter() - start
    best = result.top(1).iloc[0]
    return [f"search() of {len(result.table)} MT-NLG plans, traces cached", f"{elapsed:.2f}",
            f"{1000 * elapsed / len(result.table):.2f}", f"{60 * len(result.table) / elapsed:,.0f}",
            f"tp {best.tensor_parallel} pp {best.pipeline_parallel} dp {best.data_parallel} "
            f"mb {best.micro_batch_size}: {best.iteration_time_ms / 1000:.2f} s"]


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--layouts", type=int, default=300)
    args = parser.parse_args()
    print(render_table(single_estimate(args.repeats), ["MT-NLG estimate, trace cached", "median ms", "best ms"]))
    print()
    print(render_table([*sweep(args.layouts), search_rate()],
                       ["sweep", "total s", "ms per plan", "plans per minute", "fastest layout"]))


if __name__ == "__main__":
    main()
