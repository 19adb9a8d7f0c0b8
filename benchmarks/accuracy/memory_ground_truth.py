"""Predicted peak allocated against measured peaks, run by run (not a pass/fail test): the lent H100
and H200 and NVIDIA's Megatron-LM functional tests.

Three sets: ``benchmarks/results/h100_validation.csv`` and ``h200_validation.csv``
(``torch.cuda.max_memory_allocated`` of single-GPU plans trained with megatron-core's local spec,
``benchmarks/device/h100_validation.py``), each plan estimated again as that script does (the
single-device run of the plan, on the GPU that measured it); and the
99 functional-test runs of :mod:`benchmarks.accuracy.ci_data` (Megatron-Core with TransformerEngine
or the local spec, DGX A100 / H100), whose ``mem-max-allocated-bytes`` is the last rank's: with
PP > 1 a rank of the last pipeline stage, so the prediction is that stage's. Both compare the
estimate's peak allocated (tensors, without the allowance) and need no GPU (the measured side is
data). Prints per-run tables, MAPE and bias per set, per family and GPU, and the worst runs.

Run with ``.venv/bin/python -m benchmarks.accuracy.memory_ground_truth [--set h100|h200|ci|all]
[--out FILE]`` (seconds per run once traced; a cold trace cache takes a minute per model).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from benchmarks.accuracy import ci_data
from benchmarks.accuracy.a100_data import error_stats
from benchmarks.device.h100_validation import GROUND_TRUTH_CSVS, on_lent_gpu
from vtrain_plugin.cli.render import render_table
from vtrain_plugin.core.errors import VTrainError
from vtrain_plugin.estimate import estimate

WORST = 10  # runs listed by largest error
GPUS = {"h100": ("H100", "h100-sxm"), "h200": ("H200", "h200-sxm")}  # --set -> (label, device preset)


def local_rows(gpu: str) -> list[tuple[str, str, float, float]]:
    """``(group, plan, predicted GiB, measured GiB)`` of each plan the lent ``gpu`` (a key of
    :data:`GPUS`) measured."""
    label, preset = GPUS[gpu]
    measured = pd.read_csv(GROUND_TRUTH_CSVS[preset]).set_index("plan")["measured_peak_gib"]
    rows = []
    for plan, gib in measured.items():
        # on the GPU that measured it (its library workspaces), still the local spec it trained
        on_gpu = on_lent_gpu(plan, preset)
        rows.append((f"local {label}", plan, estimate(on_gpu, profile_db=False).peak_allocated_gib, float(gib)))
    return rows


def ci_rows() -> tuple[list[tuple[str, str, float, float]], list[str]]:
    """``(family GPU, run, predicted GiB of the last pipeline stage, measured GiB)`` of each
    functional-test run that logged its peak, and the runs vtrain refused (one line each)."""
    measured = ci_data.read_memory()
    rows, refused = [], []
    for run in ci_data.read_runs():
        if run.name not in measured:
            continue
        try:
            est = estimate(run.run, profile_db=False)
        except VTrainError as e:
            refused.append(f"{run.name}: {e}")
            continue
        family, gib = measured[run.name]
        rows.append((f"{family} {run.config['gpu'].split('-')[0].upper()}", run.name, est.memory_gib[-1].tensors_gib,
                     gib))
    return rows, refused


def report(title: str, rows: Sequence[tuple[str, str, float, float]]) -> str:
    """The per-run table, then MAPE and bias per group and overall, then the worst runs."""
    table = [[name, f"{p:.3f}", f"{m:.3f}", f"{100 * (p / m - 1):+.1f}%"] for _, name, p, m in rows]
    groups = sorted({g for g, *_ in rows})
    stats = []
    for label, pick in [*((g, [r for r in rows if r[0] == g]) for g in groups), ("all", list(rows))]:
        s = error_stats([r[2] for r in pick], [r[3] for r in pick])
        stats.append([label, str(s.count), f"{s.mape:.1f}%", f"{s.bias:+.1f}%", f"{s.p90:.1f}%"])
    worst = sorted(rows, key=lambda r: -abs(r[2] / r[3] - 1))[:WORST]
    return "\n\n".join([
        f"{title}\n" + render_table(table, ["run", "predicted GiB", "measured GiB", "error"]),
        render_table(stats, ["set", "runs", "MAPE", "bias", "p90 |error|"]),
        f"worst {len(worst)}\n" + render_table([[n, f"{100 * (p / m - 1):+.1f}%"] for _, n, p, m in worst],
                                               ["run", "error"])])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=("h100", "h200", "ci", "all"), default="all")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    args = parser.parse_args(argv)
    parts = []
    for gpu, (label, _) in GPUS.items():
        if args.set in (gpu, "all"):
            parts.append(report(f"{label} ground truth (local spec, torch.cuda.max_memory_allocated)", local_rows(gpu)))
    if args.set in ("ci", "all"):
        rows, refused = ci_rows()
        parts.append(report("Megatron-LM functional tests (mem-max-allocated-bytes of the last rank)", rows))
        if refused:
            parts.append(f"refused {len(refused)}\n" + "\n".join(refused))
    text = "\n\n".join(parts)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
