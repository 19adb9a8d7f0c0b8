"""Op classification and the analytical kernel model, on a round-number device and the presets."""

from __future__ import annotations

import ast
import dataclasses
import math

import numpy as np
import pytest

from tests.conftest import REPO
from vtrain_plugin.core.graph import KernelKey, OpNode, Phase
from vtrain_plugin.core.op_names import launches_kernel
from vtrain_plugin.cost.kernels.host_device import Segment, SegmentTime, segment_times, sequence
from vtrain_plugin.cost.kernels.model import GemmDims, KernelBatch, KernelModel, gemm_dims
from vtrain_plugin.cost.kernels.op_classes import OpClass, classify
from vtrain_plugin.hardware.calibration import DeviceConstants, calibration_for
from vtrain_plugin.hardware.devices import DeviceSpec, get_device

# 100 TFLOP/s fp16 = 1e5 FLOP/ns, 1000 GB/s = 1000 B/ns, halved by the efficiencies; 4 SMs.
ROUND = DeviceSpec(
    name="round", architecture="ampere", peak_fp16_tflop_per_s=100, peak_bf16_tflop_per_s=100, peak_tf32_tflop_per_s=50,
    peak_fp32_tflop_per_s=10, hbm_bandwidth_gbytes_per_s=1000, memory_gibibytes=16, sm_count=4,
    l2_cache_mebibytes=8, nvlink_gbytes_per_s_per_direction=100, default_cluster="dgx-a100",
)
ROUND_CONSTANTS = DeviceConstants(gemm_efficiency=0.5, hbm_efficiency=0.5, kernel_overhead_ns=1000,
                                  host_overhead_ns=5000, attention_efficiency=0.4)
# The A100 80GB constants fitted to Megatron-DeepSpeed (its other stacks get uncalibrated defaults).
A100_CONSTANTS = calibration_for("a100-sxm4-80gb", "megatron_deepspeed_2023").constants


def _round_model(**kwargs) -> KernelModel:
    return KernelModel(ROUND, ROUND_CONSTANTS, **kwargs)


def _preset_model(name: str) -> KernelModel:
    device = get_device(name)
    if device.name == "a100-sxm4-80gb":
        return KernelModel(device, A100_CONSTANTS)
    return KernelModel(device, calibration_for(device.name, "default").constants)


def _key(op: str, *shapes: tuple[int, ...], dtype: str = "float16") -> KernelKey:
    return KernelKey(op=op, input_shapes=shapes, dtypes=(dtype,) * len(shapes))


def _node(key: KernelKey, *, flops: int = 0, nbytes: int = 0, phase: Phase = Phase.FORWARD,
          launches: bool = True) -> OpNode:
    return OpNode(key=key, phase=phase, module="m", flops=flops, nbytes=nbytes, launches_kernel=launches)


def _mm(m: int, n: int, k: int, dtype: str = "float16") -> KernelKey:
    return _key("aten.mm.default", (m, k), (k, n), dtype=dtype)


# ---- classification ----------------------------------------------------------------------------

