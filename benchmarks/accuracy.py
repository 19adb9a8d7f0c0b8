"""Accuracy of the A100 estimates against the published calibration runs (not a pass/fail test).

Converts every row of the calibration CSVs to a vTrain config, estimates it with the A100 preset as
calibrated (exactly what ``vtrain estimate --format jsonl`` prints), and prints MAPE, median and
90th-percentile absolute error and the signed bias, overall and by TP, PP, micro-batch and hidden
size, single-node and multi-node apart. Then a leave-one-group-out cross-validation: the constants are
refitted without one hidden size (or one TP size), starting from the documented typical values, and
the left-out runs are predicted; pooled over the folds, that is the honest proxy for held-out runs.
Writes a predicted-vs-measured plot (matplotlib). Then the H100 section: the four published NeMo
H100 runs predicted with the shipped h100-sxm megatron_core_te constants (calibration) and
leave-one-out (three H100 constants refitted without each run, as ``calibrate.py`` fits them), with
a plot of its own. Last, one summary table: A100 single- and multi-node (calibration and each
cross-validation), H100 (calibration and leave-one-out), each with MAPE, median, p90 and bias.

Run with ``.venv/bin/python benchmarks/accuracy.py`` (about 6 minutes on two cores; ``--no-cv``:
under one minute).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from a100_data import (START, MeasuredRun, PreparedRun, add_data_argument, error_stats, fit,  # noqa: E402
                       grouped, predict_all, prepare_runs, read_runs)

import h100_data  # noqa: E402
from calibrate import leave_one_out  # noqa: E402

from vtrain_plugin.hardware.calibration import calibration_for  # noqa: E402
from vtrain_plugin.estimate import estimate  # noqa: E402
from vtrain_plugin.cli.render import render_table  # noqa: E402

GROUPS = (("tp", "TP"), ("pp", "PP"), ("micro_batch", "micro-batch"), ("hidden", "hidden"))
HEADER = ["group", "runs", "MAPE %", "median %", "p90 %", "bias %"]
SUMMARY_HEADER = ["data", "evaluation", "runs", "MAPE %", "median %", "p90 %", "bias %"]


def stats_row(label: str, predicted: np.ndarray, measured: np.ndarray) -> list[str]:
    s = error_stats(predicted, measured)
    return [label, str(s.count), f"{s.mape:.2f}", f"{s.median:.2f}", f"{s.p90:.2f}", f"{s.bias:+.2f}"]


def accuracy_tables(runs: Sequence[MeasuredRun], predicted: np.ndarray) -> str:
    measured = np.array([r.measured_ms for r in runs])
    out = []
    for source in ("single", "multi"):
        idx = [i for i, r in enumerate(runs) if r.source == source]
        if not idx:
            continue
        rows = [stats_row("all", predicted[idx], measured[idx])]
        sub = [runs[i] for i in idx]
        for key, title in GROUPS:
            for value, members in grouped(sub, lambda r: r.group(key)).items():
                pick = [idx[j] for j in members]
                rows.append(stats_row(f"{title} {value}", predicted[pick], measured[pick]))
        out.append(f"{source}-node runs\n{render_table(rows, HEADER)}")
    return "\n\n".join(out)


def cross_validate(prepared: Sequence[PreparedRun], key: str, max_evals: int) -> tuple[np.ndarray, list[list[str]]]:
    """Leave one value of ``key`` out at a time: refit on the rest, predict it."""
    runs = [p.measured for p in prepared]
    predicted = np.full(len(runs), np.nan)
    rows = []
    for value, members in grouped(runs, lambda r: r.group(key)).items():
        held = set(members)
        train = [p for i, p in enumerate(prepared) if i not in held]
        start = time.perf_counter()
        constants, _ = fit(train, START, max_evals=max_evals)
        test = [prepared[i] for i in members]
        predicted[members] = predict_all(test, constants)
        measured = np.array([runs[i].measured_ms for i in members])
        s = error_stats(predicted[members], measured)
        rows.append([f"{key} {value} left out", str(s.count), f"{s.mape:.2f}", f"{s.median:.2f}", f"{s.p90:.2f}",
                     f"{s.bias:+.2f}", f"{time.perf_counter() - start:.0f} s"])
    return predicted, rows


def h100_predictions(data: Path, max_evals: int) -> tuple[list[MeasuredRun], np.ndarray, np.ndarray]:
    """The published H100 runs, their estimates with the shipped constants and their leave-one-out
    estimates (the three H100 constants refitted without the run)."""
    runs = h100_data.read_runs(data)
    prepared = prepare_runs(runs)
    predicted = predict_all(prepared, calibration_for("h100-sxm", "megatron_core_te").constants)
    loo = np.array([p for _, p, _ in leave_one_out(prepared, h100_data.start_constants(), h100_data.FITTED_H100,
                                                   max_evals)])
    return runs, predicted, loo


def h100_tables(runs: Sequence[MeasuredRun], predicted: np.ndarray, loo: np.ndarray) -> str:
    """Per published H100 run and pooled: the shipped constants' error and the leave-one-out error."""
    measured = np.array([r.measured_ms for r in runs])
    per_run = [[r.run.model.name, f"{m:,.1f}", f"{p:,.1f}", f"{100 * (p - m) / m:+.1f}", f"{q:,.1f}",
                f"{100 * (q - m) / m:+.1f}"] for r, m, p, q in zip(runs, measured, predicted, loo)]
    pooled = [stats_row("calibration", predicted, measured), stats_row("leave-one-out", loo, measured)]
    return (f"H100 runs (NeMo 24.07, FP8, megatron_core_te)\n"
            f"{render_table(per_run, ['run', 'measured ms', 'calibrated ms', 'error %', 'left out ms', 'error %'])}"
            f"\n\n{render_table(pooled, HEADER)}")


