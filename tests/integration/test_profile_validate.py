"""The real CLI: profile a tiny plan on this CPU, estimate from the profile, validate against training."""

import json
import shutil

import pytest

from tests.support.cpu_profile import TINY_PLAN


@pytest.fixture
def plan(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_PLAN)
    return str(path)


def test_profile_then_estimate_and_validate(plan, run_cli, tmp_path, tiny_cpu_profile):
    before = run_cli("estimate", plan, "--explain", "3", check=True).stdout
    assert "kernel time measured: 0.0%" in before
    assert "largest unmeasured kernels" in before

    # the first profile, into the default database, is the session's (a minute of CPU): each command
    # runs once in a plain subprocess, that one there
    assert " 0 already in the database, 0 failed" in tiny_cpu_profile.stdout
    shutil.copy(tiny_cpu_profile.db, tmp_path / "profiles.sqlite")  # run_cli's $VTRAIN_PROFILE_DB
    second = run_cli("profile", plan, check=True)
    assert " 0 measured," in second.stdout and " 0 failed" in second.stdout

    after = json.loads(run_cli("estimate", plan, "--format", "json", check=True).stdout)
    assert after["measured_fraction"] > 0.99
    assert after["largest_unmeasured"] == []
    assert "kernel time measured: 100.0%" in run_cli("estimate", plan, "--explain", check=True).stdout

    proc = run_cli("validate", plan, "--format", "json", "--iterations", "6", check=True, fresh=True)
    result = json.loads(proc.stdout)
    assert {"predicted_ms", "measured_ms", "error_pct", "peak_memory_measured_gib"} <= result.keys()
    assert result["measured_fraction"] > 0.99 and result["num_microbatches"] == 2
    assert result["peak_memory_measured_gib"] > 0
    # Predicted peak: the estimate's tensors of the same one-device plan, its allowance left out.
    [stage] = after["memory_gib_per_stage"]
    assert result["peak_memory_predicted_gib"] == pytest.approx(stage["total"] - stage["allowance"], rel=1e-12)
    assert result["memory_error_pct"] == pytest.approx(100 * (result["peak_memory_predicted_gib"] - result[
        "peak_memory_measured_gib"]) / result["peak_memory_measured_gib"])
    assert result["memory_measure"].startswith("growth of the peak resident set (VmHWM)")
    assert all(line.endswith("measured times are noisy") for line in result["warnings"])
    assert proc.stderr.splitlines() == [f"vtrain: warning: {line}" for line in result["warnings"]]
    # The error itself is a wall-clock figure of this machine: benchmarks/device/validate_cpu.py reports it.
    assert result["error_pct"] == pytest.approx(
        100 * (result["predicted_ms"] - result["measured_ms"]) / result["measured_ms"])

    exported = tmp_path / "export.json"
    run_cli("profile-export", str(exported), check=True, fresh=True)
    other = tmp_path / "other.sqlite"
    imported = run_cli("profile-import", str(exported), "--db", str(other), check=True, fresh=True)
    assert "imported 1 device(s)" in imported.stdout
    moved = json.loads(run_cli("estimate", plan, "--format", "json", "--db", str(other), check=True).stdout)
    assert moved["iteration_time_ms"] == after["iteration_time_ms"]


@pytest.mark.parametrize("args, message", [
    (("--iterations", "0"), "iterations must be a positive integer, got 0"),
    (("--warmup", "-1"), "warmup must be a non-negative integer, got -1"),
])
def test_validate_bad_input_is_one_line(plan, run_cli, args, message):
    proc = run_cli("validate", plan, *args)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"vtrain: error: {message}"]


def test_corrupt_database_is_one_line(plan, run_cli, tmp_path):
    bad = tmp_path / "bad.sqlite"
    bad.write_text("garbage" * 100)
    proc = run_cli("profile", plan, "--db", str(bad))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"vtrain: error: profile database {bad} is not a SQLite file (bad header)"]