@pytest.mark.parametrize("op, expected", [
    ("aten.mm.default", OpClass.GEMM),
    ("aten.addmm.default", OpClass.GEMM),
    ("aten.bmm.default", OpClass.GEMM),
    ("aten.baddbmm.default", OpClass.GEMM),
    ("aten._scaled_mm.default", OpClass.GEMM),
    ("aten.convolution_backward.default", OpClass.GEMM),
    ("aten._scaled_dot_product_flash_attention.default", OpClass.ATTENTION),
    ("aten._scaled_dot_product_flash_attention_backward.default", OpClass.ATTENTION),
    ("aten.native_layer_norm.default", OpClass.NORM),
    ("aten.native_layer_norm_backward.default", OpClass.NORM),
    ("aten._fused_rms_norm.default", OpClass.NORM),
    ("aten._softmax.default", OpClass.SOFTMAX),
    ("aten._softmax_backward_data.default", OpClass.SOFTMAX),
    ("aten.gelu.default", OpClass.ACTIVATION),
    ("aten.gelu_backward.default", OpClass.ACTIVATION),
    ("aten.threshold_backward.default", OpClass.ACTIVATION),
    ("aten.native_dropout.default", OpClass.DROPOUT),
    ("aten.native_dropout_backward.default", OpClass.DROPOUT),
    ("aten.bernoulli_.float", OpClass.DROPOUT),
    ("aten.add.Tensor", OpClass.ELEMENTWISE),
    ("aten.mul_.Tensor", OpClass.ELEMENTWISE),
    ("aten.__and__.Tensor", OpClass.ELEMENTWISE),
    ("aten.some_new_op.default", OpClass.ELEMENTWISE),
    ("aten.sum.dim_IntList", OpClass.REDUCTION),
    ("aten.mean.dim", OpClass.REDUCTION),
    ("aten.amax.default", OpClass.REDUCTION),
    ("aten.embedding.default", OpClass.EMBEDDING),
    ("aten.embedding_dense_backward.default", OpClass.EMBEDDING),
    ("aten._log_softmax.default", OpClass.LOSS),
    ("aten._log_softmax_backward_data.default", OpClass.LOSS),
    ("aten.nll_loss_forward.default", OpClass.LOSS),
    ("aten.nll_loss_backward.default", OpClass.LOSS),
    ("aten._foreach_add_.List", OpClass.OPTIMIZER),
    ("aten._fused_adam_.default", OpClass.OPTIMIZER),
    ("aten.copy_.default", OpClass.COPY),
    ("aten._to_copy.default", OpClass.COPY),
    ("aten.clone.default", OpClass.COPY),
    ("aten.cat.default", OpClass.COPY),
    ("aten.select_backward.default", OpClass.COPY),
    ("aten.slice_backward.default", OpClass.COPY),
    ("aten._local_scalar_dense.default", OpClass.HOST_SYNC),
    ("aten.view.default", OpClass.NO_KERNEL),
    ("aten._unsafe_view.default", OpClass.NO_KERNEL),
    ("aten.t.default", OpClass.NO_KERNEL),
    ("aten.transpose.int", OpClass.NO_KERNEL),
    ("aten.expand.default", OpClass.NO_KERNEL),
    ("aten.as_strided.default", OpClass.NO_KERNEL),
    ("aten.detach.default", OpClass.NO_KERNEL),
    ("aten.alias.default", OpClass.NO_KERNEL),
    ("aten.slice.Tensor", OpClass.NO_KERNEL),
    ("aten.select.int", OpClass.NO_KERNEL),
    ("aten.split.Tensor", OpClass.NO_KERNEL),
    ("aten.unsqueeze_.default", OpClass.NO_KERNEL),
    ("aten.squeeze.dim", OpClass.NO_KERNEL),
    ("aten.permute.default", OpClass.NO_KERNEL),
    ("aten.empty.memory_format", OpClass.NO_KERNEL),
    ("aten.empty_like.default", OpClass.NO_KERNEL),
    ("aten.lift_fresh.default", OpClass.NO_KERNEL),
    ("prim.device.default", OpClass.NO_KERNEL),
])
def test_classify(op, expected):
    assert classify(op) is expected


def test_optimizer_phase_makes_every_kernel_an_optimizer_kernel():
    assert classify("aten.mul_.Tensor", Phase.OPTIMIZER) is OpClass.OPTIMIZER
    assert classify("aten.sqrt.default", Phase.OPTIMIZER) is OpClass.OPTIMIZER
    assert classify("aten.view.default", Phase.OPTIMIZER) is OpClass.NO_KERNEL
    assert classify("aten._local_scalar_dense.default", Phase.OPTIMIZER) is OpClass.HOST_SYNC
    assert classify("aten.mul_.Tensor", Phase.BACKWARD) is OpClass.ELEMENTWISE


