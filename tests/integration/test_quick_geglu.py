"""GPT-OSS's quick GeGLU (``quick_gelu`` gated, a linear offset, a clamp) on real traces: the
traced ops, the fused kernels the experts lower to, the direction the estimate moves; the same
model from Megatron-LM flags and from a TransformerConfig."""

import dataclasses
from collections import Counter

import pytest

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import OpNode, Phase
from vtrain_plugin.cost.lowering.megatron_core_te import megatron_core_te
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.megatron.args import megatron_plan
from vtrain_plugin.specs.megatron.launch_script import read_command_line
from vtrain_plugin.specs.model import Activation, ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import SoftwareStack, TrainingSpec

T, F = 64, 128  # tokens (seq 64, micro-batch 1, top-1 of 2 experts balanced: 32 per expert), expert FFN
SWIGLU = ModelSpec(family="llama", num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=256,
                   seq_length=T, vocab_size=256, dtype="bf16", num_experts=2, moe_router_topk=1, moe_ffn_hidden_size=F)
QUICK = dataclasses.replace(SWIGLU, activation="quick_gelu", glu_linear_offset=1.0, activation_func_clamp_value=7.0)
TRAINING = TrainingSpec(global_batch_size=8, software_stack=SoftwareStack.MEGATRON_CORE_TE)


def expert(model: ModelSpec, phase: Phase, lowered: bool) -> list[str]:
    layer = trace(model, ParallelPlan()).stage(0).layer_template()
    nodes = megatron_core_te(layer.nodes) if lowered else layer.nodes
    return [n.op.split(".")[1] for n in nodes if isinstance(n, OpNode) and n.launches_kernel and n.phase is phase
            and n.module.endswith("local_experts.0")]


def test_the_traced_expert_clamps_both_halves_and_offsets_the_linear_one():
    assert expert(QUICK, Phase.FORWARD, lowered=False) == ["clamp", "clamp", "mul", "sigmoid", "mul", "add", "mul",
                                                           "mul"]  # the last: the routing probabilities


def test_experts_lower_to_megatron_cores_fused_quick_geglu():
    assert expert(QUICK, Phase.FORWARD, lowered=True) == ["clamp", "clamp", "cat", "quick_geglu_fused", "mul"]
    backward = expert(QUICK, Phase.BACKWARD, lowered=True)
    assert backward.count("quick_geglu_fused_backward") == 1 and "sigmoid_backward" not in backward
    unclamped = dataclasses.replace(QUICK, activation_func_clamp_value=None)
    assert expert(unclamped, Phase.FORWARD, lowered=True) == ["quick_geglu_fused", "mul"]


def test_quick_geglu_keeps_the_gemms_and_changes_the_elementwise_kernels():
    def kernels(model):
        layer = trace(model, ParallelPlan()).stage(0).layer_template()
        return Counter((n.op, n.key.input_shapes) for n in megatron_core_te(layer.nodes)
                       if isinstance(n, OpNode) and n.op in ("aten.mm.default", "te.grouped_gemm.default"))

    assert kernels(QUICK) == kernels(SWIGLU)
    cluster = get_cluster_preset("dgx-h100")
    swiglu = estimate(trace(SWIGLU, ParallelPlan()), cluster=cluster, training=TRAINING)
    quick = estimate(trace(QUICK, ParallelPlan()), cluster=cluster, training=TRAINING)
    assert quick.iteration_time_ms > swiglu.iteration_time_ms  # the clamps, their masks and the cat


def test_flags_and_transformer_config_give_the_same_model():
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_adapters.config_map import layer_fields

    flags = ("python pretrain_gpt.py --num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 64 "
             "--micro-batch-size 1 --vocab-size 256 --bf16 --quick-geglu --glu-linear-offset 1.0 "
             "--activation-func-clamp-value 7.0 --disable-bias-linear --normalization RMSNorm")
    model = megatron_plan(read_command_line(flags), gpus=1).model
    assert (model.layer.activation, model.layer.gated_linear_unit, model.glu_linear_offset,
            model.activation_func_clamp_value) == (Activation.QUICK_GELU, True, 1.0, 7.0)
    config = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4, activation_func=quick_gelu,
                               gated_linear_unit=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0,
                               bias_activation_fusion=False)
    fields = layer_fields(config)
    assert (fields["activation"], fields["glu_linear_offset"], fields["activation_func_clamp_value"]) == \
        ("quick_gelu", 1.0, 7.0)


@pytest.mark.parametrize("fields, message", [
    (dict(glu_linear_offset=1.0), "model.glu_linear_offset needs model.gated_linear_unit (it acts on the gated "
                                  "unit's halves)"),
    (dict(gated_linear_unit=True, activation_func_clamp_value=-1.0),
     "model.activation_func_clamp_value must be positive and finite, got -1.0"),
])
def test_glu_extras_refusals(fields, message):
    with pytest.raises(ConfigError) as exc:
        ModelSpec(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64, **fields)
    assert str(exc.value) == message
