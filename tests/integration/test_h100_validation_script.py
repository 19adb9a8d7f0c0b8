"""benchmarks/device/h100_validation.py, the ground-truth run for a lent GPU, checked end to end on the CPU
(``--smoke``: two tiny plans, profiled, trained and compared for real) so that a session with a GPU
only has to run it."""

import json

import pandas as pd
import pytest

from benchmarks.device import h100_validation


def test_smoke_run_writes_the_validation_csv_and_the_profile_export(tmp_path, python_m):
    out, export = tmp_path / "validation.csv", tmp_path / "profiles.json"
    done = python_m("benchmarks.device.h100_validation", "--smoke", "--out", str(out), "--export", str(export))
    assert done.returncode == 0, done.stderr
    frame = pd.read_csv(out)
    assert list(frame.columns) == ["plan", "predicted_ms", "measured_ms", "error_pct", "predicted_peak_gib",
                                   "measured_peak_gib", "analytic_ms", "analytic_error_pct", "device"]
    assert list(frame["plan"]) == list(h100_validation.SMOKE_PLANS)
    assert (frame["predicted_ms"] > 0).all() and (frame["measured_ms"] > 0).all()
    predicted, measured = frame["predicted_ms"], frame["measured_ms"]
    expected = 100 * (predicted - measured) / measured
    # every column is rounded to 3 decimals: the recomputed error is off by at most this much
    rounding = 100 * 0.0005 * (1 / measured + predicted / measured**2) + 0.0005
    assert ((expected - frame["error_pct"]).abs() <= rounding * 1.001).all()
    doc = json.loads(export.read_text())
    assert len(doc["devices"]) == 1 and doc["devices"][0]["fingerprint"]["kind"] == "cpu"
    assert len(doc["kernels"]) > 100  # every unique kernel of both plans, timed


def test_rows_of_other_plans_are_kept(tmp_path):
    path = tmp_path / "validation.csv"
    row = dict.fromkeys(h100_validation.COLUMNS[1:], 1.0)
    h100_validation.write_rows([{"plan": "a", **row}, {"plan": "b", **row}], path)
    h100_validation.write_rows([{"plan": "b", **row, "measured_ms": 2.0}], path)
    frame = pd.read_csv(path)
    assert list(frame["plan"]) == ["a", "b"] and list(frame["measured_ms"]) == [1.0, 2.0]


def test_rows_of_an_older_layout_are_kept_with_the_new_columns_empty(tmp_path):
    path = tmp_path / "validation.csv"
    path.write_text("plan,predicted_ms,measured_ms,error_pct,predicted_peak_gib,measured_peak_gib\nold,1,2,-50,3,4\n")
    h100_validation.write_rows([{"plan": "new", **dict.fromkeys(h100_validation.COLUMNS[1:-1], 1.0),
                                 "device": "gpu"}], path)
    frame = pd.read_csv(path)
    assert list(frame["plan"]) == ["old", "new"] and list(frame.columns) == h100_validation.COLUMNS
    assert frame.loc[0, "measured_ms"] == 2 and pd.isna(frame.loc[0, "analytic_ms"])


def test_grouped_gemm_sweep_writes_one_row_per_expert_gemm(tmp_path):
    from benchmarks.device import grouped_gemm_sweep

    out = tmp_path / "grouped.csv"
    assert grouped_gemm_sweep.main(["--smoke", "--out", str(out)]) == 0
    frame = pd.read_csv(out)
    assert list(frame.columns) == grouped_gemm_sweep.COLUMNS
    assert list(frame["gemm"]) == ["fc1_fwd", "fc1_dgrad", "fc1_wgrad", "fc2_fwd", "fc2_dgrad", "fc2_wgrad"]
    # one expert's GEMM of the tiny shape (4 experts, 64 tokens each, hidden 64, FFN 32: fc1 out 64)
    assert frame[["m", "k", "n"]].values.tolist()[:3] == [[64, 64, 64], [64, 64, 64], [64, 64, 64]]
    assert frame[["m", "k", "n"]].values.tolist()[3:] == [[64, 32, 64], [64, 64, 32], [32, 64, 64]]
    assert (frame["loop_us"] > 0).all()


def test_unknown_plan_is_refused():
    with pytest.raises(SystemExit) as exit_info:
        h100_validation.main(["--smoke", "--plans", "nope"])
    assert exit_info.value.code == 2


def test_gpu_plans_fit_one_h100_as_estimated():
    """Every GPU plan, estimated as it will run (one H100, megatron-core's local spec as the real step
    trains it), fits in the 79.6 GiB an H100 80GB offers, with room for what the estimate does not count."""
    from dataclasses import replace

    from vtrain_plugin.runs import run_config_from_dict
    from vtrain_plugin.estimate import estimate
    from vtrain_plugin.specs.training import SoftwareStack

    for name, mapping in h100_validation.PLANS.items():
        run = run_config_from_dict(mapping, source=name)
        assert run.parallel.world_size == 1
        local = replace(run, training=replace(run.training, software_stack=SoftwareStack.LOCAL_SPEC))
        total = estimate(local).memory_gib[0].total_gib
        assert total < 76, (name, total)