@pytest.mark.parametrize("op, expected", [
    ("aten.mm.default", True), ("aten.gelu.default", True), ("aten.copy_.default", True),
    ("aten.slice_backward.default", True), ("aten.view.default", False), ("aten.t.default", False),
    ("aten.empty.memory_format", False), ("prim.device.default", False),
    ("aten._local_scalar_dense.default", False),
])
def test_launches_kernel(op, expected):
    assert launches_kernel(op) is expected


# ---- GEMM dims ----------------------------------------------------------------------------------

@pytest.mark.parametrize("key, dims", [
    (_key("aten.mm.default", (2, 3), (3, 5)), GemmDims(batch=1, m=2, n=5, k=3)),
    (_key("aten.addmm.default", (5,), (2, 3), (3, 5)), GemmDims(batch=1, m=2, n=5, k=3)),
    (_key("aten.bmm.default", (7, 2, 3), (7, 3, 5)), GemmDims(batch=7, m=2, n=5, k=3)),
    (_key("aten.baddbmm.default", (7, 2, 5), (7, 2, 3), (7, 3, 5)), GemmDims(batch=7, m=2, n=5, k=3)),
    (_key("aten.linear.default", (4, 2, 3), (5, 3)), GemmDims(batch=1, m=8, n=5, k=3)),
    (_key("aten.matmul.default", (4, 2, 3), (3, 5)), GemmDims(batch=1, m=8, n=5, k=3)),
    (_key("aten.gelu.default", (2, 3)), None),
    (_key("aten.mm.default", (0, 3), (3, 5)), None),
    (_key("aten.convolution.default", (1, 3, 8, 8), (4, 3, 3, 3)), None),
])
def test_gemm_dims(key, dims):
    assert gemm_dims(key) == dims


# ---- exact durations on the round device --------------------------------------------------------

def test_gemm_exact_with_flops_and_bytes_from_shapes():
    # 256^3 fp16: 4 tiles of 128x128 on 4 SMs (occupancy 1), K factor 256/384 -> efficiency 1/3.
    # compute 2*256^3 / (1e5 / 3) = 1006.63296 ns; memory 3*256*256*2 B / 500 = 786.432 ns.
    model = _round_model()
    assert model.gemm_efficiency(GemmDims(batch=1, m=256, n=256, k=256)) == pytest.approx(1 / 3)
    assert model.duration_ns(_node(_mm(256, 256, 256))) == pytest.approx(1006.63296 + 1000)


def test_gemm_uses_the_nodes_flops_and_bytes_when_present():
    model = _round_model()
    assert model.duration_ns(_node(_mm(256, 256, 256), flops=4_000_000, nbytes=1_000_000)) == pytest.approx(
        max(4_000_000 / 40_000, 1_000_000 / 500) + 1000)


def test_bmm_small_tiles_and_short_k():
    # 8 x (64x32 @ 32x64): 64x64 tiles, 8 tiles in 2 full waves; K factor 32/160 -> efficiency 1/10.
    # compute 2097152 / (1e5/10) = 209.7 ns < memory (65536 + 65536 B) / 500 = 262.144 ns.
    model = _round_model()
    key = _key("aten.bmm.default", (8, 64, 32), (8, 32, 64))
    assert model.gemm_efficiency(gemm_dims(key)) == pytest.approx(0.5 / 5)
    assert model.duration_ns(_node(key)) == pytest.approx(262.144 + 1000)


def test_wave_quantization():
    # 128x640: 5 tiles on 4 SMs take 2 waves -> occupancy 5/8; K factor 64/192.
    model = _round_model()
    assert model.gemm_efficiency(GemmDims(batch=1, m=128, n=640, k=64)) == pytest.approx(0.5 * 5 / 8 / 3)


