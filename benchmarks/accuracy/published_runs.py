"""Accuracy of the A100 and H100 estimates against the published runs (not a pass/fail test).

Converts every row of the vTrain calibration CSVs to a vTrain config, estimates it with the A100 preset
as calibrated (exactly what ``vtrain estimate --format jsonl`` prints), and prints MAPE, median and
90th-percentile absolute error and the signed bias, overall and by TP, PP, micro-batch and hidden
size, single-node and multi-node apart. Then the SC'21 set (``sc21_data.py``: GPT 1.7B to 1T on 32
to 3,072 A100, part of the same joint A100 calibration): the error of each run and pooled. Then the
signed bias of every A100 run (vTrain and SC'21) by scale, GPUs against parameters: the fit weighs
three sets of very different sizes, and a bias that grows with scale is what a joint fit hides in
its pooled figures. Predicted-vs-measured plots (matplotlib) for the vTrain and the SC'21 runs.

Then the refits, each starting from the documented typical values as ``calibrate.py`` does: a
leave-one-group-out cross-validation of the vTrain runs (the constants refitted without one hidden
size, or one TP size, and the SC'21 runs; the left-out runs predicted; pooled over the folds, the
honest proxy for held-out runs), leave-one-out of the SC'21 runs (refitted on every vTrain run and
the nine other SC'21 runs), and the H100 section: the four published NeMo H100 runs predicted with
the shipped h100-sxm megatron_core_te constants (calibration) and leave-one-out (three H100 constants
refitted without each run), with a plot of its own. Last, one summary table: A100 single- and
multi-node (calibration and each cross-validation), SC'21 (calibration and leave-one-out), H100
(calibration and leave-one-out), each with MAPE, median, p90 and bias.

Run with ``.venv/bin/python -m benchmarks.accuracy.published_runs`` (about 20 minutes on two cores: each refit is
``--cv-evals`` evaluations of about 0.1 s, and the ten SC'21 refits add some 13 minutes to the
earlier 6; ``--no-cv``: no refit, under two minutes, most of it tracing the 180 A100 runs, seconds
once the trace cache holds them).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.accuracy.a100_data import (FITTED, START, MeasuredRun, PreparedRun, add_data_argument, error_stats, fit,
                       grouped, predict_all, prepare_runs, read_runs)

from benchmarks.accuracy import h100_data, sc21_data
from benchmarks.accuracy.calibrate import leave_one_out

from vtrain_plugin.hardware.calibration import calibration_for
from vtrain_plugin.estimate import estimate
from vtrain_plugin.cli.render import render_table

GROUPS = (("tp", "TP"), ("pp", "PP"), ("micro_batch", "micro-batch"), ("hidden", "hidden"))
HEADER = ["group", "runs", "MAPE %", "median %", "p90 %", "bias %"]
SUMMARY_HEADER = ["data", "evaluation", "runs", "MAPE %", "median %", "p90 %", "bias %"]
# The scale buckets of the bias table: (upper bound, label) of GPUs and of parameters.
GPU_BUCKETS = ((64, "<= 64 GPUs"), (512, "<= 512 GPUs"), (4096, "<= 4,096 GPUs"))
SIZE_BUCKETS = ((10e9, "<= 10B"), (100e9, "<= 100B"), (math.inf, "> 100B"))


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


def cross_validate(prepared: Sequence[PreparedRun], key: str, max_evals: int,
                   always: Sequence[PreparedRun] = ()) -> tuple[np.ndarray, list[list[str]]]:
    """Leave one value of ``key`` out at a time: refit on the rest and on ``always`` (the runs of
    the joint calibration that are not cross-validated by ``key``), predict it."""
    runs = [p.measured for p in prepared]
    predicted = np.full(len(runs), np.nan)
    rows = []
    for value, members in grouped(runs, lambda r: r.group(key)).items():
        held = set(members)
        train = [p for i, p in enumerate(prepared) if i not in held] + list(always)
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


def sc21_leave_one_out(prepared: Sequence[PreparedRun], sc21: Sequence[PreparedRun], max_evals: int) -> np.ndarray:
    """Each SC'21 run predicted by constants refitted on every vTrain run and the other SC'21 runs."""
    loo = leave_one_out([*prepared, *sc21], START, FITTED, max_evals, range(len(prepared), len(prepared) + len(sc21)))
    return np.array([p for _, p, _ in loo])


def sc21_tables(runs: Sequence[MeasuredRun], predicted: np.ndarray, loo: np.ndarray | None) -> str:
    """Per SC'21 run and pooled: the calibrated constants' error, and the leave-one-out error when
    ``loo`` is given."""
    measured = np.array([r.measured_ms for r in runs])
    header = ["model", "GPUs", "TP/PP/DP", "VP", "measured s", "predicted s", "error %"]
    per_run = []
    for i, r in enumerate(runs):
        plan, m, p = r.run.parallel, measured[i], predicted[i]
        row = [r.run.model.name, f"{plan.world_size:,}", f"{plan.tensor_parallel}/{plan.pipeline_parallel}/"
               f"{plan.data_parallel}", str(plan.virtual_pipeline), f"{m / 1e3:.2f}", f"{p / 1e3:.2f}",
               f"{100 * (p - m) / m:+.1f}"]
        if loo is not None:
            row += [f"{loo[i] / 1e3:.2f}", f"{100 * (loo[i] - m) / m:+.1f}"]
        per_run.append(row)
    pooled = [stats_row("calibration", predicted, measured)]
    if loo is not None:
        header += ["left out s", "error %"]
        pooled.append(stats_row("leave-one-out", loo, measured))
    return (f"SC'21 runs (Narayanan et al. Table 1, Megatron-LM 2021, megatron_deepspeed_2023)\n"
            f"{render_table(per_run, header)}\n\n{render_table(pooled, HEADER)}")


def bucket(value: float, buckets: Sequence[tuple[float, str]], what: str) -> str:
    """The label of the first bucket whose upper bound holds ``value``."""
    for bound, label in buckets:
        if value <= bound:
            return label
    raise ValueError(f"{what} ({value:,.0f}) is beyond the last bucket ({buckets[-1][1]})")


def bias_by_scale(prepared: Sequence[PreparedRun], predicted: np.ndarray) -> str:
    """Signed bias of the runs in each (GPUs, parameters) bucket, as "bias% (runs)"; parameters are
    the model's own count (ModelSpec.num_parameters: embeddings included)."""
    cells: dict[tuple[str, str], list[int]] = {}
    for i, p in enumerate(prepared):
        gpus = bucket(p.run.parallel.world_size, GPU_BUCKETS, "GPUs")
        size = bucket(p.run.model.num_parameters, SIZE_BUCKETS, "parameters")
        cells.setdefault((gpus, size), []).append(i)
    measured = np.array([p.measured.measured_ms for p in prepared])
    rows = []
    for _, gpus in GPU_BUCKETS:
        row = [gpus]
        for _, size in SIZE_BUCKETS:
            idx = cells.get((gpus, size))
            row.append(f"{error_stats(predicted[idx], measured[idx]).bias:+.1f}% ({len(idx)})" if idx else "-")
        rows.append(row)
    return (f"signed bias by scale, every A100 run (vTrain single- and multi-node, SC'21), calibrated constants\n"
            f"{render_table(rows, ['', *(label for _, label in SIZE_BUCKETS)])}")


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


