"""Device spec sheets and calibrations: presets, aliases, units, validation of constants, the calibration writer."""

from __future__ import annotations

import dataclasses
import json

import pytest

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.hardware import devices
from vtrain_plugin.hardware.calibration import (OPTIONAL_CONSTANTS, SOFTWARE_CONSTANTS, Calibration, DeviceConstants,
                                                calibration_for, package_calibration_dir, write_calibration)
from vtrain_plugin.hardware.clusters import cluster_preset_names, get_cluster_preset
from vtrain_plugin.hardware.devices import DeviceSpec, get_device, known_devices

PRESETS = ["a100-sxm4-40gb", "a100-sxm4-80gb", "b200-sxm", "cpu", "gb200", "gb300", "h100-sxm", "h200-sxm"]
ARCHITECTURES = {"a100-sxm4-40gb": "ampere", "a100-sxm4-80gb": "ampere", "b200-sxm": "blackwell", "cpu": "cpu",
                 "gb200": "blackwell", "gb300": "blackwell", "h100-sxm": "hopper", "h200-sxm": "hopper"}


def _constants(**changes: float) -> DeviceConstants:
    values = dict(gemm_efficiency=0.5, hbm_efficiency=0.5, kernel_overhead_ns=1000, host_overhead_ns=5000)
    return DeviceConstants(**{**values, **changes})


def test_known_devices_lists_presets_sorted():
    assert known_devices() == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_with_its_own_name(name):
    spec = get_device(name)
    assert spec.name == name and spec.architecture == ARCHITECTURES[name]
    assert spec.default_cluster in cluster_preset_names()
    calibration = calibration_for(name, "default")
    assert calibration.device == name and calibration.software_stack == "default"
    assert 0.3 <= calibration.constants.gemm_efficiency <= 1.0


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
        peaks = (spec.peak_fp16_tflop_per_s, spec.peak_bf16_tflop_per_s, spec.peak_fp8_tflop_per_s,
                 spec.peak_tf32_tflop_per_s, spec.peak_fp32_tflop_per_s)
        assert peaks == (989, 989, 1979, 494, 67)
        assert spec.sm_count == 132 and spec.nvlink_bytes_per_ns == 450
    assert h100.hbm_bytes_per_ns == 3350 and h100.memory_bytes == 80 * 2**30 and h100.l2_cache_mebibytes == 50
    assert h200.hbm_bytes_per_ns == 4800 and h200.memory_bytes == 141 * 2**30 and h200.l2_cache_mebibytes == 60


def test_b200_spec_sheet_numbers_and_its_node():
    b200 = get_device("B200")
    assert b200.name == "b200-sxm" and b200.architecture == "blackwell"
    peaks = (b200.peak_fp16_tflop_per_s, b200.peak_bf16_tflop_per_s, b200.peak_fp8_tflop_per_s,
             b200.peak_tf32_tflop_per_s, b200.peak_fp32_tflop_per_s)
    assert peaks == (2250, 2250, 4500, 1125, 75)  # dense: half of the HGX B200 table's sparse figures / 8
    assert b200.hbm_bytes_per_ns == 8000 and b200.memory_bytes == 180 * 2**30 and b200.sm_count == 148
    assert b200.nvlink_bytes_per_ns == 900  # NVLink5: 1.8 TB/s per GPU, both directions
    node = get_cluster_preset(b200.default_cluster)
    assert (node.name, node.gpu, node.gpus_per_node) == ("dgx-b200", "b200-sxm", 8)
    assert node.intra_node_bandwidth_gbytes_per_s == 900 and node.inter_node_bandwidth_gbps == 8 * 400


@pytest.mark.parametrize("name", ["a100-sxm4-40gb", "a100-sxm4-80gb", "h200-sxm", "b200-sxm"])
def test_te_stack_files_state_an_attention_efficiency_and_their_source(name):
    te = calibration_for(name, "megatron_core_te")
    assert te.software_stack == "megatron_core_te" and te.path.endswith(f"{name}/megatron_core_te.json")
    assert te.constants.attention_efficiency > 0 and "joint fit" in te.source.lower()