def test_split_k_fills_the_sms_when_tiles_are_few_and_k_is_long():
    # One 128x128 tile on 4 SMs, K 8192: unsplit 8192 + 128 = 8320 steps; split in 4 (one wave):
    # 2048 + 128 + 1024 = 3200 steps, the fewest -> efficiency 0.5 * 8192 / (4 * 3200).
    model = _round_model()
    assert model.gemm_efficiency(GemmDims(batch=1, m=128, n=128, k=8192)) == pytest.approx(0.5 * 8192 / 12800)
    # K 512: a split costs more than it saves (512 + 128 = 640 < 128 + 128 + 1024 steps)
    assert model.gemm_efficiency(GemmDims(batch=1, m=128, n=128, k=512)) == pytest.approx(0.5 * 512 / (4 * 640))
    # enough tiles for every SM: no split
    assert model.gemm_efficiency(GemmDims(batch=1, m=256, n=256, k=8192)) == pytest.approx(0.5 * 8192 / 8320)


def test_fp32_gemm_runs_on_tf32_unless_disabled():
    key, flops = _mm(4096, 4096, 4096, dtype="float32"), 2 * 4096**3
    eff = _round_model().gemm_efficiency(gemm_dims(key))
    assert _round_model().duration_ns(_node(key, flops=flops, nbytes=1)) == pytest.approx(
        flops / (50e3 * eff) + 1000)
    assert _round_model(allow_tf32=False).duration_ns(_node(key, flops=flops, nbytes=1)) == pytest.approx(
        flops / (10e3 * eff) + 1000)


def test_attention_and_memory_bound_ops_exact():
    model = _round_model()
    sdpa = _key("aten._scaled_dot_product_flash_attention.default", (1, 8, 128, 64), (1, 8, 128, 64),
                (1, 8, 128, 64), dtype="bfloat16")
    # fused attention at its own efficiency: 100 TFLOP/s x 0.4 = 4e4 FLOP/ns; at the GEMM's (0.5) when a
    # calibration leaves attention_efficiency out
    assert model.duration_ns(_node(sdpa, flops=10_000_000, nbytes=1000)) == pytest.approx(
        10_000_000 / 40_000 + 1000)
    unset = KernelModel(ROUND, dataclasses.replace(ROUND_CONSTANTS, attention_efficiency=0.0))
    assert unset.duration_ns(_node(sdpa, flops=10_000_000, nbytes=1000)) == pytest.approx(10_000_000 / 50_000 + 1000)
    gelu = _key("aten.gelu.default", (1000, 250))
    assert model.duration_ns(_node(gelu, nbytes=1_000_000)) == pytest.approx(2000 + 1000)
    assert model.duration_ns(_node(gelu, flops=50_000_000, nbytes=1_000_000)) == pytest.approx(5000 + 1000)
    adam = _node(_key("aten._foreach_mul_.Scalar", (1000,)), nbytes=500_000, phase=Phase.OPTIMIZER)
    assert model.duration_ns(adam) == pytest.approx(1000 + 1000)


def test_indexed_kernels_are_bound_by_their_elements():
    # the round device (4 SMs, 500 B/ns): 1 Mi index elements of gather (0.93 per ns per SM) take
    # 2**20 / 3.72 ns, their 8 MiB of bytes only 16,777 ns; index_select copies rows and stays memory-bound
    model = _round_model()
    elements = 1 << 20
    gather = _node(_key("aten.gather.default", (256, 1024), (1024, 1024), dtype="bfloat16"), nbytes=8 << 20)
    assert model.duration_ns(gather) == pytest.approx(elements / (4 * 0.93) + 1000)
    index_add = _node(_key("aten.index_add.default", (256, 1024), (1024,), (1024, 1024), dtype="bfloat16"),
                      nbytes=8 << 20, phase=Phase.BACKWARD)
    assert model.duration_ns(index_add) == pytest.approx(elements / (4 * 0.87) + 1000)
    select = _node(_key("aten.index_select.default", (256, 1024), (1024,), dtype="bfloat16"), nbytes=8 << 20)
    assert model.duration_ns(select) == pytest.approx((8 << 20) / 500 + 1000)
    cpu = KernelModel(get_device("cpu"), calibration_for("cpu", "default").constants)
    add = dataclasses.replace(gather, key=dataclasses.replace(gather.key, op="aten.add.Tensor"))
    assert cpu.duration_ns(gather) == cpu.duration_ns(add)  # the rates are a GPU's


