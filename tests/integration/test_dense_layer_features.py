"""The dense layer features of issue 30 on real traces of megatron-core: QK norms, kv_channels,
squared ReLU, partial rotary, layernorm-1p. Per feature, the TE kernels its trace lowers to, and
the direction the estimate moves when it is switched on; and one Qwen3-like model read from
Megatron-LM flags, a TransformerConfig and a plan file gives one estimate."""

import dataclasses

import pytest
import torch

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.graph import OpNode, Phase
from vtrain_plugin.cost.lowering.megatron_core_te import megatron_core_te
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.megatron.args import megatron_plan
from vtrain_plugin.specs.megatron.launch_script import launch_command
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.plan_file import parse_plan
from vtrain_plugin.specs.training import SoftwareStack, TrainingSpec

S, B = 64, 1
LLAMA = ModelSpec(family="llama", num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=256, seq_length=S, vocab_size=256, dtype="bf16")
# Ablations on a model large enough that its kernels, not their launches, set the time (a small
# model is host-bound: its time is its kernel count); tracing costs the same.
BIG = dict(hidden_size=8192, num_attention_heads=64, ffn_hidden_size=28672, seq_length=4096, num_query_groups=8)
TP2 = ParallelPlan(tensor_parallel=2, sequence_parallel=True)
TRAINING = TrainingSpec(global_batch_size=8, software_stack=SoftwareStack.MEGATRON_CORE_TE)
CLUSTER = get_cluster_preset("dgx-h100")


def layer_kernels(model: ModelSpec, plan: ParallelPlan, phase: Phase, module: str = "") -> list[tuple]:
    """(module leaf, kernel, input shapes) of one layer's lowered kernels in ``phase``."""
    graph = trace(model, plan)
    layer = next(b for s in graph.stages for b in s.blocks if b.kind.value == "layer")
    return [(n.module.split("layers.0.")[-1], n.op, n.key.input_shapes) for n in megatron_core_te(layer.nodes)
            if isinstance(n, OpNode) and n.phase is phase and module in n.module]


def run(model: ModelSpec, plan: ParallelPlan = TP2):
    """The estimate of ``model`` scaled up to :data:`BIG`'s dimensions."""
    big = dataclasses.replace(model, **{k: v for k, v in BIG.items() if k != "num_query_groups" or model.num_query_groups})
    return estimate(trace(big, plan), cluster=CLUSTER, training=TRAINING)


@pytest.mark.parametrize("rms", [True, False])
def test_qk_layernorm_adds_one_te_norm_per_tensor_and_head(rms):
    model = LLAMA if rms else dataclasses.replace(LLAMA, normalization="LayerNorm")
    on = dataclasses.replace(model, qk_layernorm=True)
    kernel = "te.rms_norm" if rms else "te.layer_norm"
    heads, groups, d = 4 // 2, 2 // 2, 128 // 4  # per TP rank
    forward = layer_kernels(on, TP2, Phase.FORWARD, "self_attention.")
    forward = [k for k in forward if k[0].endswith("_layernorm")]
    assert [(leaf, op, shapes[0]) for leaf, op, shapes in forward] == [
        ("self_attention.q_layernorm", f"{kernel}.default", (S, B, heads, d)),
        ("self_attention.k_layernorm", f"{kernel}.default", (S, B, groups, d))]
    backward = [k[:2] for k in layer_kernels(on, TP2, Phase.BACKWARD, "k_layernorm")]
    assert backward == [("self_attention.k_layernorm", f"{kernel}_backward.default")]
    off = layer_kernels(model, TP2, Phase.FORWARD)
    assert len(layer_kernels(on, TP2, Phase.FORWARD)) == len(off) + 2


def test_qk_l2_norm_is_one_compiled_kernel_per_tensor_and_direction():
    on = dataclasses.replace(LLAMA, qk_l2_norm=True)
    forward = [(k[0], k[1], k[2][0]) for k in layer_kernels(on, TP2, Phase.FORWARD, "k_layernorm")
               + layer_kernels(on, TP2, Phase.FORWARD, "q_layernorm")]
    assert forward == [("self_attention.k_layernorm", "megatron.l2_norm_fused.default", (S, B, 1, 32)),
                       ("self_attention.q_layernorm", "megatron.l2_norm_fused.default", (S, B, 2, 32))]
    backward = [k[1] for k in layer_kernels(on, TP2, Phase.BACKWARD, "self_attention.") if "_layernorm" in k[0]]
    assert backward == ["megatron.l2_norm_fused_backward.default"] * 2


def test_qk_norms_add_time_and_memory():
    off = run(LLAMA)
    for feature in ("qk_layernorm", "qk_l2_norm"):
        on = run(dataclasses.replace(LLAMA, **{feature: True}))
        assert on.breakdown_ms["forward"] > off.breakdown_ms["forward"], feature
        assert on.breakdown_ms["backward"] > off.breakdown_ms["backward"], feature
        assert on.memory_gib[0].activations_gib > off.memory_gib[0].activations_gib, feature


