"""The plan an estimate prints (``plan_document``) is a plan file: read back, it gives the same
ModelSpec, ParallelPlan and TrainingSpec, field for field, whatever non-default values they hold."""

import json
from dataclasses import fields

import pytest

from vtrain_plugin.specs.activation_offload import ActivationOffload
from vtrain_plugin.specs.fsdp import FsdpSettings
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.optimizer import OptimizerSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.plan_file import parse_plan, plan_document
from vtrain_plugin.specs.reliability import ReliabilitySpec
from vtrain_plugin.specs.training import TrainingSpec

DENSE = ModelSpec(family="llama", num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128,
                  vocab_size=1024, num_query_groups=4, name="tiny", qk_layernorm=True, rotary_percent=0.5)
MOE = ModelSpec(family="llama", num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128,
                vocab_size=1024, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128,
                moe_grouped_gemm=True, moe_expert_capacity_factor=1.25, moe_shared_expert_intermediate_size=256)
PLAN = ParallelPlan(tensor_parallel=2, pipeline_parallel=2, data_parallel=2, virtual_pipeline=2,
                    sequence_parallel=True, micro_batch_size=2, recompute="selective")

# (model, parallel, training): together they leave no TrainingSpec field at its default
SAMPLES = [
    (DENSE, PLAN, TrainingSpec(
        global_batch_size=16, schedule="interleaved_1f1b", grad_reduce="overlap", bucket_size_mb=20,
        software_stack="megatron_core_te", fp8="hybrid", fp8_recipe="tensorwise", fp8_bf16_layers_at_start=1,
        fp8_bf16_layers_at_end=1, fp8_param_gather=True, grad_reduce_in_bf16=True, cross_entropy_fusion=True,
        defer_embedding_wgrad=True, wgrad_deferral_limit=2,
        total_tokens=1e12, distributed_optimizer=True, overlap_param_gather=True, tp_comm_overlap=True,
        microbatch_group_size=2, reliability=None, deterministic=True, log_params_norm=True,
        log_num_zeros_in_grad=True, cuda_graph_impl="transformer_engine", cuda_graph_scope=("attn", "mlp"),
        cuda_graph_warmup_steps=0, nan_checks=False, per_token_loss=True, manual_gc=True, manual_gc_interval=50,
        optimizer=OptimizerSpec(kind="adam", precision_aware=True, exp_avg="bf16", exp_avg_sq="bf16"))),
    (MOE, ParallelPlan(tensor_parallel=1, data_parallel=8, expert_parallel=4), TrainingSpec(
        global_batch_size=16, fp4="e2m1", unfused_attention=True, gradient_accumulation_fusion=False,
        unfused_kernels=("bias_activation", "rope"),
        fsdp=FsdpSettings(implementation="megatron", sharding_strategy="optim_grads", double_buffer=True),
        activation_offload=ActivationOffload(modules=("core_attn", "attn_proj"), fraction=0.5),
        reliability=ReliabilitySpec(failures="reliable", checkpoint="async", restart_minutes=5.0))),
]


@pytest.mark.parametrize("model, parallel, training", SAMPLES)
def test_the_plan_document_reads_back_as_the_same_specs(model, parallel, training):
    document = json.loads(json.dumps(plan_document(model, parallel, training, {"gpu": "h100-sxm"})))
    read = parse_plan(document)
    for spec, back in ((model, read.model), (parallel, read.parallel), (training, read.training)):
        for f in fields(spec):
            assert getattr(back, f.name) == getattr(spec, f.name), f"{type(spec).__name__}.{f.name}"
    assert read.cluster == {"gpu": "h100-sxm"}


def test_the_samples_leave_no_training_field_at_its_default():
    """A field added to TrainingSpec later needs a sample value here, so that it round-trips too."""
    default = TrainingSpec(global_batch_size=1)
    single_valued = {"fp4_recipe"}  # Fp4Recipe has one member, nvfp4
    for f in fields(TrainingSpec):
        if f.name in single_valued:
            continue
        assert any(getattr(t, f.name) != getattr(default, f.name) for _, _, t in SAMPLES), f.name