def test_moe_unpermutation_kernels_match_the_h100_and_h200_profiles():
    # 16384 routed tokens x hidden 1024, bf16, as megatron-core's permutation traces them; measured
    # by replay on a lent H100 and H200 (h100_profiles.json, h200_trace_in_script_profiles.json), us
    h, routed = (4096, 1024), (16384, 1024)
    cases = [(_key("aten.gather.default", h, routed, dtype="bfloat16"), (149.4, 128.8)),
             (_key("aten.scatter_add_.default", h, routed, routed, dtype="bfloat16"), (298.9, 257.2)),
             (_key("aten.index_add.default", h, (16384,), routed, dtype="bfloat16"), (154.7, 143.7))]
    for key, measured in cases:
        nbytes = sum(math.prod(s) for s in key.input_shapes) * 2
        for gpu, us in zip(("h100-sxm", "h200-sxm"), measured):
            modelled = _preset_model(gpu).duration_ns(_node(key, nbytes=nbytes)) / 1e3
            assert modelled == pytest.approx(us, rel=0.1), (key.op, gpu)


def test_no_kernel_ops_cost_nothing():
    model = _round_model()
    for node in (_node(_key("aten.view.default", (4, 4)), nbytes=64),
                 _node(_key("aten._local_scalar_dense.default", (1,)), nbytes=2),
                 _node(_mm(256, 256, 256), launches=False)):
        assert (model.duration_ns(node), model.host_ns(node)) == (0, 0)


def test_repeated_kernels_take_the_slower_of_device_and_host():
    model = _round_model()
    small = _node(_key("aten.add.Tensor", (10,), (10,)), nbytes=60)
    assert model.host_ns(small) == 5000 > model.duration_ns(small)
    big = _node(_mm(4096, 4096, 4096))
    assert model.duration_ns(big) > 5000 == model.host_ns(big)
    for node in (small, big):
        host, device = model.host_ns(node), model.duration_ns(node)
        repeated = SegmentTime(host_ns=host, device_ns=device, pipelined_ns=host + device, count=10)
        assert sequence([repeated]) == pytest.approx(host + device + 9 * max(host, device))


# ---- sanity on the presets ----------------------------------------------------------------------

def test_large_gemm_on_a100_reaches_60_to_90_percent_of_peak():
    model = _preset_model("A100")
    flops = 2 * 2048 * 12288 * 4608
    achieved = flops / model.duration_ns(_node(_mm(2048, 12288, 4608), flops=flops)) / 312e3
    assert 0.6 <= achieved <= 0.9


def test_tiny_gemm_is_overhead_dominated():
    model = _preset_model("A100")
    assert model.duration_ns(_node(_mm(64, 64, 64))) < 2 * A100_CONSTANTS.kernel_overhead_ns


def test_bigger_gemm_never_takes_less_time():
    model = _preset_model("H100")
    sizes = [16, 64, 100, 128, 129, 256, 1000, 1024, 4096, 4608, 12288]
    for m in sizes:
        for n in sizes:
            for k in sizes:
                t = model.duration_ns(_node(_mm(m, n, k)))
                for bigger in ((2 * m, n, k), (m, 2 * n, k), (m, n, 2 * k), (m + 1, n, k)):
                    assert model.duration_ns(_node(_mm(*bigger))) >= t * (1 - 1e-12)  # equal up to rounding
    assert model.duration_ns(_node(_mm(8192, 8192, 8192))) > model.duration_ns(_node(_mm(4096, 4096, 4096)))


def test_faster_device_is_faster_on_large_gemms():
    node = _node(_mm(8192, 8192, 8192))
    h100, a100 = _preset_model("H100"), _preset_model("A100")
    assert h100.duration_ns(node) < a100.duration_ns(node)


