"""The TFLOP/s and MFU of an estimate are Megatron-LM's quantity: the FLOPs of its own
``num_floating_point_operations`` on the same arguments, over the predicted iteration, against the
peak the output names; the traced kernels' FLOPs (recompute and flash attention's backward included)
stay the hardware TFLOP/s."""

import json

import pytest

from tests.support.megatron_reference import (
    megatron_args,
    num_floating_point_operations,
)
from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

# Llama-style MoE: GQA, SwiGLU, 4 experts (2 routed) and a shared expert on every other layer, one MTP layer
FLAGS = ("--num-layers 2 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
         "--ffn-hidden-size 512 --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --seq-length 128 --max-position-embeddings 128 --vocab-size 1000 "
         "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 128 --moe-shared-expert-intermediate-size 256 "
         "--moe-layer-freq 2 --mtp-num-layers 1 --micro-batch-size 1 --global-batch-size 16 --bf16 "
         "--tensor-model-parallel-size 2 --sequence-parallel")
ARGS = dict(num_layers=2, hidden_size=256, num_attention_heads=8, group_query_attention=True, num_query_groups=2,
            ffn_hidden_size=512, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
            untie_embeddings_and_output_weights=True, seq_length=128, padded_vocab_size=1024, num_experts=4,
            moe_router_topk=2, moe_ffn_hidden_size=128, moe_shared_expert_intermediate_size=256, moe_layer_freq=2,
            mtp_num_layers=1)


def test_cli_reports_megatrons_flops_tflops_and_the_peak_of_its_mfu(run_cli):
    proc = run_cli("estimate", "--megatron-args", FLAGS, "--gpus", "4", "--gpu", "h100-sxm", "--format", "json",
                   check=True)
    result = json.loads(proc.stdout)
    reference = num_floating_point_operations(megatron_args(**ARGS), 16)
    assert result["model_flops_per_iteration"] == pytest.approx(reference, rel=1e-12)
    assert result["model_flops_counted_as"] == "megatron-lm"
    seconds = result["iteration_time_ms"] / 1e3
    assert result["tflops_per_gpu"] == pytest.approx(reference / seconds / 4 / 1e12, rel=1e-12)
    assert result["mfu_peak_tflop_per_s"] == 989.0  # the H100 SXM datasheet's dense bf16 rate
    assert result["mfu_peak"] == "h100-sxm dense bf16 peak 989 TFLOP/s"
    assert result["mfu"] == pytest.approx(result["tflops_per_gpu"] / 989.0, rel=1e-12)
    table = run_cli("estimate", "--megatron-args", FLAGS, "--gpus", "4", "--gpu", "h100-sxm", check=True).stdout
    mfu_line = next(line for line in table.splitlines() if "MFU" in line)
    assert f"MFU {100 * result['mfu']:.1f}% of h100-sxm dense bf16 peak 989 TFLOP/s" in mfu_line
    assert "(Megatron-LM's FLOP count)" in mfu_line


def test_recompute_adds_hardware_flops_not_model_flops():
    model = ModelSpec(family="llama", num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                      seq_length=128, vocab_size=1000, dtype="bf16")
    cluster, training = get_cluster_preset("dgx-h100"), TrainingSpec(global_batch_size=8)
    plain = estimate(trace(model, ParallelPlan(tensor_parallel=2)), cluster=cluster, training=training)
    recomputed = estimate(trace(model, ParallelPlan(tensor_parallel=2, recompute="full")), cluster=cluster,
                          training=training)
    assert recomputed.model_flops_per_iteration == plain.model_flops_per_iteration
    work = lambda e: e.hardware_tflops_per_gpu * e.iteration_time_ms
    assert work(recomputed) > work(plain)
    # the flash-attention backward (2.5x its forward) and the norms, activations and softmax are in the
    # traced FLOPs only: they exceed Megatron's count even without recompute
    assert work(plain) > plain.tflops_per_gpu * plain.iteration_time_ms


@pytest.mark.parametrize(("preset", "precision", "words", "peak"), [
    ("dgx-h100", {"fp8": "hybrid"}, "h100-sxm dense fp8 peak 1,979 TFLOP/s", 1979.0),
    ("dgx-b200", {"fp8": "e4m3", "fp8_recipe": "mxfp8"}, "b200-sxm dense mxfp8 peak 4,500 TFLOP/s", 4500.0),
    ("dgx-b200", {"fp4": "e2m1"}, "b200-sxm dense nvfp4 peak 9,000 TFLOP/s", 9000.0),
])
def test_mfu_is_against_the_peak_of_the_gemms_precision(preset, precision, words, peak):
    """FP8 / MXFP8 / NVFP4 GEMMs: MFU against that precision's dense peak from the device data (the
    datasheet rates), named; the model FLOPs stay Megatron-LM's count."""
    model = ModelSpec(family="llama", num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=128,
                      vocab_size=1000, dtype="bf16")
    graph = trace(model, ParallelPlan())
    low = estimate(graph, cluster=get_cluster_preset(preset),
                   training=TrainingSpec(global_batch_size=8, software_stack="megatron_core_te", **precision))
    assert low.mfu_peak == words
    assert low.mfu_peak_tflop_per_s == peak
    assert low.mfu == pytest.approx(low.tflops_per_gpu / peak, rel=1e-12)
    assert low.model_flops_counted_as == "megatron-lm"
