"""Error bands end to end: the shipped file is what ``benchmarks.accuracy.error_bands`` computes (on a
subset, in a subprocess), every estimate carries the band of its regime, in the JSON and beside the
time and cost of the table, and a plan no published run resembles is said to be far from them; a
plan's model with experts is in an MoE regime, and gets the MoE runs' band or is told there is none."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vtrain_plugin.hardware.error_bands import NO_MOE_RUN, read_error_bands

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


def test_the_script_rewrites_a_file_of_an_older_format(tmp_path, monkeypatch):
    """Estimates refuse a band file of another format; the script that rewrites it must not."""
    from benchmarks.accuracy import error_bands as script
    from vtrain_plugin.hardware import error_bands

    old = tmp_path / "error_bands.json"
    old.write_text(json.dumps({"format_version": 1, "runs": []}))
    monkeypatch.setattr(error_bands, "ERROR_BANDS_FILE", old)
    error_bands._shipped_band.cache_clear()
    try:
        runs, _, refused = script.predict_sets(["vtrain_single_node"], limit=1)
        assert (len(runs), refused) == (1, [])
        assert runs[0].run == "single-node row 1"
    finally:
        error_bands._shipped_band.cache_clear()


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
    assert band["regime"] == "hopper, megatron_core_te, 9-64 GPUs, 1-10B parameters, dense" and band["moe"] is False
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
    assert band["regime"] == "blackwell, megatron_core_te, over 4,096 GPUs, under 100M parameters, dense"
    assert band["based_on"] == "megatron_core_te, under 100M parameters, dense"  # the functional tests' size
    table = run_cli(*args, check=True).stdout
    assert ("; far from any calibration run: none in its regime (blackwell, megatron_core_te, over 4,096 GPUs, "
            "under 100M parameters, dense)") in table


MOE = ("--num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 1 --bf16 "
       "--disable-bias-linear --moe-router-topk 1 ")
# a functional test's MoE model (~150M parameters) and one of ~15B no MoE run of the data sets has
FUNCTIONAL_MOE = MOE + ("--num-layers 12 --hidden-size 512 --vocab-size 50304 --global-batch-size 32 --num-experts 4 "
                        "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2")
MID_MOE = MOE + ("--num-layers 16 --hidden-size 4096 --ffn-hidden-size 14336 --vocab-size 32000 "
                 "--global-batch-size 64 --expert-model-parallel-size 8 --num-experts 8")


def test_an_moe_plan_gets_the_band_of_moe_runs_or_is_told_there_are_none(run_cli):
    def band(argv: str) -> dict:
        args = ("estimate", "--megatron-args", argv, "--gpu", "h100", "--gpus", "8", "--no-db", "--format", "json")
        return json.loads(run_cli(*args, check=True).stdout)["error_band"]
    own = band(FUNCTIONAL_MOE)
    assert own["regime"] == own["based_on"] == "hopper, megatron_core_te, 1-8 GPUs, 100M-1B parameters, MoE"
    runs = [r for r in read_error_bands().runs if r.regime.words() == own["regime"]]
    assert own["moe"] is True and own["runs"] == own["runs_in_regime"] == len(runs) >= 5
    assert own["note"] is None and own["far_from_calibration"] is False
    assert all(r.num_experts is not None for r in runs)
    none = band(MID_MOE)
    assert none["regime"] == "hopper, megatron_core_te, 1-8 GPUs, 10-100B parameters, MoE" and none["moe"] is True
    assert none["based_on"].endswith("10-100B parameters, dense") and none["note"] == NO_MOE_RUN
    assert none["far_from_calibration"] is True and none["runs_in_regime"] == 0
