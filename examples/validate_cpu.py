"""Trace a GPT plan, profile its kernels on this CPU, then train it for real and compare.

    python examples/validate_cpu.py [PLAN]      (default: examples/plans/gpt_tiny_cpu.yaml)

The profile goes to the default database ($VTRAIN_PROFILE_DB or ~/.cache/vtrain/profiles.sqlite);
kernels already there are not measured again.
"""

import sys
from pathlib import Path

import vtrain_plugin as vtrain
from profiler.db import ProfileDB
from profiler.replay import profile_kernels
from vtrain_plugin.cli.render import validation_table

plan = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parent / "plans" / "gpt_tiny_cpu.yaml")
run = vtrain.load_run_config(plan)

# 1. trace: the operator graph of one training iteration (one device, as validate runs it)
single, _ = vtrain.single_device_run(run, "cpu")
graph = vtrain.trace(single.model, single.parallel)

# 2. profile: replay each unique kernel on this CPU and store its duration
with ProfileDB.open() as db:
    summary = profile_kernels(graph.unique_kernels(), "cpu", db)
print(f"{summary.measured} kernels measured, {summary.skipped} already profiled, {len(summary.failed)} failed")

# 3. validate: train the real model for a few iterations and compare with the estimate
result = vtrain.validate(run, device="cpu", iterations=3)
print(validation_table(result))

# The same comparison for your own training loop:
#   recorder = vtrain.IterationRecorder(warmup=1)
#   for batch in data:
#       with recorder:
#           train_step(batch)
#   print(recorder.compare(vtrain.estimate(run)).error_pct)
