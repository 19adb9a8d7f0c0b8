"""The eager stack (local_spec on a GPU, the ``default`` files): megatron-core's layer host costs from the
joint fit, written by the calibration's writer with each GPU's device constants kept; the real-step
rows it is checked against are read as measured."""

import json
from dataclasses import replace

import pytest

from benchmarks.accuracy.calibrate import EAGER_HOST, EAGER_HOST_FROM, HOST_NOTE, eager_default_files
from benchmarks.accuracy.eager_steps import analytic_ms, rows
from vtrain_plugin.hardware.calibration import (OPTIONAL_CONSTANTS, SOFTWARE_CONSTANTS, calibration_for,
                                                package_calibration_dir)
from vtrain_plugin.hardware.devices import get_device

GPUS = sorted(p.parent.name for p in package_calibration_dir().glob("*/default.json")
              if not get_device(p.parent.name).host_runs_kernels)


@pytest.mark.parametrize("gpu", GPUS)
def test_the_default_file_of_every_gpu_has_megatron_cores_layer_host_costs_and_no_loop_costs(gpu):
    eager = calibration_for(gpu, "default").constants
    layers = calibration_for("h100-sxm", EAGER_HOST_FROM).constants
    for name in SOFTWARE_CONSTANTS:
        expected = getattr(layers, name) if name in EAGER_HOST else OPTIONAL_CONSTANTS[name]
        assert getattr(eager, name) == expected, (gpu, name)


@pytest.mark.parametrize("gpu", GPUS)
def test_the_default_file_pays_the_node_cpu_factor_its_fitted_stacks_pay(gpu):
    eager = calibration_for(gpu, "default").constants
    fitted = package_calibration_dir() / gpu / f"{EAGER_HOST_FROM}.json"
    expected = (json.loads(fitted.read_text())["constants"].get("host_time_factor", 1.0) if fitted.exists()
                else OPTIONAL_CONSTANTS["host_time_factor"])
    assert eager.host_time_factor == expected, gpu


def test_the_writer_sets_each_gpus_node_factor_and_leaves_the_others(monkeypatch, tmp_path):
    monkeypatch.setenv("VTRAIN_CALIBRATION_DIR", str(tmp_path))
    host = calibration_for("h100-sxm", EAGER_HOST_FROM).constants
    paths = eager_default_files(host, "make it", into_package=False,
                                host_factors={"a100-sxm4-80gb": 1.25, "h100-sxm": 1.0})
    written = {p.parent.name: json.loads(p.read_text()) for p in paths}
    assert written["a100-sxm4-80gb"]["constants"]["host_time_factor"] == 1.25
    assert "host_time_factor 1.250, the fit's for this GPU's node CPU" in written["a100-sxm4-80gb"]["source"]
    assert "host_time_factor" not in written["h100-sxm"]["constants"]  # neutral: left out
    shipped_40 = calibration_for("a100-sxm4-40gb", "default").constants.host_time_factor
    assert written["a100-sxm4-40gb"]["constants"].get("host_time_factor", 1.0) == shipped_40  # not named: kept


def test_the_writer_sets_the_host_costs_and_keeps_device_constants_and_the_device_note(monkeypatch, tmp_path):
    monkeypatch.setenv("VTRAIN_CALIBRATION_DIR", str(tmp_path))
    host = replace(calibration_for("h100-sxm", EAGER_HOST_FROM).constants, host_overhead_ns=12345.0,
                   module_host_overhead_ns=23456.0, iteration_overhead_ns=1e6)
    paths = eager_default_files(host, "make it", into_package=False)
    assert sorted(p.parent.name for p in paths) == GPUS and all(p.is_relative_to(tmp_path) for p in paths)
    for path in paths:
        written = json.loads(path.read_text())
        shipped = json.loads((package_calibration_dir() / path.parent.name / "default.json").read_text())
        for name in ("gemm_efficiency", "hbm_efficiency", "kernel_overhead_ns"):
            assert written["constants"][name] == shipped["constants"][name]
        assert written["constants"]["host_overhead_ns"] == 12345.0
        assert written["constants"]["module_host_overhead_ns"] == 23456.0
        assert "iteration_overhead_ns" not in written["constants"]  # the loop's: neutral, left out
        assert written["source"].split(HOST_NOTE)[0] == shipped["source"].split(HOST_NOTE)[0]
        assert written["command"].endswith(HOST_NOTE + "make it") and written["command"].count(HOST_NOTE) == 1


def test_the_ground_truth_rows_are_read_per_gpu_and_estimated_on_the_local_spec():
    data = rows()
    assert [sum(r.gpu == g for r in data) for g in ("h100-sxm", "h200-sxm")] == [11, 6]
    first = next(r for r in data if r.plan == "ci-gpt-126m_mb4_none" and r.gpu == "h100-sxm")
    assert first.measured_ms == pytest.approx(377.039)
    slow_memory = analytic_ms(first, hbm_efficiency=0.5)
    assert slow_memory > analytic_ms(first) > 0  # the constant given replaces the shipped one