def test_kv_channels_shape_the_qkv_and_projection_gemms_and_the_attention():
    wide = dataclasses.replace(LLAMA, kv_channels=64)  # heads x kv_channels = 256 != hidden 128
    kernels = layer_kernels(wide, ParallelPlan(tensor_parallel=2), Phase.FORWARD)
    shapes = {leaf: s for leaf, op, s in kernels if op in ("aten.mm.default", "te.fused_attention.default")}
    heads, groups = 2, 1  # per TP rank
    assert shapes["self_attention.linear_qkv"][1] == (128, (heads + 2 * groups) * 64)
    assert shapes["self_attention.linear_proj"][1] == (heads * 64, 128)
    assert shapes["self_attention.core_attention"][0] == (S, B, heads, 64)
    narrow, default = run(dataclasses.replace(LLAMA, kv_channels=64)), run(LLAMA)  # BIG's: 8192 / 64 = 128
    widened = run(dataclasses.replace(LLAMA, kv_channels=256))
    assert narrow.breakdown_ms["forward"] < default.breakdown_ms["forward"] < widened.breakdown_ms["forward"]
    assert narrow.tflops_per_gpu * narrow.iteration_time_ms < default.tflops_per_gpu * default.iteration_time_ms


def test_squared_relu_runs_unfused_and_costs_more_than_gelu():
    gelu = ModelSpec(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512, seq_length=S,
                     vocab_size=256, dtype="bf16", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)
    relu2 = dataclasses.replace(gelu, activation="squared_relu")
    plan = ParallelPlan()
    assert [k[1:] for k in layer_kernels(relu2, plan, Phase.FORWARD, "layers.0.mlp") if k[0] == "mlp"] == [
        ("aten.relu.default", ((S, B, 512),)), ("aten.pow.Tensor_Scalar", ((S, B, 512),))]
    assert [k[1] for k in layer_kernels(relu2, plan, Phase.BACKWARD, "layers.0.mlp") if k[0] == "mlp"] == [
        "aten.pow.Tensor_Scalar", "aten.mul.Scalar", "aten.mul.Tensor", "aten.threshold_backward.default"]
    slow, fast = run(relu2, plan), run(gelu, plan)
    assert slow.breakdown_ms["forward"] > fast.breakdown_ms["forward"]
    assert slow.breakdown_ms["backward"] > fast.breakdown_ms["backward"]
    assert slow.tflops_per_gpu * slow.iteration_time_ms == pytest.approx(fast.tflops_per_gpu * fast.iteration_time_ms)


def test_partial_rotary_is_one_fused_kernel_over_the_whole_head():
    half = dataclasses.replace(LLAMA, rotary_percent=0.5)
    queries, keys = ((S, B, 2, 32), (S, 1, 1, 16)), ((S, B, 1, 32), (S, 1, 1, 16))  # whole heads, 16 rotated
    for phase, kernel, order in ((Phase.FORWARD, "te.fused_rope.default", [queries, keys]),
                                 (Phase.BACKWARD, "te.fused_rope_backward.default", [keys, queries])):
        assert [k[2] for k in layer_kernels(half, TP2, phase) if k[1] == kernel] == order


def test_layernorm_1p_changes_neither_time_nor_memory():
    plain = ModelSpec(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=S, vocab_size=256, dtype="bf16")
    one_p = run(dataclasses.replace(plain, layernorm_zero_centered_gamma=True))
    assert one_p.to_dict() == run(plain).to_dict()


QWEN_FLAGS = ("--num-layers 2 --hidden-size 128 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
              "--kv-channels 64 --qk-layernorm --ffn-hidden-size 384 --swiglu --normalization RMSNorm "
              "--disable-bias-linear --position-embedding-type rope --attention-dropout 0.0 --hidden-dropout 0.0 "
              "--untie-embeddings-and-output-weights --seq-length 64 --vocab-size 256 --bf16 "
              "--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 1 --global-batch-size 8")
QWEN_PLAN = {"model": {"family": "llama", "num_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
                       "num_query_groups": 2, "kv_channels": 64, "qk_layernorm": True, "ffn_hidden_size": 384,
                       "seq_length": 64, "vocab_size": 256, "dtype": "bf16"},
             "parallel": {"tensor_parallel": 2, "sequence_parallel": True, "data_parallel": 4},
             "training": {"global_batch_size": 8, "software_stack": "megatron_core_te"}}


def test_a_qwen3_like_model_gets_one_estimate_on_every_input_path():
    from megatron.core.transformer.transformer_config import TransformerConfig

    flags = megatron_plan(launch_command(QWEN_FLAGS.split()), gpus=8)
    plan_file = parse_plan(QWEN_PLAN)
    config = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                               kv_channels=64, qk_layernorm=True, ffn_hidden_size=384, gated_linear_unit=True,
                               activation_func=torch.nn.functional.silu, normalization="RMSNorm",
                               add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, bf16=True,
                               tensor_model_parallel_size=2, sequence_parallel=True)
    from_config = trace(config, dataclasses.replace(flags.parallel), vocab_size=256, seq_length=64)
    # tying spelled out (False on the command line, the llama family's None elsewhere: a bare config
    # does not say, and a gated layer's embeddings are untied)
    models = [dataclasses.replace(m, tied_embeddings=m.tied) for m in (flags.model, plan_file.model, from_config.model)]
    assert models[0] == models[1] == models[2]
    assert (models[0].head_dim, models[0].qk_layernorm, models[0].tied) == (64, True, False)
    assert flags.parallel == plan_file.parallel
    cluster, training = CLUSTER, plan_file.training
    results = [estimate(trace(flags.model, flags.parallel), cluster=cluster, training=training),
               estimate(trace(plan_file.model, plan_file.parallel), cluster=cluster, training=training),
               estimate(from_config, cluster=cluster, training=training)]
    assert results[0].to_dict() == results[1].to_dict() == results[2].to_dict()
    assert flags.training.software_stack is training.software_stack
