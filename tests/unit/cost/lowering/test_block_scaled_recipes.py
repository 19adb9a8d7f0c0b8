"""MXFP8, blockwise FP8 and NVFP4 on a real megatron-core Llama layer traced on the fake process group:
their GEMM rates, scale memory and quantisation kernels, and their refusal before tracing on a GPU
whose tensor cores cannot run them."""

from __future__ import annotations

import pytest

import importlib
from vtrain_plugin import estimate
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import OpNode, Phase
from vtrain_plugin.core.units import GIB
from vtrain_plugin.cost.lowering.fp8 import fp8_weight_numel
from vtrain_plugin.cost.lowering.stacks import map_nodes
from vtrain_plugin.hardware.clusters import cluster_for_gpu
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.run import RunConfig
from vtrain_plugin.specs.training import Fp4Recipe, Fp8Format, Fp8Recipe, Fp8Settings, TrainingSpec

# One layer wide enough that its GEMMs, not the host, set the pace on a B200.
MODEL = ModelSpec(family="llama", num_layers=1, hidden_size=4096, num_attention_heads=32, seq_length=4096,
                  vocab_size=1024, dtype="bf16")
PLAN = ParallelPlan(micro_batch_size=1)
B200 = cluster_for_gpu("b200")


@pytest.fixture(scope="module")
def graph():
    from vtrain_plugin.capture.tracer import trace

    return trace(MODEL, PLAN)


def _estimate(graph, **precision):
    return estimate(graph, cluster=B200, training=TrainingSpec(global_batch_size=1, **precision), profile_db=False)


def _compute_ms(result) -> float:
    return result.breakdown_ms["forward"] + result.breakdown_ms["backward"]


def test_mxfp8_is_faster_than_bf16_and_nvfp4_faster_than_mxfp8_on_b200(graph):
    bf16, mxfp8, nvfp4 = (_estimate(graph), _estimate(graph, fp8="e4m3", fp8_recipe="mxfp8"),
                          _estimate(graph, fp4="e2m1"))
    assert _compute_ms(mxfp8) < _compute_ms(bf16)
    assert _compute_ms(nvfp4) < _compute_ms(mxfp8)
    assert any(line.startswith("b200-sxm peak_fp4_tflop_per_s (9000) rests on the datasheet alone")
               for line in nvfp4.assumptions)
    assert any(line.startswith("mxfp8: the linears' GEMMs at the fp8 tensor-core peak") for line in mxfp8.assumptions)


def test_block_scales_are_kept_with_the_weight_copies(graph):
    """Per linear weight element, the copy and its transpose each add their scales: MXFP8 1/32 byte
    (E8M0 per 32), blockwise 4/16384 (fp32 per 128x128 tile), beside delayed scaling's none."""
    linear = sum(b.count * fp8_weight_numel(b.nodes) for s in graph.stages for b in s.blocks)
    delayed = _estimate(graph, fp8="e4m3").memory_gib[0].weights_gib
    mxfp8 = _estimate(graph, fp8="e4m3", fp8_recipe="mxfp8").memory_gib[0].weights_gib
    blockwise = _estimate(graph, fp8="e4m3", fp8_recipe="blockwise").memory_gib[0].weights_gib
    nvfp4 = _estimate(graph, fp4="e2m1").memory_gib[0].weights_gib
    assert mxfp8 - delayed == pytest.approx(2 * linear / 32 / GIB)
    assert blockwise - delayed == pytest.approx(2 * linear * 4 / 16384 / GIB)
    assert nvfp4 - delayed == pytest.approx(2 * linear * (0.5 + 1 / 256 - 1) / GIB)


def test_quantisation_kernels_write_both_copies_with_their_scales(graph):
    layer = next(b for b in graph.stages[0].blocks if b.count and fp8_weight_numel(b.nodes))
    for recipe, op, per_copy in ((Fp8Recipe.MXFP8, "te.quantize_mxfp8.default", 1 + 1 / 32),
                                 (Fp4Recipe.NVFP4, "te.quantize_nvfp4.default", 0.5 + 1 / 16)):
        nodes = map_nodes(layer.nodes, "megatron_core_te", Fp8Settings(format=Fp8Format.E4M3, recipe=recipe))
        casts = [n for n in nodes if isinstance(n, OpNode) and n.op == op and n.phase is Phase.FORWARD]
        assert casts, recipe
        for cast in casts:
            elements = 1
            for extent in cast.key.input_shapes[0]:
                elements *= extent
            assert cast.nbytes == round((2 + 2 * per_copy) * elements)  # reads bf16, writes two copies
        amax = [n for n in nodes if isinstance(n, OpNode) and n.op == "te.compute_amax.default"]
        assert bool(amax) == (recipe is Fp4Recipe.NVFP4)  # NVFP4's per-tensor scale needs the amax first


@pytest.mark.parametrize("gpu, precision, message", [
    ("h100", dict(fp8="e4m3", fp8_recipe="mxfp8"),
     "training.fp8_recipe 'mxfp8' needs tensor cores that apply block scales (Blackwell); h100-sxm (hopper) has none "
     "(these have: b200-sxm, gb200, gb300)"),
    ("h100", dict(fp4="e2m1"),
     "training.fp4 'e2m1' needs fp4 tensor cores (nvfp4); h100-sxm (hopper) has none (these have: b200-sxm, gb200, "
     "gb300)"),
    ("a100", dict(fp8="hybrid", fp8_recipe="blockwise"),
     "training.fp8 'hybrid' needs fp8 tensor cores; a100-sxm4-80gb (ampere) has none (these have: b200-sxm, gb200, "
     "gb300, h100-sxm, h200-sxm)"),
])
def test_a_recipe_the_gpu_cannot_run_is_refused_before_tracing(monkeypatch, gpu, precision, message):
    def no_trace(*args, **kwargs):
        raise AssertionError("traced before the GPU was checked")

    monkeypatch.setattr(importlib.import_module("vtrain_plugin.estimate"), "trace", no_trace)
    run = RunConfig(model=MODEL, parallel=PLAN, training=TrainingSpec(global_batch_size=1, **precision),
                    cluster=cluster_for_gpu(gpu))
    with pytest.raises(ConfigError) as err:
        estimate(run, profile_db=False)
    assert str(err.value) == message


def test_blockwise_fp8_runs_on_hopper():
    get_device("h100").require_recipe(TrainingSpec(global_batch_size=1, fp8="e4m3", fp8_recipe="blockwise"))
