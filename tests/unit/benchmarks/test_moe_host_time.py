"""benchmarks/accuracy/moe_host_time.py: what the cost model charges a phase's host for, the split of
a layer into parts, the dense-scaled comparison, and its bad-input errors."""

import pytest

from benchmarks.accuracy.moe_host_time import charged_ms, main, part_of, scaled_rows
from vtrain_plugin.hardware.calibration import DeviceConstants


@pytest.mark.parametrize("module, part", [
    ("decoder.layers.0.mlp.router", "router"),
    ("decoder.layers.3.mlp.experts.local_experts.15.linear_fc2", "experts"),
    ("decoder.layers.0.mlp", "mlp / MoE dispatch"),
    ("decoder.layers.0.mlp.linear_fc1", "mlp / MoE dispatch"),
    ("decoder.layers.0.self_attention.linear_qkv", "attention"),
    ("decoder.layers.0.input_layernorm", "rest"),
    ("output_layer", "rest"),
])
def test_each_module_falls_in_its_part(module, part):
    assert part_of(module) == part


CONSTANTS = DeviceConstants(gemm_efficiency=0.7, hbm_efficiency=0.7, kernel_overhead_ns=4000.0,
                            host_overhead_ns=10_000.0, backward_host_overhead_ns=5_000.0,
                            module_host_overhead_ns=50_000.0, layer_host_overhead_ns=500_000.0)


def test_a_phase_is_charged_its_kernels_module_calls_and_half_the_layer_calls():
    traced = {"forward": 100, "backward": 200, "optimizer": 50, "forward module calls": 10,
              "backward module calls": 8, "layer calls": 4}
    charged = charged_ms(traced, CONSTANTS)
    assert charged["forward"] == pytest.approx(100 * 0.010 + 10 * 0.050 + 2 * 0.5)
    assert charged["backward"] == pytest.approx(200 * 0.005 + 8 * 0.050 + 2 * 0.5)
    assert charged["optimizer"] == pytest.approx(50 * 0.010)  # no module or layer work in the optimizer


def test_the_reference_plan_is_exact_and_another_is_scaled_by_it_phase_by_phase():
    traced = {"forward": 100, "backward": 200, "optimizer": 50, "layer calls": 2}
    dense = {"plan": "dense-host", "traced": traced, "cpu_s": {"forward": 0.001, "backward": 0.0015, "optimizer": 0.00025}}
    double = {p: 2 * n for p, n in traced.items()}
    moe = {"plan": "moe-host", "traced": double, "cpu_s": {"forward": 0.004, "backward": 0.003, "optimizer": 0.0005}}
    lines = scaled_rows([moe, dense], dense, CONSTANTS)
    assert "forward 1.00 / 1.00 ms (+0%)" in lines[2] and "step 2.75 / 2.75 ms (+0.0%)" in lines[2]
    # twice the charge at the dense scale: forward 2.00 against 4.00 measured, the rest exact
    assert "forward 4.00 / 2.00 ms (-50%)" in lines[1] and "backward 3.00 / 3.00 ms (+0%)" in lines[1]


@pytest.mark.parametrize("argv, message", [(["--plans", "nope"], "--plans: unknown plan 'nope'"),
                                           (["--repeats", "0"], "--repeats: must be at least 1")])
def test_bad_arguments_name_the_field_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_gpu_result_reports_the_allocators_work_during_the_timed_steps():
    from benchmarks.accuracy.moe_host_time import report

    phases = {"forward": 0.002, "backward": 0.004, "optimizer": 0.001}
    result = {"plan": "moe-0.9b", "device": "cuda", "parameters": 471, "cpu_s": phases, "wall_s": phases,
              "ops": {"forward": 100, "backward": 200, "optimizer": 50}, "traced": {"forward": 50},
              "module_calls": 10, "autograd_nodes": 150, "parts": {}, "parts_ms": {"experts": 1.0}, "syncs": {},
              "allocator": {"segments allocated": 3, "segments freed": 0, "retries": 0}}
    text = report(result)
    assert "moe-0.9b (cuda)" in text and "forward         2.00 ms      2.00 ms     100 ops" in text
    assert "the caching allocator's segments allocated 3, segments freed 0, retries 0" in text
    assert "ops the host would wait on, on a GPU: none" in text
