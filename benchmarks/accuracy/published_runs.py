"""Accuracy of the A100 and H100 estimates against the published runs (not a pass/fail test).

Converts every row of the vTrain calibration CSVs to a vTrain config, estimates it with the A100 preset
as calibrated (exactly what ``vtrain estimate --format jsonl`` prints), and prints MAPE, median and
90th-percentile absolute error and the signed bias, overall and by TP, PP, micro-batch and hidden
size, single-node and multi-node apart. Then the SC'21 set (``sc21_data.py``: GPT 1.7B to 1T on 32
to 3,072 A100, part of the same joint A100 calibration): the error of each run and pooled. Then the
signed bias of every A100 run (vTrain and SC'21) by scale, GPUs against parameters: the fit weighs
three sets of very different sizes, and a bias that grows with scale is what a joint fit hides in
its pooled figures. Predicted-vs-measured plots (matplotlib) for the vTrain and the SC'21 runs.

Then the H100 (NeMo 24.07), B200 (NeMo 25.02) and Megatron-LM functional-test sets with their
shipped constants, per run for the small sets, per GPU and deterministic or not for the functional
tests. The refits that judge held-out error (leave one test case, model size or run out) are the
joint calibration's own report: ``python -m benchmarks.accuracy.calibrate --dry-run``.

Run with ``.venv/bin/python -m benchmarks.accuracy.published_runs`` (a few minutes on two cores, most of
it tracing; seconds once the trace cache holds the runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.accuracy.a100_data import (MeasuredRun, PreparedRun, add_data_argument, error_stats, grouped,
                                           predict_all, prepare_runs, read_runs)

from benchmarks.accuracy import b200_data, ci_data, h100_data, sc21_data

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


def per_run_tables(title: str, runs: Sequence[MeasuredRun], predicted: np.ndarray) -> str:
    """Per run of a small set (H100, B200) and pooled: the shipped constants' error."""
    measured = np.array([r.measured_ms for r in runs])
    per_run = [[r.name, f"{m:,.1f}", f"{p:,.1f}", f"{100 * (p - m) / m:+.1f}"] for r, m, p in zip(runs, measured, predicted)]
    return (f"{title}\n{render_table(per_run, ['run', 'measured ms', 'predicted ms', 'error %'])}\n\n"
            f"{render_table([stats_row('calibration', predicted, measured)], HEADER)}")


def ci_tables(runs: Sequence[MeasuredRun], prepared: Sequence[PreparedRun], predicted: np.ndarray) -> str:
    """The functional-test runs pooled, per GPU and deterministic or not."""
    measured = np.array([r.measured_ms for r in runs])
    groups = {"all": range(len(runs))}
    for gpu in ("A100", "H100"):
        groups[gpu] = [i for i, r in enumerate(runs) if r.name.endswith(f"({gpu})")]
    groups["deterministic"] = [i for i, p in enumerate(prepared) if p.run.training.deterministic]
    groups["non-deterministic"] = [i for i, p in enumerate(prepared) if not p.run.training.deterministic]
    rows = [stats_row(name, predicted[list(idx)], measured[list(idx)]) for name, idx in groups.items()]
    return f"Megatron-LM functional-test runs (megatron_core_te and local)\n{render_table(rows, HEADER)}"


def shipped_predictions(prepared: Sequence[PreparedRun]) -> np.ndarray:
    """Each run with the calibration ``vtrain estimate`` reads for its GPU and stack."""
    return np.array([p.predict_ms(calibration_for(p.run.cluster.gpu, p.prepared.stack.value).constants)
                     for p in prepared])


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
                        help="SC'21 predicted-vs-measured PNG")
    parser.add_argument("--h100-plot", type=Path, default=results / "h100_accuracy.png",
                        help="H100, B200 and functional tests predicted-vs-measured PNG")
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
    print(sc21_tables(sc21_runs, sc21_predicted, None))
    print()
    print(bias_by_scale([*prepared, *sc21_prepared], np.concatenate([predicted, sc21_predicted])))
    print()
    print(spread_contribution({"vTrain single-node": [p for p in prepared if p.measured.source == "single"],
                               "vTrain multi-node": [p for p in prepared if p.measured.source == "multi"],
                               "SC'21": sc21_prepared}, constants))
    print()
    plot(a100_series(runs, predicted), "vtrain on A100 (calibration runs)", args.plot)
    sc21_measured = np.array([r.measured_ms for r in sc21_runs])
    plot([("calibration", "o", sc21_measured, sc21_predicted)], "vtrain on A100 (SC'21 runs)", args.sc21_plot)
    measured = np.array([r.measured_ms for r in runs])
    summary = [[f"A100 {source}-node", *stats_row("calibration", predicted[idx], measured[idx])]
               for source, idx in ((s, [i for i, r in enumerate(runs) if r.source == s]) for s in ("single", "multi"))]
    summary.append(["A100 SC'21", *stats_row("calibration", sc21_predicted, sc21_measured)])
    series = []
    for title, reader, marker in (("H100 runs (NeMo 24.07, FP8, megatron_core_te)", h100_data.read_runs, "o"),
                                  ("B200 runs (NeMo 25.02, FP8, megatron_core_te)", b200_data.read_runs, "s")):
        small = reader(args.data)
        small_prepared = prepare_runs(small)
        small_predicted = shipped_predictions(small_prepared)
        check_fast_path(small, small_predicted)
        print(per_run_tables(title, small, small_predicted))
        print()
        small_measured = np.array([r.measured_ms for r in small])
        summary.append([title.split(" (")[0], *stats_row("calibration", small_predicted, small_measured)])
        series.append((title.split(" (")[0], marker, small_measured, small_predicted))
    ci = ci_data.read_runs(args.data)
    ci_prepared = prepare_runs(ci)
    ci_predicted = shipped_predictions(ci_prepared)
    print(ci_tables(ci, ci_prepared, ci_predicted))
    ci_measured = np.array([r.measured_ms for r in ci])
    summary.append(["functional tests", *stats_row("calibration", ci_predicted, ci_measured)])
    series.append(("functional tests", "^", ci_measured, ci_predicted))
    plot(series, "vtrain on today's stack (H100, B200, functional tests)", args.h100_plot)
    print(f"\nsummary (held-out figures: python -m benchmarks.accuracy.calibrate --dry-run)\n"
          f"{render_table(summary, SUMMARY_HEADER)}")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
