"""benchmarks/device/trace_in_script.py, the first use run on a lent GPU, checked end to end on the CPU
(``--smoke``: torch.distributed up on gloo, a tiny GPTModel traced, estimated, profiled and trained
in that process) so that a session with a GPU only has to run it."""


import pandas as pd


def test_smoke_run_traces_the_scripts_model_and_writes_its_row(tmp_path, python_m):
    out = tmp_path / "trace_in_script.csv"
    done = python_m("benchmarks.device.trace_in_script", "--smoke", "--plans", "gpt-tiny", "--out", str(out))
    assert done.returncode == 0, done.stderr
    frame = pd.read_csv(out)
    assert list(frame.columns) == ["plan", "analytic_ms", "predicted_ms", "measured_ms", "analytic_error_pct",
                                   "error_pct", "predicted_peak_gib", "measured_peak_gib", "trace_s"]
    assert list(frame["plan"]) == ["gpt-tiny"]
    row = frame.iloc[0]
    measured = row["measured_ms"]
    assert row["analytic_ms"] > 0 and row["predicted_ms"] > 0 and measured > 0
    for predicted, error in ((row["predicted_ms"], row["error_pct"]), (row["analytic_ms"], row["analytic_error_pct"])):
        # every column is rounded to 3 decimals: the recomputed error is off by at most this much
        rounding = 100 * 0.0005 * (1 / measured + predicted / measured**2) + 0.0005
        assert abs(100 * (predicted - measured) / measured - error) <= rounding * 1.001


def test_smoke_run_builds_trains_and_estimates_an_moe_script(tmp_path, python_m):
    """The MoE plan's path: QK-norm, GQA, a local-spec MoE layer (SequentialMLP) with real routing."""
    out = tmp_path / "trace_in_script.csv"
    done = python_m("benchmarks.device.trace_in_script", "--smoke", "--plans", "moe-tiny", "--out", str(out))
    assert done.returncode == 0, done.stderr
    row = pd.read_csv(out).iloc[0]
    assert row["plan"] == "moe-tiny"
    assert row["analytic_ms"] > 0 and row["predicted_ms"] > 0 and row["measured_ms"] > 0
