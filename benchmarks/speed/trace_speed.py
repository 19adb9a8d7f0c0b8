"""Time and peak memory of tracing one full pipeline stage of GPT-3 175B (TP 8, PP 8: 12 layers).

Every layer of the stage is built and run under FakeTensorMode (``traced_layers=None``), then
folded after verifying the layers are identical. Prints a table; run with
``.venv/bin/python -m benchmarks.speed.trace_speed``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

from vtrain_plugin.specs.model import ModelSpec

from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.cli.render import render_table
from vtrain_plugin.capture.tracer import clear_cache, trace_stage

# Tracing is what is timed: the on-disk trace cache would answer from disk instead.
os.environ["VTRAIN_NO_CACHE"] = "1"

GPT3_175B = ModelSpec(name="gpt3-175b", num_layers=96, hidden_size=12288, num_attention_heads=96,
                      seq_length=2048, vocab_size=51200, dtype="fp16")


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    plan = ParallelPlan(tensor_parallel=8, pipeline_parallel=8, data_parallel=1, recompute="full")
    rows = []
    rss_before = peak_rss_gib()
    times = []
    for _ in range(args.repeats):
        clear_cache()
        start = time.perf_counter()
        stage = trace_stage(GPT3_175B, plan, pipeline_rank=3, traced_layers=None)
        times.append(time.perf_counter() - start)
    layer = stage.layer_template()
    rows.append(["GPT-3 175B stage 3 of 8, TP 8, full recompute", str(stage.num_layers),
                 str(sum(1 for b in stage.blocks for _ in b.ops())),
                 f"{min(times):.2f}", f"{statistics.median(times):.2f}",
                 f"{peak_rss_gib():.2f}", f"{peak_rss_gib() - rss_before:+.2f}"])
    print(render_table(rows, ["trace", "layers", "kernel ops (folded)", "best s", "median s",
                              "peak RSS GiB", "RSS growth GiB"]))
    print(f"\nlayers folded into one template of count {layer.count}; "
          f"peak RSS includes the Python interpreter, torch and megatron-core.")


if __name__ == "__main__":
    main()
