"""The mapping of traced megatron-core local-spec ops onto Megatron-DeepSpeed 2023 and megatron-core
local-spec kernels, pinned on a small real GPT layer (traced once per module), and the choice of a
plan's software stack."""

from __future__ import annotations

import math

import pytest

from vtrain_plugin.runs import run_config_from_dict
from vtrain_plugin.cost.lowering.stacks import map_nodes, register_stack
from vtrain_plugin.cost.lowering.megatron_deepspeed import MULTI_TENSOR_PASSES
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import OpNode, Phase
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import SoftwareStack, TrainingSpec

H, HEADS, S, MB, TP = 64, 4, 32, 2, 2
SCORES = MB * HEADS // TP * S * S  # elements of one attention-score tensor on one TP rank
TOKENS = S * MB
MDS = SoftwareStack.MEGATRON_DEEPSPEED_2023
MCL = SoftwareStack.MEGATRON_CORE_LOCAL


@pytest.fixture(scope="module")
def layer():
    from vtrain_plugin.capture.tracer import trace

    model = ModelSpec(num_layers=2, hidden_size=H, num_attention_heads=HEADS, seq_length=S, vocab_size=256)
    graph = trace(model, ParallelPlan(tensor_parallel=TP, micro_batch_size=MB, recompute="full"))
    return graph.stages[0].layer_template()


def ops(nodes, phase=None, module_suffix=""):
    return [n for n in nodes if isinstance(n, OpNode) and n.launches_kernel and (phase is None or n.phase is phase)
            and n.module.endswith(module_suffix)]


def names(nodes):
    return [n.op for n in nodes]


