"""Predicted peak allocated against what the lent H100 measured, plan by plan (not a pass/fail test).

Reads ``benchmarks/results/h100_validation.csv`` (``torch.cuda.max_memory_allocated`` of six
single-GPU plans trained with megatron-core's local spec, ``benchmarks/device/h100_validation.py``)
and estimates each plan again with today's code, exactly as that script does (the single-device
run of the plan, the estimate's peak allocated: tensors without the allowance). Prints the table
and the mean absolute error; needs no GPU (the measured side is the CSV).

Run with ``.venv/bin/python -m benchmarks.accuracy.memory_ground_truth`` (a minute or two per
plan to trace on two cores, seconds once cached).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from benchmarks.device.h100_validation import PLANS
from vtrain_plugin.cli.render import render_table
from vtrain_plugin.estimate import estimate
from vtrain_plugin.measured.one_device import single_device_run
from vtrain_plugin.runs import run_config_from_dict

CSV = Path(__file__).resolve().parents[1] / "results" / "h100_validation.csv"


def main() -> None:
    measured = pd.read_csv(CSV).set_index("plan")["measured_peak_gib"]
    rows, errors = [], []
    for plan, gib in measured.items():
        single, _ = single_device_run(run_config_from_dict(PLANS[plan], source=plan), "cpu")
        predicted = estimate(single, profile_db=False).peak_allocated_gib
        errors.append(100 * (predicted / gib - 1))
        rows.append([plan, f"{predicted:.2f}", f"{gib:.2f}", f"{errors[-1]:+.1f}%"])
    print(render_table(rows, ["plan", "predicted GiB", "measured GiB", "error"]))
    print(f"mean absolute error {sum(map(abs, errors)) / len(errors):.1f}% over {len(errors)} plans")


if __name__ == "__main__":
    main()
