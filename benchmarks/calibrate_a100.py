"""Fit the A100 device constants on the published calibration runs and write them into the preset.

Reproduce with ``.venv/bin/python benchmarks/calibrate_a100.py`` (about four minutes on two cores:
tracing the 170 runs once takes most of a minute, then every candidate set of constants re-costs all
runs in about 0.1 s). Only the named constants of ``a100_data.FITTED`` are fitted, each inside its
plausible range (``profiler.devices``); the backward host cost is tied to the forward one
(``a100_data.TIED``); nothing depends on an individual row: the objective is the
mean absolute log error of the single-node runs and of the multi-node runs, weighted equally.
``--dry-run`` prints the result without writing it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from a100_data import (FITTED, START, TIED, add_data_argument, error_stats, fit, predict_all,  # noqa: E402
                       prepare_runs, read_runs)

from profiler.devices import CONSTANT_RANGES, write_device_constants  # noqa: E402
from vtrain_plugin.report import render_table  # noqa: E402

PRESET = "a100-sxm4-80gb"  # what a vTrain config's "A100" resolves to


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_argument(parser)
    parser.add_argument("--max-evals", type=int, default=2500, help="objective evaluations of the search")
    parser.add_argument("--dry-run", action="store_true", help="print the fit, write nothing")
    args = parser.parse_args()

    start = time.perf_counter()
    runs = read_runs(args.data)
    prepared = prepare_runs(runs)
    print(f"traced and prepared {len(runs)} runs in {time.perf_counter() - start:.1f} s")
    fit_start = time.perf_counter()
    constants, error = fit(prepared, START, max_evals=args.max_evals, log=print)
    print(f"fit in {time.perf_counter() - fit_start:.1f} s, mean absolute log error {error:.4f}")

    rows = [[name, f"{getattr(START, name):.4g}", f"{getattr(constants, name):.4g}",
             f"[{FITTED[name][0]:g}, {FITTED[name][1]:g}]", f"[{CONSTANT_RANGES[name][0]:g}, {CONSTANT_RANGES[name][1]:g}]"]
            for name in FITTED]
    print(render_table(rows, ["constant", "start", "fitted", "searched", "plausible"]))
    predicted = predict_all(prepared, constants)
    for source in ("single", "multi"):
        idx = [i for i, r in enumerate(runs) if r.source == source]
        s = error_stats(predicted[idx], [runs[i].measured_ms for i in idx])
        print(f"{source}-node: MAPE {s.mape:.2f}%  median {s.median:.2f}%  p90 {s.p90:.2f}%  bias {s.bias:+.2f}%")
    if not args.dry_run:
        values = {name: round(float(getattr(constants, name)), 6) for name in (*FITTED, *TIED)}
        write_device_constants(PRESET, values)
        print(f"wrote {len(values)} constants into the {PRESET} preset")
    print(f"total {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