@pytest.mark.parametrize("phase", [Phase.FORWARD, Phase.RECOMPUTE])
def test_scale_mask_softmax_forward_is_one_fused_fp16_kernel(layer, phase):
    traced = ops(layer.nodes, phase, "scale_mask_softmax")
    assert [op.split(".")[1] for op in names(traced)] == ["_to_copy", "masked_fill_", "_softmax", "_to_copy"]
    mapped = ops(map_nodes(layer.nodes, MDS), phase, "scale_mask_softmax")
    assert names(mapped) == ["megatron.scaled_upper_triang_masked_softmax.default"]
    assert mapped[0].nbytes == 4 * SCORES  # fp16 scores in, fp16 probabilities out
    assert mapped[0].key.dtypes == ("float16",) and mapped[0].key.input_shapes == ((MB, HEADS // TP, S, S),)


def test_scale_mask_softmax_backward_is_one_fused_kernel(layer):
    mapped = ops(map_nodes(layer.nodes, MDS), Phase.BACKWARD, "scale_mask_softmax")
    assert names(mapped) == ["megatron.scaled_upper_triang_masked_softmax_backward.default"]
    assert mapped[0].nbytes == 6 * SCORES


def test_attention_dropout_is_native_dropout(layer):
    mapped = map_nodes(layer.nodes, MDS)
    forward = ops(mapped, Phase.FORWARD, "attention_dropout")
    backward = ops(mapped, Phase.BACKWARD, "attention_dropout")
    assert names(forward) == ["aten.native_dropout.default"] and forward[0].nbytes == 5 * SCORES
    assert names(backward) == ["aten.native_dropout_backward.default"] and backward[0].nbytes == 5 * SCORES


def test_bias_dropout_add_and_bias_gelu_are_fused(layer):
    mapped = map_nodes(layer.nodes, MDS)
    root = [n for n in ops(mapped, Phase.FORWARD) if n.module == layer.name]
    assert names(root) == ["megatron.bias_dropout_add_fused_train.default"] * 2
    assert all(n.nbytes == 7 * TOKENS * H + 2 * H for n in root)
    mlp = [n for n in ops(mapped, Phase.FORWARD) if n.module == f"{layer.name}.mlp"]
    assert names(mlp) == ["megatron.bias_gelu_fused.default"]
    assert mlp[0].nbytes == 4 * TOKENS * 4 * H // TP + 2 * 4 * H // TP
    backward_root = [n.op for n in ops(mapped, Phase.BACKWARD) if n.module == layer.name]
    assert backward_root == ["megatron.bias_dropout_add_fused_train_backward.default", "aten.sum.dim_IntList"] * 2


def test_layer_norm_is_apex_with_the_traced_bytes(layer):
    traced = [n for n in ops(layer.nodes) if "layer_norm" in n.op]
    mapped = [n for n in ops(map_nodes(layer.nodes, MDS)) if "layer_norm" in n.op]
    assert len(mapped) == len(traced) == 6  # two norms: forward, recompute, backward
    assert {n.op for n in mapped} == {"apex.fused_layer_norm_affine.default",
                                      "apex.fused_layer_norm_affine_backward.default"}
    assert [n.nbytes for n in mapped] == [n.nbytes for n in traced]


def test_gemms_and_tp_collectives_are_untouched(layer):
    def gemms(nodes):
        return [(n.op, n.key.input_shapes, n.phase) for n in ops(nodes) if n.op.split(".")[1] in ("mm", "bmm", "baddbmm")]

    mapped = map_nodes(layer.nodes, MDS)
    assert gemms(mapped) == gemms(layer.nodes)
    assert [n for n in mapped if not isinstance(n, OpNode)] == [n for n in layer.nodes if not isinstance(n, OpNode)]


def test_optimizer_is_grad_copies_then_five_multi_tensor_kernels(layer):
    traced = ops(layer.nodes, Phase.OPTIMIZER)
    copies = [n for n in traced if n.op == "aten._to_copy.default"]
    numel = sum(math.prod(n.key.input_shapes[0]) for n in copies)
    assert len(copies) == 12  # weights and biases of qkv, proj, fc1, fc2 and the two norms
    # per parameter (training_step.py): cast, unscale, norm, add to the squared total, clip, decay,
    # first moment (lerp_), second moment (mul_, addcmul_), sqrt, bias correction, eps, update, copy back
    assert len(traced) == 14 * len(copies)
    mapped = ops(map_nodes(layer.nodes, MDS), Phase.OPTIMIZER)
    assert mapped[:12] == copies
    assert names(mapped[12:]) == [f"apex.{name}.default" for name, _ in MULTI_TENSOR_PASSES]
    assert sum(n.nbytes for n in mapped[12:]) == 54 * numel
    assert sum(per_param for _, per_param in MULTI_TENSOR_PASSES) + 6 == 60  # with the fp16->fp32 copy


def test_megatron_core_local_runs_megatron_kernels_and_megatron_cores_optimizer(layer):
    """The local spec's layers run the 2023 stack's fused kernels; its fp16 optimizer step is
    megatron-core's five multi-tensor passes (unscale 8, norm 4, clip 8, Adam 28, copy 6 bytes per
    parameter), without the 2023 stack's per-parameter gradient copies."""
    local = map_nodes(layer.nodes, MCL)
    for phase in (Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE):
        assert ops(local, phase) == ops(map_nodes(layer.nodes, MDS), phase)
    copies = [n for n in ops(layer.nodes, Phase.OPTIMIZER) if n.op == "aten._to_copy.default"]
    numel = sum(math.prod(n.key.input_shapes[0]) for n in copies)
    mapped = ops(local, Phase.OPTIMIZER)
    assert names(mapped) == [f"te.multi_tensor_{name}.default" for name in ("unscale", "l2norm", "scale", "adam", "copy")]
    assert sum(n.nbytes for n in mapped) == 54 * numel


def test_a_local_spec_command_line_picks_megatron_core_local():
    """``--transformer-impl local`` is megatron-core's local spec, priced with its own stack (and host
    costs); the legacy model stays on Megatron-DeepSpeed's, TransformerEngine on its own."""
    from vtrain_plugin.runs import run_config_from_megatron_args

    flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
             "--micro-batch-size 2 --global-batch-size 16 --vocab-size 128 --bf16")
    for extra, stack in (("--transformer-impl local", MCL), ("--use-legacy-models", MDS), ("", TE)):
        run = run_config_from_megatron_args(f"{flags} {extra}", gpus=8)
        assert run.training.stack_for(run.model, "hopper") is stack, extra


def test_local_spec_is_the_identity(layer):
    assert map_nodes(layer.nodes, "local_spec") == layer.nodes


def test_unknown_and_duplicate_stacks_are_rejected():
    with pytest.raises(ConfigError, match=r"unknown software stack 'apex'; valid stacks are local_spec, "
                                          r"megatron_core_local, megatron_core_te, megatron_deepspeed_2023"):
        map_nodes((), "apex")
    with pytest.raises(ConfigError, match="software stack 'local_spec' is already registered"):
        register_stack(SoftwareStack.LOCAL_SPEC)(lambda nodes: tuple(nodes))


TE = SoftwareStack.MEGATRON_CORE_TE
GPT = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128)