def test_h200_takes_the_h100_fit_the_same_die():
    """Same GH100 compute and kernels: every constant is the H100's; HBM efficiency is a fraction of each
    GPU's own bandwidth, so the H200's memory-bound kernels run 4800 / 3350 times faster."""
    h100, h200 = (calibration_for(name, "megatron_core_te") for name in ("h100-sxm", "h200-sxm"))
    assert h200.constants == h100.constants and "h100-sxm/megatron_core_te.json" in h200.source


def _package_files() -> dict[str, dict[str, dict[str, float]]]:
    """The constants of every package calibration file of a GPU, by software stack and device."""
    by_stack: dict[str, dict[str, dict[str, float]]] = {}
    for path in sorted(package_calibration_dir().glob("*/*.json")):
        data = json.loads(path.read_text())
        if data["device"] != "cpu":  # on a CPU the host runs the kernels: its host costs are its own
            by_stack.setdefault(data["software_stack"], {})[data["device"]] = data["constants"]
    return by_stack


def test_package_files_of_one_software_stack_agree_on_the_software_constants():
    """Host costs are CPU and framework costs: a stack's files state the same ones on every GPU."""
    files = _package_files()
    assert len(files["default"]) >= 5 and len(files["megatron_core_te"]) >= 5
    for stack, by_device in files.items():
        software = {device: {name: constants.get(name, OPTIONAL_CONSTANTS.get(name)) for name in SOFTWARE_CONSTANTS}
                    for device, constants in by_device.items()}
        first = next(iter(software.values()))
        assert all(values == first for values in software.values()), (stack, software)


def test_fitted_files_come_from_one_joint_fit_and_derived_files_share_their_constants():
    """The A100, H100 and B200 files are written by one joint fit of the published sets; the H200, the
    A100 40GB, GB200 and GB300 files of the stack take the constants of the GPU they derive from."""
    from benchmarks.accuracy.calibrate import DERIVED

    for device, stack in (("a100-sxm4-80gb", "megatron_deepspeed_2023"), ("a100-sxm4-80gb", "megatron_core_te"),
                          ("h100-sxm", "megatron_core_te"), ("b200-sxm", "megatron_core_te"),
                          ("a100-sxm4-80gb", "megatron_core_local"), ("h100-sxm", "megatron_core_local")):
        fitted = calibration_for(device, stack)
        assert fitted.command == ".venv/bin/python -m benchmarks.accuracy.calibrate --into-package", (device, stack)
        assert fitted.source.startswith("Joint fit of 286 published runs"), (device, stack)
    for (device, stack), (origin, _) in DERIVED.items():
        assert calibration_for(device, stack).constants == calibration_for(*origin).constants, device
    # the host costs stand for a DGX H100's CPU; the DGX A100's is slower or as fast, never faster
    assert calibration_for("h100-sxm", "megatron_core_te").constants.host_time_factor == 1.0
    assert calibration_for("a100-sxm4-80gb", "megatron_core_te").constants.host_time_factor >= 1.0


def test_gb200_and_gb300_spec_sheet_numbers_and_their_racks():
    """NVL72 datasheets divided by 72 (dense: the sparse figures halved); a node is a tray of 4, the
    NVLink domain the rack of 72; one NIC per GPU (400 Gb/s ConnectX-7, 800 Gb/s ConnectX-8)."""
    gb200, gb300 = get_device("GB200"), get_device("GB300")
    for spec in (gb200, gb300):
        peaks = (spec.peak_bf16_tflop_per_s, spec.peak_fp8_tflop_per_s, spec.peak_tf32_tflop_per_s)
        assert peaks == (2500, 5000, 1250) and spec.architecture == "blackwell"
        assert spec.hbm_bytes_per_ns == 8000 and spec.nvlink_bytes_per_ns == 900
        assert spec.has_fp4 and spec.has_block_scaled_fp8
    assert (gb200.peak_fp4_tflop_per_s, gb300.peak_fp4_tflop_per_s) == (10000, 15000)
    assert (gb200.memory_bytes, gb300.memory_bytes) == (186 * 2**30, 288 * 2**30)
    for spec, nic_gbps in ((gb200, 400), (gb300, 800)):
        rack = get_cluster_preset(spec.default_cluster)
        assert (rack.gpu, rack.gpus_per_node, rack.gpus_per_nvlink_domain) == (spec.name, 4, 72)
        assert rack.inter_node_bandwidth_gbps == 4 * nic_gbps
    assert get_device("b200").peak_fp4_tflop_per_s == 9000
    assert not get_device("h100").has_fp4 and not get_device("h100").has_block_scaled_fp8


