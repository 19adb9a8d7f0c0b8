"""Device spec sheets: presets, aliases, units, validation of constants, and the constants writer."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from profiler import devices
from profiler.devices import DeviceConstants, DeviceSpec, get_device, known_devices, write_device_constants
from vtrain_plugin.errors import ConfigError

PRESETS = ["a100-sxm4-40gb", "a100-sxm4-80gb", "cpu", "h100-sxm", "h200-sxm"]


def _constants(**changes: float) -> DeviceConstants:
    values = dict(gemm_efficiency=0.5, hbm_efficiency=0.5, kernel_overhead_ns=1000, host_overhead_ns=5000)
    return DeviceConstants(**{**values, **changes})


def test_known_devices_lists_presets_sorted():
    assert known_devices() == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_with_its_own_name(name):
    spec = get_device(name)
    assert spec.name == name
    assert 0.3 <= spec.constants.gemm_efficiency <= 1.0


def test_a100_spec_sheet_numbers():
    a40, a80 = get_device("a100-sxm4-40gb"), get_device("a100-sxm4-80gb")
    for spec in (a40, a80):
        assert (spec.peak_fp16_tflop_per_s, spec.peak_bf16_tflop_per_s, spec.peak_tf32_tflop_per_s,
                spec.peak_fp32_tflop_per_s) == (312, 312, 156, 19.5)
        assert spec.sm_count == 108
        assert spec.l2_cache_bytes == 40 * 2**20
        assert spec.nvlink_bytes_per_ns == 300
        assert spec.peak_fp8_tflop_per_s is None
    assert a40.hbm_bytes_per_ns == 1555 and a80.hbm_bytes_per_ns == 2039
    assert a40.memory_bytes == 40 * 2**30 and a80.memory_bytes == 80 * 2**30


def test_h100_and_h200_spec_sheet_numbers():
    h100, h200 = get_device("h100-sxm"), get_device("h200-sxm")
    for spec in (h100, h200):
        peaks = (spec.peak_fp16_tflop_per_s, spec.peak_tf32_tflop_per_s, spec.peak_fp32_tflop_per_s)
        assert peaks == (989, 494, 67)
        assert spec.sm_count == 132 and spec.l2_cache_mebibytes == 50 and spec.nvlink_bytes_per_ns == 450
    assert h100.hbm_bytes_per_ns == 3350 and h100.memory_bytes == 80 * 2**30
    assert h200.hbm_bytes_per_ns == 4800 and h200.memory_bytes == 141 * 2**30


@pytest.mark.parametrize("alias, name", [
    ("A100", "a100-sxm4-80gb"), ("a100", "a100-sxm4-80gb"), ("H100", "h100-sxm"), ("h200", "h200-sxm"),
    ("A100-SXM4-40GB", "a100-sxm4-40gb"), (" h100-sxm ", "h100-sxm"),
])
def test_aliases_and_case_insensitive_names(alias, name):
    assert get_device(alias).name == name


def test_unknown_device_lists_known_names():
    with pytest.raises(ConfigError) as err:
        get_device("x")
    assert str(err.value).startswith(
        "unknown GPU 'x'; known: a100-sxm4-40gb, a100-sxm4-80gb, cpu, h100-sxm, h200-sxm")


def test_spec_files_found_regardless_of_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    devices._load.cache_clear()
    assert get_device("h100-sxm").sm_count == 132


def test_tensor_rates_per_dtype():
    a100, h100 = get_device("A100"), get_device("H100")
    assert a100.tensor_flop_per_ns("float16") == 312e3
    assert a100.tensor_flop_per_ns("torch.bfloat16") == 312e3
    assert a100.tensor_flop_per_ns("float32") == 156e3
    assert a100.tensor_flop_per_ns("float32", allow_tf32=False) == 19.5e3
    assert a100.cuda_core_flop_per_ns == 19.5e3
    assert h100.tensor_flop_per_ns("float8_e4m3fn") == 1979e3
    with pytest.raises(ConfigError, match="no fp8 tensor cores"):
        a100.tensor_flop_per_ns("float8_e4m3fn")
    with pytest.raises(ConfigError, match="dtype 'float64' has no tensor-core rate"):
        a100.tensor_flop_per_ns("float64")


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_device("A100").sm_count = 1


@pytest.mark.parametrize("field, value, message", [
    ("gemm_efficiency", 1.2, r"gemm_efficiency must lie in \[0.3, 1\], got 1.2"),
    ("hbm_efficiency", 0.1, r"hbm_efficiency must lie in \[0.3, 1\], got 0.1"),
    ("kernel_overhead_ns", 100, r"kernel_overhead_ns must lie in \[500, 20000\], got 100"),
    ("host_overhead_ns", 0, r"host_overhead_ns must be positive, got 0"),
])
def test_constants_outside_plausible_range_are_rejected(field, value, message):
    with pytest.raises(ConfigError, match=message):
        _constants(**{field: value})


def test_spec_validation_names_the_field():
    good = get_device("A100")
    with pytest.raises(ConfigError, match="device 'a100-sxm4-80gb' sm_count must be positive, got 0"):
        dataclasses.replace(good, sm_count=0)
    with pytest.raises(ConfigError, match="hbm_bandwidth_gbytes_per_s must be positive"):
        dataclasses.replace(good, hbm_bandwidth_gbytes_per_s=-1)


def test_from_dict_rejects_unknown_and_missing_keys():
    data = get_device("A100").to_dict()
    with pytest.raises(ConfigError, match="unknown key 'clock_mhz'"):
        DeviceSpec.from_dict({**data, "clock_mhz": 1410}, where="x.json")
    with pytest.raises(ConfigError, match="x.json: missing key 'sm_count'"):
        DeviceSpec.from_dict({k: val for k, val in data.items() if k != "sm_count"}, where="x.json")
    constants = {k: val for k, val in data["constants"].items() if k != "host_overhead_ns"}
    with pytest.raises(ConfigError, match="missing key 'host_overhead_ns'"):
        DeviceSpec.from_dict({**data, "constants": constants}, where="x.json")
    assert DeviceSpec.from_dict(data, where="x.json") == get_device("A100")


@pytest.fixture
def spec_copy(tmp_path, monkeypatch):
    """The presets copied to a temporary directory the registry reads instead of the package's."""
    target = tmp_path / "device_specs"
    shutil.copytree(devices._spec_dir(), target)
    monkeypatch.setattr(devices, "_spec_dir", lambda: target)
    devices._load.cache_clear()
    yield target
    devices._load.cache_clear()