@pytest.mark.parametrize("family, dtype, architecture, stack", [
    ("gpt", "fp16", "ampere", MDS),  # the vTrain A100 world
    ("gpt", "bf16", "ampere", TE), ("gpt", "fp32", "ampere", TE), ("llama", "fp16", "ampere", TE),
    ("gpt", "fp16", "hopper", TE), ("llama", "bf16", "hopper", TE), ("gpt", "fp16", "blackwell", TE),
    ("gpt", "fp16", "cpu", SoftwareStack.LOCAL_SPEC), ("llama", "bf16", "cpu", SoftwareStack.LOCAL_SPEC),
])
def test_default_stack_depends_on_the_model_family_dtype_and_gpu_generation(family, dtype, architecture, stack):
    plain = TrainingSpec(global_batch_size=8)
    assert plain.software_stack is None
    assert plain.stack_for(ModelSpec(**GPT, family=family, dtype=dtype), architecture) is stack


def test_stack_given_wins_fp8_defaults_to_te_and_a_plain_module_runs_the_local_spec():
    assert TrainingSpec(global_batch_size=8).stack_for(None, "hopper") is SoftwareStack.LOCAL_SPEC
    assert TrainingSpec(global_batch_size=8, software_stack="local_spec").stack_for(ModelSpec(**GPT), "ampere") is \
        SoftwareStack.LOCAL_SPEC
    assert TrainingSpec(global_batch_size=8, fp8="hybrid").stack_for(ModelSpec(**GPT), "ampere") is TE
    with pytest.raises(ConfigError, match="training.software_stack must be one of"):
        TrainingSpec(global_batch_size=8, software_stack="te")
    with pytest.raises(ConfigError, match="^training.fp8 'e4m3' needs training.software_stack megatron_core_te "
                                          r"\(got megatron_deepspeed_2023\)$"):
        TrainingSpec(global_batch_size=8, software_stack=MDS, fp8="e4m3")
    with pytest.raises(ConfigError, match="^training.fp8 must be one of hybrid, e4m3; got 'e5m2'$"):
        TrainingSpec(global_batch_size=8, fp8="e5m2")
    with pytest.raises(ConfigError, match="^training.fp8_recipe must be one of delayed, tensorwise, mxfp8, "
                                          "blockwise; got 'custom'$"):
        TrainingSpec(global_batch_size=8, fp8="hybrid", fp8_recipe="custom")
    with pytest.raises(ConfigError, match="^training.fp4 'e2m1' with training.fp8 'hybrid': FP4 and FP8 GEMMs "):
        TrainingSpec(global_batch_size=8, fp8="hybrid", fp4="e2m1")


def test_vtrain_configs_use_megatron_deepspeed():
    run = run_config_from_dict({
        "num_gpus": 2, "tensor_parallel_size": 2, "data_parallel_size": 1, "pipeline_parallel_size": 1,
        "global_batch_size": 4, "micro_batch_size": 2, "num_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "max_length": 32})
    assert run.training.software_stack is MDS
    assert run.training.to_dict()["software_stack"] == "megatron_deepspeed_2023"
    assert run.training.to_dict()["fp8"] is None