def test_fp8_needs_fp8_tensor_cores():
    get_device("h100-sxm").require_fp8("training.fp8", "hybrid")
    with pytest.raises(ConfigError) as err:
        get_device("A100").require_fp8("training.fp8", "hybrid")
    assert str(err.value) == ("training.fp8 'hybrid' needs fp8 tensor cores; a100-sxm4-80gb (ampere) has none "
                              "(these have: b200-sxm, gb200, gb300, h100-sxm, h200-sxm)")


@pytest.mark.parametrize("alias, name", [
    ("A100", "a100-sxm4-80gb"), ("a100", "a100-sxm4-80gb"), ("H100", "h100-sxm"), ("h200", "h200-sxm"),
    ("b200", "b200-sxm"), ("GB200", "gb200"), ("gb300", "gb300"),
    ("A100-SXM4-40GB", "a100-sxm4-40gb"), (" h100-sxm ", "h100-sxm"),
])
def test_aliases_and_case_insensitive_names(alias, name):
    assert get_device(alias).name == name


def test_unknown_device_lists_known_names():
    with pytest.raises(ConfigError) as err:
        get_device("x")
    assert str(err.value).startswith(
        "unknown GPU 'x'; known: a100-sxm4-40gb, a100-sxm4-80gb, b200-sxm, cpu, gb200, gb300, h100-sxm, h200-sxm")


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
    ("gemm_efficiency", 1.2, r"gemm_efficiency must lie in \[0.5, 0.859\], got 1.2"),
    ("hbm_efficiency", 0.1, r"hbm_efficiency must lie in \[0.5, 0.95\], got 0.1"),
    ("kernel_overhead_ns", 5880, r"kernel_overhead_ns must lie in \[1000, 5000\], got 5880"),
    ("host_overhead_ns", 0, r"host_overhead_ns must be positive, got 0"),
    ("host_overhead_ns", 51549, r"host_overhead_ns must lie in \[1000, 25000\], got 51549"),
    ("microbatch_overhead_ns", 1305, r"microbatch_overhead_ns must lie in \[100000, 5e\+06\], got 1305"),
    ("network_efficiency", 0.51, r"network_efficiency must lie in \[0.7, 0.95\], got 0.51"),
    ("module_host_overhead_ns", 500, r"module_host_overhead_ns must lie in \[2000, 100000\], got 500"),
    ("attention_efficiency", 0.1, r"attention_efficiency must lie in \[0.3, 0.9\], got 0.1"),
])
def test_constants_outside_plausible_range_are_rejected(field, value, message):
    with pytest.raises(ConfigError, match=message):
        _constants(**{field: value})


def test_neutral_values_of_optional_constants_mean_not_modelled():
    neutral = _constants()
    assert (neutral.module_host_overhead_ns, neutral.layer_host_overhead_ns, neutral.network_efficiency) == (0, 0, 1)


def test_every_shipped_calibration_file_lies_inside_the_documented_ranges():
    """Fitted constants are physical: each one in a shipped file inside CONSTANT_RANGES (the neutral
    value of an optional constant only where the file leaves it out)."""
    from vtrain_plugin.hardware.calibration import CONSTANT_RANGES, package_calibration_dir

    files = sorted(package_calibration_dir().glob("*/*.json"))
    assert len(files) >= 6
    for path in files:
        constants = json.loads(path.read_text())["constants"]
        for name, value in constants.items():
            low, high = CONSTANT_RANGES[name]
            assert low <= value <= high, f"{path.parent.name}/{path.name}: {name} = {value} outside [{low}, {high}]"
        ceiling = get_device(path.parent.name).gemm_ceiling
        assert ceiling is None or constants["gemm_efficiency"] <= ceiling, (
            f"{path.parent.name}/{path.name}: gemm_efficiency above the measured ceiling {ceiling:.4f}")


