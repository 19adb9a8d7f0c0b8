"""The kernel model against kernels profiled on a GPU, by op class, for the ground-truth plans.

    .venv/bin/python -m benchmarks.accuracy.kernel_classes [--plans NAME,...] [--profiles benchmarks/results/h100_profiles.json]
        [--gpu h100-sxm] [--top 12]

Where does the analytical estimate of ``h100_validation.py``'s plans go wrong? Each plan (its
one-device run, as the real step trains it) is traced here, every unique kernel is looked up in the
profile export measured on the card and timed by the kernel model the estimator uses (the device's
``default`` calibration), and the totals of one micro-batch plus the optimizer step (each kernel
times how often it runs) are printed per op class and op: analytic against measured, and the error.
The iteration-level comparison is ``h100_validation.csv``; this says which kernels make it up.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
from pathlib import Path

from vtrain_plugin.cli.render import render_table

RESULTS = Path(__file__).resolve().parents[1] / "results"


def class_totals(name: str, mapping: dict, gpu: str, db_path: Path) -> tuple[dict[str, list[float]], int, int]:
    """``op class:op -> [analytic ns, measured ns, kernels]`` over the plan's measured kernels, with
    the counts of unique and of measured kernels."""
    from profiler.lookup import measured_durations
    from vtrain_plugin.capture.tracer import trace
    from vtrain_plugin.core.op_names import parse_op_name
    from vtrain_plugin.cost.kernels.model import KernelModel
    from vtrain_plugin.cost.kernels.op_classes import classify
    from vtrain_plugin.hardware.calibration import calibration_for
    from vtrain_plugin.hardware.devices import get_device
    from vtrain_plugin.measured import one_device
    from vtrain_plugin.runs import run_config_from_dict, with_gpu

    device = get_device(gpu)
    model = KernelModel(device, calibration_for(device.name, "default").constants)
    run = run_config_from_dict(mapping, source=name)
    single, _ = one_device.single_device_run(run, "cpu")
    single = with_gpu(single, gpu)  # the one-device run of the card the profiles are from
    graph = trace(single.model, single.parallel)
    unique = graph.unique_kernels()
    measured = measured_durations(list(unique), gpu, db_path=db_path)
    example = {op.key: op for s in graph.stages for b in s.blocks for op in b.ops()}
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for key, kernel in unique.items():
        if key not in measured:
            continue
        label = f"{classify(key.op).value}: {parse_op_name(key.op).base}"
        totals[label][0] += model.duration_ns(example[key]) * kernel.count
        totals[label][1] += measured[key] * kernel.count
        totals[label][2] += kernel.count
    return totals, len(unique), len(measured)


def rows(totals: dict[str, list[float]], top: int) -> list[list[str]]:
    ordered = sorted(totals.items(), key=lambda kv: -kv[1][1])
    out = [[label, f"{n:,}", f"{a / 1e6:,.2f}", f"{m / 1e6:,.2f}", f"{100 * (a / m - 1):+.0f}"]
           for label, (a, m, n) in ordered[:top] if m > 0]
    a, m = sum(v[0] for v in totals.values()), sum(v[1] for v in totals.values())
    return out + [["all", f"{sum(v[2] for v in totals.values()):,}", f"{a / 1e6:,.2f}", f"{m / 1e6:,.2f}",
                   f"{100 * (a / m - 1):+.0f}"]]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.device.h100_validation import PLANS
    from profiler.db import ProfileDB

    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--plans", default="qwen3-0.6b_mb1_none,mla-0.5b_mb1_none,ci-gpt-126m_mb4_none",
                        help=f"comma-separated, of: {', '.join(PLANS)}")
    parser.add_argument("--profiles", type=Path, default=RESULTS / "h100_profiles.json")
    parser.add_argument("--gpu", default="h100-sxm", help="device preset the profiles were measured on")
    parser.add_argument("--top", type=int, default=12, help="op classes shown per plan, by measured time")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.plans.split(",") if n.strip()]
    unknown = [n for n in names if n not in PLANS]
    if unknown:
        parser.error(f"--plans: unknown plan {unknown[0]!r}")
    overall: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    with tempfile.TemporaryDirectory() as tmp:
        db_path = Path(tmp) / "profiles.sqlite"
        with ProfileDB.open(db_path) as db:
            db.import_(args.profiles)
        for name in names:
            totals, n_unique, n_measured = class_totals(name, PLANS[name], args.gpu, db_path)
            print(f"\n{name}: {n_measured} of {n_unique} unique kernels profiled; one micro-batch and the "
                  f"optimizer step, ms")
            print(render_table(rows(totals, args.top), ["op class: op", "kernels", "analytic", "measured", "err %"]))
            for label, values in totals.items():
                for i in range(3):
                    overall[label][i] += values[i]
    print(f"\nall {len(names)} plans")
    print(render_table(rows(overall, args.top), ["op class: op", "kernels", "analytic", "measured", "err %"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