def check_fast_path(runs: Sequence[MeasuredRun], predicted: np.ndarray) -> None:
    """The calibration path re-costs prepared graphs; it must agree with the estimator's own code."""
    for i, r in enumerate(runs):
        if abs(estimate(r.run).iteration_time_ms - predicted[i]) > 1e-9 * predicted[i]:
            raise SystemExit(f"{r.run.model.name or r.source} run {i}: the calibration path disagrees with estimate()")


def spread_contribution(sets: dict[str, Sequence[PreparedRun]], constants) -> str:
    """Each set's error with the shipped constants and with the same constants but no spread of GPU
    speeds (``gpu_speed_spread`` 0: every GPU as fast as the one a kernel was timed on): what the
    slowest-GPU term contributes."""
    without = dataclasses.replace(constants, gpu_speed_spread=0.0)
    rows = []
    for name, runs in sets.items():
        measured = np.array([p.measured.measured_ms for p in runs])
        shipped, flat = error_stats(predict_all(runs, constants), measured), error_stats(predict_all(runs, without), measured)
        rows.append([name, str(len(runs)), f"{shipped.mape:.2f}", f"{shipped.bias:+.2f}", f"{flat.mape:.2f}",
                     f"{flat.bias:+.2f}"])
    return (f"what the slowest-GPU term contributes (gpu_speed_spread {constants.gpu_speed_spread:g} vs 0, "
            f"other constants as shipped)\n"
            + render_table(rows, ["set", "runs", "MAPE %", "bias %", "MAPE % without", "bias % without"]))


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_argument(parser)
    results = Path(__file__).resolve().parents[1] / "results"
    parser.add_argument("--plot", type=Path, default=results / "a100_accuracy.png", help="A100 predicted-vs-measured PNG")
    parser.add_argument("--sc21-plot", type=Path, default=results / "sc21_accuracy.png",
                        help="SC'21 predicted-vs-measured PNG (calibration, and leave-one-out unless --no-cv)")
    parser.add_argument("--h100-plot", type=Path, default=results / "h100_accuracy.png",
                        help="H100 predicted-vs-measured PNG (calibration and leave-one-out)")
    parser.add_argument("--no-cv", action="store_true",
                        help="skip every refit: the cross-validations, the SC'21 and the H100 leave-one-out")
    parser.add_argument("--cv-evals", type=int, default=800, help="objective evaluations per refit")
    args = parser.parse_args()

    start = time.perf_counter()
    runs, sc21_runs = read_runs(args.data), sc21_data.read_runs(args.data)
    prepared, sc21_prepared = prepare_runs(runs), prepare_runs(sc21_runs)
    constants = calibration_for("a100-sxm4-80gb", "megatron_deepspeed_2023").constants
    predicted, sc21_predicted = predict_all(prepared, constants), predict_all(sc21_prepared, constants)
    check_fast_path([runs[0], runs[-1], *sc21_runs], np.concatenate([predicted[[0, -1]], sc21_predicted]))
    print(f"estimated {len(runs) + len(sc21_runs)} runs in {time.perf_counter() - start:.1f} s (tracing included)\n")
    print(accuracy_tables(runs, predicted))
    print()
    sc21_loo = None if args.no_cv else sc21_leave_one_out(prepared, sc21_prepared, args.cv_evals)
    print(sc21_tables(sc21_runs, sc21_predicted, sc21_loo))
    print()
    print(bias_by_scale([*prepared, *sc21_prepared], np.concatenate([predicted, sc21_predicted])))
    print()
    print(spread_contribution({"vTrain single-node": [p for p in prepared if p.measured.source == "single"],
                               "vTrain multi-node": [p for p in prepared if p.measured.source == "multi"],
                               "SC'21": sc21_prepared}, constants))
    print()
    plot(a100_series(runs, predicted), "vtrain on A100 (calibration runs)", args.plot)
    sc21_measured = np.array([r.measured_ms for r in sc21_runs])
    plot([("calibration", "o", sc21_measured, sc21_predicted)]
         + ([] if sc21_loo is None else [("leave-one-out", "^", sc21_measured, sc21_loo)]),
         "vtrain on A100 (SC'21 runs)", args.sc21_plot)
    measured = np.array([r.measured_ms for r in runs])
    sources = {source: [i for i, r in enumerate(runs) if r.source == source] for source in ("single", "multi")}
    summary = [[f"A100 {source}-node", *stats_row("calibration", predicted[idx], measured[idx])]
               for source, idx in sources.items()]
    sc21_summary = [["A100 SC'21", *stats_row("calibration", sc21_predicted, sc21_measured)]]
    if args.no_cv:
        print(f"\nsummary\n{render_table(summary + sc21_summary, SUMMARY_HEADER)}")
        return
    sc21_summary.append(["A100 SC'21", *stats_row("leave-one-out", sc21_loo, sc21_measured)])
    h100_runs, h100_predicted, h100_loo = h100_predictions(args.data, args.cv_evals)
    print(h100_tables(h100_runs, h100_predicted, h100_loo))
    h100_measured = np.array([r.measured_ms for r in h100_runs])
    plot([("calibration", "o", h100_measured, h100_predicted), ("leave-one-out", "^", h100_measured, h100_loo)],
         "vtrain on H100 (NeMo 24.07 runs)", args.h100_plot)
    for key in ("hidden", "tp"):
        cv_start = time.perf_counter()
        cv, rows = cross_validate(prepared, key, args.cv_evals, always=sc21_prepared)
        for source, idx in sources.items():
            rows.append([f"pooled, {source}-node", *stats_row("", cv[idx], measured[idx])[1:], ""])
            summary.append([f"A100 {source}-node", *stats_row(f"leave-one-{key}-out", cv[idx], measured[idx])])
        print(f"\nleave-one-{key}-out cross-validation, SC'21 runs always fitted ({time.perf_counter() - cv_start:.0f} s)")
        print(render_table(rows, [*HEADER, "fit"]))
    summary.sort(key=lambda row: row[0] != "A100 single-node")
    summary += sc21_summary
    summary += [["H100", *stats_row("calibration", h100_predicted, h100_measured)],
                ["H100", *stats_row("leave-one-out", h100_loo, h100_measured)]]
    print(f"\nsummary\n{render_table(summary, SUMMARY_HEADER)}")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