def test_gemm_ceilings_are_the_public_measurements():
    """A100 267.9 and H100 792.1 TFLOP/s (benchmarks/data/gemm_ceilings_public.csv); H200 and B200 at
    the H100's ratio of their spec-sheet peaks; a GEMM efficiency above the ceiling is refused."""
    from vtrain_plugin.hardware.calibration import DeviceConstants, check_gemm_ceiling

    assert get_device("a100-sxm4-80gb").gemm_ceiling == pytest.approx(267.9 / 312)
    assert get_device("a100-sxm4-40gb").gemm_ceiling == pytest.approx(267.9 / 312)
    assert get_device("h100").gemm_ceiling == pytest.approx(792.1 / 989)
    assert get_device("h200").gemm_ceiling == pytest.approx(792.1 / 989)
    assert get_device("b200").gemm_ceiling == pytest.approx(1802.3 / 2250)
    assert get_device("cpu").gemm_ceiling is None
    too_fast = DeviceConstants(gemm_efficiency=0.85, hbm_efficiency=0.8, kernel_overhead_ns=2000, host_overhead_ns=5000)
    with pytest.raises(ConfigError, match=r"gemm_efficiency \(0.85\) must not exceed h100-sxm's measured GEMM "
                                          r"ceiling \(0.8009 of peak\)"):
        check_gemm_ceiling(too_fast, "h100-sxm", where="calibration file x")
    check_gemm_ceiling(too_fast, "a100-sxm4-80gb", where="calibration file x")


def test_spec_validation_names_the_field():
    good = get_device("A100")
    with pytest.raises(ConfigError, match="device 'a100-sxm4-80gb' sm_count must be positive, got 0"):
        dataclasses.replace(good, sm_count=0)
    with pytest.raises(ConfigError, match="hbm_bandwidth_gbytes_per_s must be positive"):
        dataclasses.replace(good, hbm_bandwidth_gbytes_per_s=-1)
    with pytest.raises(ConfigError, match="device 'a100-sxm4-80gb' architecture must be one of cpu, ampere, "
                                          "hopper, blackwell; got 'volta'"):
        dataclasses.replace(good, architecture="volta")


def test_from_dict_rejects_unknown_and_missing_keys():
    data = get_device("A100").to_dict()
    with pytest.raises(ConfigError, match="unknown key 'clock_mhz'"):
        DeviceSpec.from_dict({**data, "clock_mhz": 1410}, where="x.json")
    with pytest.raises(ConfigError, match="x.json: missing key 'sm_count'"):
        DeviceSpec.from_dict({k: val for k, val in data.items() if k != "sm_count"}, where="x.json")
    assert DeviceSpec.from_dict(data, where="x.json") == get_device("A100")


def test_constants_from_dict_rejects_unknown_and_missing_keys():
    data = dataclasses.asdict(calibration_for("a100-sxm4-80gb", "default").constants)
    with pytest.raises(ConfigError, match="unknown key 'speed'"):
        DeviceConstants.from_dict({**data, "speed": 2.0}, where="x.json")
    with pytest.raises(ConfigError, match="x.json constants: missing key 'host_overhead_ns'"):
        DeviceConstants.from_dict({k: val for k, val in data.items() if k != "host_overhead_ns"}, where="x.json")
    assert DeviceConstants.from_dict(data, where="x.json") == calibration_for("a100-sxm4-80gb", "default").constants


@pytest.fixture
def user_calibrations(tmp_path, monkeypatch):
    """A temporary user calibration folder, read before the package's."""
    folder = tmp_path / "calibrations"
    monkeypatch.setenv("VTRAIN_CALIBRATION_DIR", str(folder))
    return folder


