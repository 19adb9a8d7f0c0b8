"""Error bands end to end: the shipped file is what ``benchmarks.accuracy.error_bands`` computes (on a
subset, in a subprocess), every estimate carries the band of its regime, in the JSON and beside the
time and cost of the table, and a plan no published run resembles is said to be far from them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vtrain_plugin.hardware.error_bands import read_error_bands

REPO = Path(__file__).resolve().parents[2]
PLAN = REPO / "examples" / "plans" / "qwen3_8b_64gpu_h100.yaml"


def test_the_shipped_file_is_what_the_script_computes(tmp_path, python_m):
    out = tmp_path / "bands.json"
    proc = python_m("benchmarks.accuracy.error_bands", "--sets", "vtrain_single_node", "megatron_ci", "--limit", "1",
                    "--out", str(out), timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert f"2 runs written to {out}; 0 refused" in proc.stdout
    fresh = json.loads(out.read_text())
    shipped = {(r.dataset, r.run): r for r in read_error_bands().runs}
    assert [(r["dataset"], r["run"]) for r in fresh["runs"]] == [
        ("vtrain_single_node", "single-node row 1"),
        ("megatron_ci", "gpt3_mcore_cp2_pp2_ep2_te_4experts2parallel_nondeterministic A100")]
    for row in fresh["runs"]:
        assert shipped[row["dataset"], row["run"]].to_dict() == row
    assert fresh["provenance"]["calibrations"].items() <= read_error_bands().provenance["calibrations"].items()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, python_m):
    env = {**os.environ, "VTRAIN_PROFILE_DB": str(tmp_path_factory.mktemp("db") / "p.sqlite")}

    def run(*args: str) -> str:
        proc = python_m("vtrain_plugin.cli", "estimate", str(PLAN), "--no-db", *args, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout
    return json.loads(run("--format", "json")), run()


def test_estimate_json_and_table_carry_the_band(qwen):
    document, table = qwen
    band = document["error_band"]
    assert band["regime"] == "hopper, megatron_core_te, 9-64 GPUs, 1-10B parameters"
    low, high = band["iteration_time_ms"]
    time_ms = document["iteration_time_ms"]
    assert low == pytest.approx(time_ms / (1 + band["high_error_pct"] / 100), rel=1e-12)
    assert high == pytest.approx(time_ms / (1 + band["low_error_pct"] / 100), rel=1e-12)
    assert band["cost_usd"] == pytest.approx([document["cost_usd"] * low / time_ms, document["cost_usd"] * high / time_ms])
    runs = [r for r in read_error_bands().runs if r.regime.words() == band["regime"]]
    assert band["runs_in_regime"] == len(runs) and band["far_from_calibration"] is (not runs)
    line = next(line for line in table.splitlines() if line.startswith("likely "))
    assert line.startswith(f"likely {low:,.1f}-{high:,.1f} ms per iteration, ")
    assert f"p10-p90 error {band['low_error_pct']:+.1f}% to {band['high_error_pct']:+.1f}%" in line


TINY = ("--num-layers 2 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 "
        "--vocab-size 1000 --micro-batch-size 1 --global-batch-size 8192 --bf16")


def test_a_plan_far_from_every_published_run_says_so(run_cli):
    args = ("estimate", "--megatron-args", TINY, "--gpu", "gb300", "--gpus", "8192", "--no-db")
    band = json.loads(run_cli(*args, "--format", "json", check=True).stdout)["error_band"]
    assert band["far_from_calibration"] and band["runs_in_regime"] == 0
    assert band["regime"] == "blackwell, megatron_core_te, over 4,096 GPUs, under 100M parameters"
    assert band["based_on"] == "megatron_core_te, under 100M parameters"  # the functional tests' size
    table = run_cli(*args, check=True).stdout
    assert ("; far from any calibration run: none in its regime (blackwell, megatron_core_te, over 4,096 GPUs, "
            "under 100M parameters)") in table
