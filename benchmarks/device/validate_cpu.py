"""Accuracy of CPU predictions: profile the tiny GPT plan once, then validate it five times.

    python -m benchmarks.device.validate_cpu [--plan PLAN] [--db PATH] [--runs 5] [--iterations 3]

Prints predicted and measured iteration times, the error of each run and the median absolute
error. The machine's 1-minute load average is printed with each run: other processes on the
cores make the measured side slower than the profile says, and that shows there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from profiler.db import ProfileDB
from profiler.replay import profile_kernels
from vtrain_plugin.runs import load_run_config
from vtrain_plugin.cli.render import render_table
from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.measured.one_device import validate
from vtrain_plugin.measured.one_device import single_device_run

PLAN = Path(__file__).resolve().parents[2] / "examples" / "plans" / "gpt_tiny_cpu.yaml"


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default=str(PLAN))
    parser.add_argument("--db", help="profile database (default: a temporary file)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db_path = args.db or os.path.join(tmp, "profiles.sqlite")
        run = load_run_config(args.plan)
        single, _ = single_device_run(run, "cpu")
        with ProfileDB.open(db_path) as db:
            summary = profile_kernels(trace(single.model, single.parallel).unique_kernels(), "cpu", db)
        print(f"profiled {summary.measured} kernels ({summary.skipped} already there, {len(summary.failed)} failed)")
        rows, errors = [], []
        for i in range(args.runs):
            load = os.getloadavg()[0]
            result = validate(run, device="cpu", db_path=db_path, iterations=args.iterations)
            c = result.comparison
            errors.append(abs(c.error_pct))
            rows.append([str(i + 1), f"{c.predicted_ms:,.1f}", f"{c.measured_ms:,.1f}", f"{c.error_pct:+.1f}%",
                         f"{result.peak_memory_measured_gib:.2f}", f"{load:.2f}"])
            print(f"run {i + 1}: {c.error_pct:+.1f}%", file=sys.stderr)
    print(f"{run.source} on {result.device}, {args.iterations} iterations per run after 1 warm-up")
    print(render_table(rows, ["run", "predicted ms", "measured ms", "error", "peak GiB", "load"]))
    print(f"median absolute error: {statistics.median(errors):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
