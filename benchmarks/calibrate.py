"""Fit a calibration file: the device constants of one (device, software stack) on measured runs.

``.venv/bin/python benchmarks/calibrate.py a100-sxm4-80gb megatron_deepspeed_2023`` reproduces the
shipped A100 file from the published A100 runs (about four minutes on two cores:
tracing the 170 runs once takes most of a minute, then every candidate set of constants re-costs all
runs in about 0.1 s). Only the named constants of ``a100_data.FITTED`` are fitted, each inside its
plausible range (``vtrain_plugin.hardware.devices``); the backward host cost is tied to the forward one
(``a100_data.TIED``); nothing depends on an individual row: the objective is the
mean absolute log error of the single-node runs and of the multi-node runs, weighted equally.
``--dry-run`` prints the result without writing it; the file goes to the user's calibration folder
(``$VTRAIN_CALIBRATION_DIR``, ...) unless ``--into-package`` asks for the package's own.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import a100_data  # noqa: E402
import h100_data  # noqa: E402
from a100_data import FITTED, START, add_data_argument, error_stats, fit, predict_all, prepare_runs  # noqa: E402

from vtrain_plugin.cli.render import render_table  # noqa: E402
from vtrain_plugin.hardware.devices import get_device  # noqa: E402
from vtrain_plugin.hardware.calibration import (CONSTANT_RANGES, OPTIONAL_CONSTANTS, Calibration, DeviceConstants,  # noqa: E402
                                                write_calibration)

# The measured data this script can fit on, per (device, software stack): where it comes from, how
# to read it, where the fit starts and which constants it fits.
DATASETS = {("a100-sxm4-80gb", "megatron_deepspeed_2023"): (
    "144 single-node and 26 multi-node A100 SXM 80GB iteration times published with vTrain (MICRO'24), "
    "../shared/data/a100_{single,multi}_node_calibration.csv: Megatron-DeepSpeed, fp16, full recompute, DGX A100 "
    "nodes with 8 x 200 Gb/s InfiniBand. Nelder-Mead bounded to each constant's plausible range on the mean "
    "absolute log error, single- and multi-node runs weighted equally; the backward per-kernel host cost is "
    "tied to the forward one.", a100_data.read_runs, lambda: START, FITTED),
    ("h100-sxm", "megatron_core_te"): (
    "4 published H100 runs (NVIDIA NeMo 24.07 performance summary, DGX H100, FP8 hybrid with TransformerEngine, "
    "Megatron-Core), ../shared/data/h100_published_calibration.csv: GPT-3 5B and 175B, Llama 2 7B and 70B. Only "
    "gemm_efficiency (FP8 GEMMs), attention_efficiency and hbm_efficiency are fitted (bounded Nelder-Mead on the "
    "mean absolute log error); host costs, kernel overhead and network efficiency are the A100 fit's "
    "(software and platform constants).", h100_data.read_runs, h100_data.start_constants, h100_data.FITTED_H100)}


def within_gemm_ceiling(fitted: dict[str, tuple[float, float, bool]], device: str) -> dict[str, tuple[float, float, bool]]:
    """The search ranges with the GEMM efficiency's top at the device's measured ceiling."""
    ceiling = get_device(device).gemm_ceiling
    if "gemm_efficiency" not in fitted or ceiling is None:
        return fitted
    low, high, log = fitted["gemm_efficiency"]
    return {**fitted, "gemm_efficiency": (low, min(high, ceiling), log)}


def leave_one_out(prepared, start, fitted, max_evals: int) -> list[tuple[str, float, float]]:
    """Per run: refit without it, predict it; (name, predicted ms, measured ms)."""
    out = []
    for i, held in enumerate(prepared):
        constants, _ = fit([p for j, p in enumerate(prepared) if j != i], start, max_evals=max_evals, fitted=fitted)
        out.append((held.run.model.name or str(i), float(predict_all([held], constants)[0]), held.measured.measured_ms))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("device", help="device preset, e.g. a100-sxm4-80gb")
    parser.add_argument("stack", help="software stack, e.g. megatron_deepspeed_2023")
    add_data_argument(parser)
    parser.add_argument("--into-package", action="store_true",
                        help="write into the package's calibration folder instead of the user's")
    parser.add_argument("--max-evals", type=int, default=2500, help="objective evaluations of the search")
    parser.add_argument("--dry-run", action="store_true", help="print the fit, write nothing")
    args = parser.parse_args()
    dataset = DATASETS.get((args.device, args.stack))
    if dataset is None:
        parser.error(f"no measured data for ({args.device}, {args.stack}); have: "
                     f"{', '.join(f'{d} {s}' for d, s in DATASETS)}")

    source, read_runs, start_constants, fitted = dataset
    fitted = within_gemm_ceiling(fitted, args.device)
    base = start_constants()
    start = time.perf_counter()
    runs = read_runs(args.data)
    prepared = prepare_runs(runs)
    print(f"traced and prepared {len(runs)} runs in {time.perf_counter() - start:.1f} s")
    fit_start = time.perf_counter()
    constants, error = fit(prepared, base, max_evals=args.max_evals, fitted=fitted, log=print)
    print(f"fit in {time.perf_counter() - fit_start:.1f} s, mean absolute log error {error:.4f}")

    rows = [[name, f"{getattr(base, name):.4g}", f"{getattr(constants, name):.4g}",
             f"[{fitted[name][0]:g}, {fitted[name][1]:g}]", f"[{CONSTANT_RANGES[name][0]:g}, {CONSTANT_RANGES[name][1]:g}]"]
            for name in fitted]
    print(render_table(rows, ["constant", "start", "fitted", "searched", "plausible"]))
    predicted = predict_all(prepared, constants)
    for nodes in sorted({r.source for r in runs}, reverse=True):
        idx = [i for i, r in enumerate(runs) if r.source == nodes]
        s = error_stats(predicted[idx], [runs[i].measured_ms for i in idx])
        print(f"{nodes}-node: MAPE {s.mape:.2f}%  median {s.median:.2f}%  p90 {s.p90:.2f}%  bias {s.bias:+.2f}%")
    if len(runs) <= 10:
        loo = leave_one_out(prepared, base, fitted, args.max_evals)
        print(render_table([[n, f"{p:,.1f}", f"{m:,.1f}", f"{100 * (p - m) / m:+.1f}%"] for n, p, m in loo],
                           ["left out", "predicted ms", "measured ms", "error"]))
        s = error_stats([p for _, p, _ in loo], [m for _, _, m in loo])
        print(f"leave-one-out: MAPE {s.mape:.2f}%  max {max(abs(100 * (p - m) / m) for _, p, m in loo):.2f}%  "
              f"bias {s.bias:+.2f}%")
    if not args.dry_run:
        names = [n for n in CONSTANT_RANGES if n not in OPTIONAL_CONSTANTS or getattr(constants, n) != OPTIONAL_CONSTANTS[n]]
        values = {name: round(float(getattr(constants, name)), 6) for name in names}
        calibration = Calibration(device=args.device, software_stack=args.stack, source=source,
                                  command=f".venv/bin/python benchmarks/calibrate.py {args.device} {args.stack}",
                                  constants=DeviceConstants(**values))
        path = write_calibration(calibration, into_package=args.into_package)
        print(f"wrote {len(values)} constants to {path}")
    print(f"total {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