def test_write_calibration_persists_into_the_user_folder_and_is_read_first(user_calibrations):
    before = calibration_for("a100-sxm4-80gb", "default")
    constants = dataclasses.replace(before.constants, gemm_efficiency=0.8, kernel_overhead_ns=3000)
    path = write_calibration(Calibration(device="a100-sxm4-80gb", software_stack="default", source="a test",
                                         command="pytest", constants=constants))
    assert path == user_calibrations / "a100-sxm4-80gb" / "default.json"
    after = calibration_for("a100-sxm4-80gb", "default")
    assert after.constants.gemm_efficiency == 0.8 and after.constants.kernel_overhead_ns == 3000
    assert after.path == str(path) and after.source == "a test"
    written = json.loads(path.read_text())
    assert written["constants"]["gemm_efficiency"] == 0.8
    assert written["constants"]["hbm_efficiency"] == before.constants.hbm_efficiency  # untouched values kept
    assert sorted(p.name for p in path.parent.iterdir()) == ["default.json"]  # no temp files
    # a stack's own file (here the package's) still wins over any default one
    fitted = calibration_for("a100-sxm4-80gb", "megatron_deepspeed_2023")
    assert fitted.software_stack == "megatron_deepspeed_2023" and fitted.path != str(path)


def test_constants_are_validated_before_writing_and_when_read(user_calibrations):
    with pytest.raises(ConfigError, match="gemm_efficiency must lie in"):
        _constants(gemm_efficiency=2.0)
    assert not user_calibrations.exists()
    bad = calibration_for("h100-sxm", "default").to_dict()
    bad["constants"]["gemm_efficiency"] = 2.0
    path = user_calibrations / "h100-sxm" / "default.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="gemm_efficiency must lie in"):
        calibration_for("h100-sxm", "default")
    path.write_text(json.dumps({**bad, "constants": {**bad["constants"], "gemm_efficiency": 0.7, "speed": 2.0}}))
    with pytest.raises(ConfigError, match="unknown key 'speed'"):
        calibration_for("h100-sxm", "default")


def test_a_calibration_above_its_devices_gemm_ceiling_is_refused_before_it_is_written(user_calibrations):
    # 0.85 lies inside the documented range (up to the A100's 0.859) but above the H100's 0.801
    over = dataclasses.replace(calibration_for("h100-sxm", "default"),
                               constants=_constants(gemm_efficiency=0.85))
    with pytest.raises(ConfigError, match=r"gemm_efficiency \(0.85\) must not exceed h100-sxm's measured GEMM "
                                          r"ceiling \(0.8009 of peak\)"):
        write_calibration(over)
    assert not user_calibrations.exists()


def test_usable_memory_is_the_measured_capacity_else_the_datasheets_and_says_so():
    h100, b200 = get_device("h100-sxm"), get_device("b200-sxm")
    assert h100.usable_memory_gib == 85017493504 / 2**30 and h100.unmeasured_capacity() == ()
    assert b200.usable_memory_gib == 180.0
    assert b200.unmeasured_capacity() == ("usable memory of b200-sxm not measured: fits is checked against the "
                                          "datasheet's 180 GiB (a real card gives a process a little less: the "
                                          "driver reserves some)",)
    with pytest.raises(ConfigError, match=r"usable_memory_gibibytes \(81\) must not exceed memory_gibibytes \(80\)$"):
        dataclasses.replace(h100, usable_memory_gibibytes=81.0)


def test_the_range_of_a_constant_on_a_device_includes_its_gemm_ceiling():
    from vtrain_plugin.hardware.calibration import CONSTANT_RANGES, constant_range

    assert constant_range("gemm_efficiency", "h100-sxm") == (0.5, get_device("h100-sxm").gemm_ceiling)
    assert constant_range("gemm_efficiency", "a100-sxm4-80gb") == (0.5, 267.9 / 312)  # below the documented 0.859
    assert constant_range("iteration_overhead_ns", "b200-sxm") == CONSTANT_RANGES["iteration_overhead_ns"] == (5e5, 5e7)
    with pytest.raises(ConfigError, match=r"device constant 'speed' is unknown; choose from gemm_efficiency, "):
        constant_range("speed", "h100-sxm")
