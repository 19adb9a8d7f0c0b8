"""Fit a calibration file: the device constants of one (device, software stack) on measured runs.

``.venv/bin/python -m benchmarks.accuracy.calibrate a100-sxm4-80gb megatron_deepspeed_2023`` reproduces the
shipped A100 file from the published A100 runs: a joint fit on vTrain's 144 single-node and 26
multi-node runs and the 10 large-scale runs of Narayanan et al. (SC'21, ``sc21_data.py``; tracing
the 180 runs once takes about a minute on two cores, then every candidate set of constants re-costs
all runs). Only the named constants of ``a100_data.FITTED`` are fitted, each inside its
plausible range (``vtrain_plugin.hardware.devices``); the backward host cost is tied to the forward one
(``a100_data.TIED``); nothing depends on an individual row: the objective is the mean absolute log
error of each source of runs (single-node, multi-node, SC'21), the sources weighted equally.
Then leave-one-out over the runs that judge the fit beyond its bulk (the SC'21 runs for the A100,
every run for the H100): refit without each, predict it (one more fit per run; ``--no-loo`` skips it).
``--dry-run`` prints the result without writing it; the file goes to the user's calibration folder
(``$VTRAIN_CALIBRATION_DIR``, ...) unless ``--into-package`` asks for the package's own.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.accuracy import h100_data, sc21_data
from benchmarks.accuracy.a100_data import (FITTED, SOURCE_LABELS, START, MeasuredRun, PreparedRun, add_data_argument,
                       error_stats, fit, predict_all, prepare_runs)

from vtrain_plugin.cli.render import render_table
from vtrain_plugin.hardware.calibration import (CONSTANT_RANGES, OPTIONAL_CONSTANTS, Calibration, DeviceConstants,
                                                write_calibration)

@dataclass(frozen=True, slots=True, kw_only=True)
class Dataset:
    """The measured data this script can fit on for one (device, software stack)."""

    source: str  # the calibration file's provenance text
    read_runs: Callable[[Path], list[MeasuredRun]]
    start: Callable[[], DeviceConstants]  # where the fit starts
    fitted: Mapping[str, tuple[float, float, bool]]  # the constants it fits, as a100_data.FITTED
    left_out: str  # the source of the runs that leave-one-out refits without, one at a time


DATASETS = {("a100-sxm4-80gb", "megatron_deepspeed_2023"): Dataset(
    source="Joint fit on three sets of A100 SXM 80GB iteration times (Megatron fp16 with fused kernels, full "
    "recompute, DGX A100 nodes with 8 x 200 Gb/s InfiniBand): the 144 single-node and 26 multi-node runs published "
    "with vTrain (MICRO'24, Megatron-DeepSpeed, benchmarks/data/a100_{single,multi}_node_calibration.csv) and the "
    "10 runs of Narayanan et al. SC'21 Table 1 (Megatron-LM 2021, GPT 1.7B to 1T on 32 to 3,072 GPUs, "
    "benchmarks/data/a100_published_megatron_sc21.csv). Nelder-Mead bounded to each constant's plausible range on "
    "the mean absolute log error, the three sets weighted equally; the backward per-kernel host cost is tied to "
    "the forward one.", read_runs=sc21_data.joint_a100_runs, start=lambda: START, fitted=FITTED, left_out="sc21"),
    ("h100-sxm", "megatron_core_te"): Dataset(
    source="4 published H100 runs (NVIDIA NeMo 24.07 performance summary, DGX H100, FP8 hybrid with "
    "TransformerEngine, Megatron-Core), benchmarks/data/h100_published_calibration.csv: GPT-3 5B and 175B, Llama 2 "
    "7B and 70B. Only gemm_efficiency (FP8 GEMMs), attention_efficiency and hbm_efficiency are fitted (bounded "
    "Nelder-Mead on the mean absolute log error); host costs, kernel overhead, network efficiency and GPU speed spread are the A100 "
    "fit's (software and platform constants).", read_runs=h100_data.read_runs, start=h100_data.start_constants,
    fitted=h100_data.FITTED_H100, left_out="h100")}


def leave_one_out(prepared: Sequence[PreparedRun], start: DeviceConstants,
                  fitted: Mapping[str, tuple[float, float, bool]], max_evals: int,
                  held_out: Sequence[int] | None = None) -> list[tuple[str, float, float]]:
    """Per run of ``held_out`` (indices into ``prepared``; None: every run): refit on all the other
    runs, predict it; (name, predicted ms, measured ms). A subset lets the few runs of one source be
    judged while the fit keeps every run of the others."""
    out = []
    for i in range(len(prepared)) if held_out is None else held_out:
        held = prepared[i]
        constants, _ = fit([p for j, p in enumerate(prepared) if j != i], start, max_evals=max_evals, fitted=fitted)
        out.append((held.run.model.name or str(i), float(predict_all([held], constants)[0]), held.measured.measured_ms))
    return out


def print_leave_one_out(prepared: Sequence[PreparedRun], dataset: Dataset, base: DeviceConstants,
                        max_evals: int) -> None:
    held_out = [i for i, p in enumerate(prepared) if p.measured.source == dataset.left_out]
    loo = leave_one_out(prepared, base, dataset.fitted, max_evals, held_out)
    print(render_table([[n, f"{p:,.1f}", f"{m:,.1f}", f"{100 * (p - m) / m:+.1f}%"] for n, p, m in loo],
                       ["left out", "predicted ms", "measured ms", "error"]))
    s = error_stats([p for _, p, _ in loo], [m for _, _, m in loo])
    print(f"{SOURCE_LABELS[dataset.left_out]} leave-one-out: MAPE {s.mape:.2f}%  "
          f"max {max(abs(100 * (p - m) / m) for _, p, m in loo):.2f}%  bias {s.bias:+.2f}%")


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("device", help="device preset, e.g. a100-sxm4-80gb")
    parser.add_argument("stack", help="software stack, e.g. megatron_deepspeed_2023")
    add_data_argument(parser)
    parser.add_argument("--into-package", action="store_true",
                        help="write into the package's calibration folder instead of the user's")
    parser.add_argument("--max-evals", type=int, default=2500, help="objective evaluations of the search")
    parser.add_argument("--dry-run", action="store_true", help="print the fit, write nothing")
    parser.add_argument("--no-loo", action="store_true", help="skip the leave-one-out refits")
    args = parser.parse_args()
    dataset = DATASETS.get((args.device, args.stack))
    if dataset is None:
        parser.error(f"no measured data for ({args.device}, {args.stack}); have: "
                     f"{', '.join(f'{d} {s}' for d, s in DATASETS)}")

    base, fitted = dataset.start(), dataset.fitted
    start = time.perf_counter()
    runs = dataset.read_runs(args.data)
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
    for source in dict.fromkeys(r.source for r in runs):
        idx = [i for i, r in enumerate(runs) if r.source == source]
        s = error_stats(predicted[idx], [runs[i].measured_ms for i in idx])
        print(f"{SOURCE_LABELS[source]}: MAPE {s.mape:.2f}%  median {s.median:.2f}%  p90 {s.p90:.2f}%  "
              f"bias {s.bias:+.2f}%")
    if not args.no_loo:
        print_leave_one_out(prepared, dataset, base, args.max_evals)
    if not args.dry_run:
        names = [n for n in CONSTANT_RANGES if n not in OPTIONAL_CONSTANTS or getattr(constants, n) != OPTIONAL_CONSTANTS[n]]
        values = {name: round(float(getattr(constants, name)), 6) for name in names}
        calibration = Calibration(device=args.device, software_stack=args.stack, source=dataset.source,
                                  command=f".venv/bin/python -m benchmarks.accuracy.calibrate {args.device} {args.stack}",
                                  constants=DeviceConstants(**values))
        path = write_calibration(calibration, into_package=args.into_package)
        print(f"wrote {len(values)} constants to {path}")
    print(f"total {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