def test_write_device_constants_merges_and_persists(spec_copy):
    before = get_device("A100").constants
    spec = write_device_constants("A100", {"gemm_efficiency": 0.8, "kernel_overhead_ns": 3000})
    assert spec.constants.gemm_efficiency == 0.8 and spec.constants.kernel_overhead_ns == 3000
    assert get_device("a100-sxm4-80gb") == spec
    written = json.loads((spec_copy / "a100-sxm4-80gb.json").read_text())
    assert written["constants"]["gemm_efficiency"] == 0.8
    assert written["constants"]["hbm_efficiency"] == before.hbm_efficiency  # untouched keys kept
    assert written["peak_fp16_tflop_per_s"] == 312.0
    assert sorted(p.name for p in spec_copy.iterdir()) == [f"{n}.json" for n in PRESETS]  # no temp files


def test_write_device_constants_validates_before_writing(spec_copy):
    before = (spec_copy / "h100-sxm.json").read_text()
    with pytest.raises(ConfigError, match="unknown key 'speed'"):
        write_device_constants("h100-sxm", {"speed": 2.0})
    with pytest.raises(ConfigError, match="gemm_efficiency must lie in"):
        write_device_constants("h100-sxm", {"gemm_efficiency": 2.0})
    assert (spec_copy / "h100-sxm.json").read_text() == before
