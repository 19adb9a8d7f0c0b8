"""The kernel model against kernels profiled on a GPU, by op class, for the ground-truth plans.

    .venv/bin/python -m benchmarks.accuracy.kernel_classes [--plans NAME,...] [--profiles benchmarks/results/h100_profiles.json]
        [--gpu h100-sxm] [--top 12]

Where does the analytical estimate of ``h100_validation.py``'s plans go wrong? Each plan (its
one-device run, as the real step trains it) is traced here, every unique kernel is looked up in the
profile export measured on the card and timed by the kernel model the estimator uses (the device's
``default`` calibration), and the totals of one micro-batch plus the optimizer step (each kernel
times how often it runs) are printed per op class and op: analytic against measured, and the error.
The iteration-level comparison is ``h100_validation.csv``; this says which kernels make it up.

``--by-size`` prints the memory-bound kernels (neither GEMM nor attention) by bytes moved instead:
measured against modelled, and the bandwidth reached, as a share of the datasheet's weighted by
time; then the two constants of the memory-bound model (``kernel_overhead_ns`` and
``hbm_efficiency``) fitted to the streaming sweep (``h100_kernel_sweep.csv``) and its error by size.
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


SIZE_EDGES_MIB = (0, 1, 16, 64, 256, 1 << 20)


def kernel_rows(name: str, mapping: dict, gpu: str, db_path: Path) -> list[tuple[float, float, float, int]]:
    """``(nbytes, modelled ns, measured ns, count)`` of the plan's measured memory-bound kernels."""
    from profiler.lookup import measured_durations
    from vtrain_plugin.capture.tracer import trace
    from vtrain_plugin.cost.kernels.model import KernelBatch, KernelKind, KernelModel
    from vtrain_plugin.hardware.calibration import calibration_for
    from vtrain_plugin.hardware.devices import get_device
    from vtrain_plugin.measured import one_device
    from vtrain_plugin.runs import run_config_from_dict, with_gpu

    device = get_device(gpu)
    model = KernelModel(device, calibration_for(device.name, "default").constants)
    single, _ = one_device.single_device_run(run_config_from_dict(mapping, source=name), "cpu")
    graph = trace(with_gpu(single, gpu).model, single.parallel)
    unique = graph.unique_kernels()
    measured = measured_durations(list(unique), gpu, db_path=db_path)
    example = {op.key: op for s in graph.stages for b in s.blocks for op in b.ops()}
    out = []
    for key, kernel in unique.items():
        batch = KernelBatch.of([example[key]])
        if key in measured and batch.kind[0] == KernelKind.OTHER:
            out.append((float(batch.nbytes[0]), float(model.device_ns(batch)[0]), measured[key], kernel.count))
    return out


def size_rows(kernels: list[tuple[float, float, float, int]], hbm_gbytes_per_s: float) -> list[list[str]]:
    import numpy as np

    out = []
    for low, high in zip(SIZE_EDGES_MIB, SIZE_EDGES_MIB[1:]):
        sel = [k for k in kernels if low * 2**20 <= k[0] < high * 2**20]
        if not sel:
            continue
        nbytes, model, meas, count = (np.array(c, float) for c in zip(*sel))
        out.append([f"{low:,}-{high:,} MiB" if high < 1 << 20 else f">= {low:,} MiB", f"{len(sel)}",
                    f"{np.median(meas) / 1e3:.1f}", f"{np.median(model) / 1e3:.1f}",
                    f"{100 * ((model * count).sum() / (meas * count).sum() - 1):+.0f}",
                    f"{(nbytes * count).sum() / (meas * count).sum() / hbm_gbytes_per_s:.2f}"])
    return out


def sweep_fit(sweep: Path, hbm_gbytes_per_s: float) -> str:
    """``t = overhead + nbytes / (bandwidth * efficiency)`` fitted to the sweep's streaming kernels
    (least squares on the relative error), and its error by size."""
    import csv

    import numpy as np

    rows = [r for r in csv.DictReader(sweep.open()) if r["kind"] == "stream"]
    nbytes = np.array([float(r["bytes"]) for r in rows])
    ns = np.array([float(r["median_us"]) * 1e3 for r in rows])
    a = np.c_[np.ones_like(nbytes), nbytes / hbm_gbytes_per_s] / ns[:, None]
    (overhead, inverse), *_ = np.linalg.lstsq(a, np.ones_like(ns), rcond=None)
    err = (overhead + inverse * nbytes / hbm_gbytes_per_s) / ns - 1
    table = [[f"{low:,}-{high:,} MiB" if high < 1 << 20 else f">= {low:,} MiB", f"{sel.sum()}",
              f"{100 * np.abs(err[sel]).mean():.1f}", f"{100 * err[sel].mean():+.1f}"]
             for low, high in zip(SIZE_EDGES_MIB, SIZE_EDGES_MIB[1:])
             if (sel := (nbytes >= low * 2**20) & (nbytes < high * 2**20)).any()]
    return (f"streaming sweep ({len(rows)} kernels): kernel_overhead_ns {overhead:.0f}, hbm_efficiency "
            f"{1 / inverse:.3f}\n" + render_table(table, ["bytes", "kernels", "MAPE %", "bias %"]))


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
    parser.add_argument("--by-size", action="store_true", help="memory-bound kernels by bytes moved (see above)")
    parser.add_argument("--sweep", type=Path, default=RESULTS / "h100_kernel_sweep.csv")
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
        if args.by_size:
            from vtrain_plugin.hardware.devices import get_device

            hbm = get_device(args.gpu).hbm_bytes_per_ns
            kernels = [k for name in names for k in kernel_rows(name, PLANS[name], args.gpu, db_path)]
            print(f"memory-bound kernels of {', '.join(names)}, {args.gpu} ({hbm:,.0f} GB/s datasheet)")
            print(render_table(size_rows(kernels, hbm), ["bytes", "kernels", "measured us (median)",
                                                         "analytic us (median)", "err % (by time)",
                                                         "share of HBM (by time)"]))
            print("\n" + sweep_fit(args.sweep, hbm))
            return 0
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