def test_kernel_cost_modules_do_not_import_the_simulator_or_the_comm_model():
    root = REPO / "vtrain_plugin"
    for name in ("hardware/devices.py", "hardware/calibration.py", "cost/kernels/model.py",
                 "cost/kernels/op_classes.py", "cost/kernels/timer.py", "cost/lowering/stacks.py"):
        tree = ast.parse((root / name).read_text())
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in imported if m and m.startswith(("vtrain_plugin.sim", "vtrain_plugin.cost.comm"))]


# ---- batches, host time and the CPU -> GPU pipeline ------------------------------------------------

def test_batch_times_equal_per_node_times():
    model = _round_model()
    nodes = [_node(_mm(256, 256, 256)), _node(_key("aten.gelu.default", (1000, 250)), nbytes=1_000_000),
             _node(_key("aten.view.default", (4, 4))), _node(_key("aten.bmm.default", (8, 64, 32), (8, 32, 64)))]
    batch = KernelBatch.of(nodes)
    assert list(model.device_ns(batch)) == pytest.approx([model.duration_ns(n) for n in nodes])
    assert list(model.host_ns_batch(batch)) == [5000, 5000, 0, 5000]


def test_backward_kernels_pay_the_backward_host_overhead():
    model = KernelModel(ROUND, dataclasses.replace(ROUND_CONSTANTS, backward_host_overhead_ns=700))
    add = _key("aten.add.Tensor", (10,), (10,))
    assert model.host_ns(_node(add, phase=Phase.BACKWARD)) == 700
    assert model.host_ns(_node(add, phase=Phase.RECOMPUTE)) == 5000
    assert model.host_ns(_node(add, phase=Phase.OPTIMIZER)) == 5000


def test_a_grouped_gemm_costs_the_host_one_launch_per_expert():
    # TE's grouped GEMM loops over its experts' cuBLAS GEMMs: 4 experts, 4 launches of 5000 ns;
    # a batched matmul of the same shape is one launch.
    grouped = _node(_key("te.grouped_gemm.default", (4, 64, 32), (4, 32, 64)))
    bmm = _node(_key("aten.bmm.default", (4, 64, 32), (4, 32, 64)))
    model = _round_model()
    assert model.host_ns(grouped) == 4 * 5000
    assert model.host_ns(bmm) == 5000
    assert list(model.host_ns_batch(KernelBatch.of([grouped, bmm]))) == [20000, 5000]
    assert model.duration_ns(grouped) == model.duration_ns(bmm)  # the device runs them alike


def test_the_constants_set_the_overheads():
    faster = dataclasses.replace(ROUND_CONSTANTS, kernel_overhead_ns=1500)
    node = _node(_key("aten.gelu.default", (1000, 250)), nbytes=1_000_000)
    assert KernelModel(ROUND, faster).duration_ns(node) == pytest.approx(2000 + 1500)


def pipeline_ns(host: np.ndarray, device: np.ndarray) -> float:
    """Pipelined time of one segment holding all the kernels."""
    segment = Segment(block=0, phase=Phase.FORWARD, start=0, stop=len(host), count=1)
    return float(segment_times(host, device, [segment])[2][0])


def test_pipeline_is_the_slower_stage_plus_the_fill():
    # CPU issues in 10 each; the GPU runs 1, 30, 1: kernel 2 starts at 20 and ends at 50, kernel 3 at 51.
    assert pipeline_ns(np.array([10.0, 10.0, 10.0]), np.array([1.0, 30.0, 1.0])) == 51.0
    assert pipeline_ns(np.array([1.0, 1.0]), np.array([50.0, 50.0])) == 101.0  # device-bound
    assert pipeline_ns(np.array([40.0, 40.0]), np.array([1.0, 1.0])) == 81.0  # host-bound
    assert pipeline_ns(np.array([]), np.array([])) == 0.0
