"""The expected slowest GPU of a job (cost.stragglers) and its place in an estimate."""

from __future__ import annotations

import dataclasses
import math

import pytest

from vtrain_plugin.cost.kernels.stragglers import expected_max_standard_normal, slowest_gpu_factor
from vtrain_plugin.hardware.calibration import DeviceConstants


def test_expected_maximum_of_standard_normals_matches_the_closed_forms():
    assert expected_max_standard_normal(1) == 0.0
    assert expected_max_standard_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-9)
    assert expected_max_standard_normal(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), abs=1e-9)
    # E[max of 4] = 6 / sqrt(pi) * (1/2 - arcsin(1/3) / (2 pi))... checked against the tabulated 1.029375
    assert expected_max_standard_normal(4) == pytest.approx(1.0293754, abs=1e-6)
    assert expected_max_standard_normal(5) == pytest.approx(1.1629645, abs=1e-6)


def test_the_slowest_gpu_grows_with_the_job_and_the_spread():
    values = [expected_max_standard_normal(n) for n in (1, 8, 64, 512, 3072)]
    assert values == sorted(values) and values[-1] < math.sqrt(2 * math.log(3072))
    assert slowest_gpu_factor(0.0, 3072) == 1.0
    assert slowest_gpu_factor(0.01, 1) == 1.0
    assert slowest_gpu_factor(0.01, 2) == pytest.approx(1 + 0.01 / math.sqrt(math.pi))
    with pytest.raises(ValueError, match="n >= 1"):
        expected_max_standard_normal(0)


def test_an_estimate_stretches_device_time_by_the_slowest_of_its_gpus():
    from vtrain_plugin.runs import run_config_from_dict
    from vtrain_plugin.capture.tracer import trace
    from vtrain_plugin.cost.prepare import prepare
    from vtrain_plugin.estimate import predict
    from vtrain_plugin.hardware.devices import get_device

    plan = {"model": {"num_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 128,
                      "vocab_size": 1024, "dtype": "bf16"},
            "parallel": {"tensor_parallel": 1, "data_parallel": 1, "micro_batch_size": 1},
            "training": {"global_batch_size": 1}, "cluster": {"preset": "dgx-h100"}}
    run = run_config_from_dict(plan, source="test")
    graph = trace(run.model, run.parallel)
    prepared = prepare(graph, run.training.stack_for(run.model, get_device(run.cluster.gpu).architecture))
    base = DeviceConstants(gemm_efficiency=0.7, hbm_efficiency=0.8, kernel_overhead_ns=2000, host_overhead_ns=1000)
    _, plain = predict(prepared, cluster=run.cluster, training=run.training, constants=base)
    spread = dataclasses.replace(base, gpu_speed_spread=0.02)
    _, one_gpu = predict(prepared, cluster=run.cluster, training=run.training, constants=spread)
    assert one_gpu.iteration_ns == plain.iteration_ns  # one GPU: nobody to wait for


def test_the_kernel_timer_stretches_measured_and_modeled_kernels_alike():
    import numpy as np

    from vtrain_plugin.core.graph import KernelKey, OpNode, Phase
    from vtrain_plugin.cost.kernels.model import KernelBatch
    from vtrain_plugin.cost.kernels.timer import KernelTimer
    from vtrain_plugin.hardware.devices import get_device

    nodes = [OpNode(key=KernelKey(op="aten.mm.default", input_shapes=((512, 512), (512, 512)),
                                  dtypes=("bfloat16",) * 2), phase=Phase.FORWARD, module="m", launches_kernel=True)] * 2
    batch, measured = KernelBatch.of(nodes), np.array([np.nan, 5000.0])
    base = DeviceConstants(gemm_efficiency=0.7, hbm_efficiency=0.8, kernel_overhead_ns=2000, host_overhead_ns=1000)
    plain = KernelTimer(get_device("h100"), base).device_ns(batch, measured)
    slow = KernelTimer(get_device("h100"), base, slowdown=slowest_gpu_factor(0.02, 8)).device_ns(batch, measured)
    assert slow[1] == pytest.approx(5000.0 * (1 + 0.02 * expected_max_standard_normal(8)))
    assert slow[0] / plain[0] == pytest.approx(1 + 0.02 * expected_max_standard_normal(8))