def plot(series: Sequence[tuple[str, str, np.ndarray, np.ndarray]], title: str, path: Path) -> None:
    """Predicted against measured iteration times on log axes, one marker per ``(label, marker,
    measured, predicted)`` series, with the diagonal and +-10% lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = np.concatenate([np.concatenate([m, p]) for _, _, m, p in series])
    fig, ax = plt.subplots(figsize=(6, 6))
    for label, marker, measured, predicted in series:
        ax.scatter(measured, predicted, s=14, marker=marker, label=f"{label} ({len(measured)})")
    low, high = 0.8 * values.min(), 1.25 * values.max()
    ax.plot([low, high], [low, high], "k-", lw=0.8)
    for f in (0.9, 1.1):
        ax.plot([low, high], [f * low, f * high], "k:", lw=0.6)
    ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), xlabel="measured iteration (ms)",
           ylabel="predicted iteration (ms)", title=f"{title} (dotted: ±10%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def a100_series(runs: Sequence[MeasuredRun], predicted: np.ndarray) -> list[tuple[str, str, np.ndarray, np.ndarray]]:
    measured = np.array([r.measured_ms for r in runs])
    series = []
    for source, marker in (("single", "o"), ("multi", "^")):
        idx = [i for i, r in enumerate(runs) if r.source == source]
        series.append((f"{source}-node", marker, measured[idx], predicted[idx]))
    return series


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_argument(parser)
    results = Path(__file__).resolve().parent / "results"
    parser.add_argument("--plot", type=Path, default=results / "a100_accuracy.png", help="A100 predicted-vs-measured PNG")
    parser.add_argument("--h100-plot", type=Path, default=results / "h100_accuracy.png",
                        help="H100 predicted-vs-measured PNG (calibration and leave-one-out)")
    parser.add_argument("--no-cv", action="store_true", help="skip the cross-validations and the H100 leave-one-out")
    parser.add_argument("--cv-evals", type=int, default=800, help="objective evaluations per refit")
    args = parser.parse_args()

    start = time.perf_counter()
    runs = read_runs(args.data)
    prepared = prepare_runs(runs)
    constants = calibration_for("a100-sxm4-80gb", "megatron_deepspeed_2023").constants
    predicted = predict_all(prepared, constants)
    for i in (0, len(runs) - 1):  # the fast path is the estimator's own code: check it agrees
        if abs(estimate(runs[i].run).iteration_time_ms - predicted[i]) > 1e-9 * predicted[i]:
            raise SystemExit(f"run {i}: the calibration path disagrees with estimate()")
    print(f"estimated {len(runs)} runs in {time.perf_counter() - start:.1f} s (tracing included)\n")
    print(accuracy_tables(runs, predicted))
    print()
    plot(a100_series(runs, predicted), "vtrain on A100 (calibration runs)", args.plot)
    measured = np.array([r.measured_ms for r in runs])
    sources = {source: [i for i, r in enumerate(runs) if r.source == source] for source in ("single", "multi")}
    summary = [[f"A100 {source}-node", *stats_row("calibration", predicted[idx], measured[idx])]
               for source, idx in sources.items()]
    if args.no_cv:
        print(f"\nsummary\n{render_table(summary, SUMMARY_HEADER)}")
        return
    h100_runs, h100_predicted, h100_loo = h100_predictions(args.data, args.cv_evals)
    print(h100_tables(h100_runs, h100_predicted, h100_loo))
    h100_measured = np.array([r.measured_ms for r in h100_runs])
    plot([("calibration", "o", h100_measured, h100_predicted), ("leave-one-out", "^", h100_measured, h100_loo)],
         "vtrain on H100 (NeMo 24.07 runs)", args.h100_plot)
    for key in ("hidden", "tp"):
        cv_start = time.perf_counter()
        cv, rows = cross_validate(prepared, key, args.cv_evals)
        for source, idx in sources.items():
            rows.append([f"pooled, {source}-node", *stats_row("", cv[idx], measured[idx])[1:], ""])
            summary.append([f"A100 {source}-node", *stats_row(f"leave-one-{key}-out", cv[idx], measured[idx])])
        print(f"\nleave-one-{key}-out cross-validation ({time.perf_counter() - cv_start:.0f} s)")
        print(render_table(rows, [*HEADER, "fit"]))
    summary.sort(key=lambda row: row[0] != "A100 single-node")
    summary += [["H100", *stats_row("calibration", h100_predicted, h100_measured)],
                ["H100", *stats_row("leave-one-out", h100_loo, h100_measured)]]
    print(f"\nsummary\n{render_table(summary, SUMMARY_HEADER)}")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
