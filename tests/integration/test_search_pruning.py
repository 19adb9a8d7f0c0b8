"""A search prunes by memory before it traces: the floor never exceeds the peak the full memory model
gives any plan, so no plan that fits is ever pruned; pruned plans are counted, not traced."""

from dataclasses import replace

import pytest

from vtrain_plugin.cost.memory import activation_floor_nbytes, memory_floor_gib
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.planning.evaluate import evaluate
from vtrain_plugin.planning.search import MEMORY_RULE, search
from vtrain_plugin.planning.space import GpuBudget, SearchSpace, enumerate_plans
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.optimizer import OptimizerSpec
from vtrain_plugin.specs.training import TrainingSpec

CLUSTER = get_cluster_preset("dgx-a100")
DENSE = ModelSpec(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1024)
UNTIED_BF16 = replace(DENSE, family="llama", dtype="bf16", num_query_groups=2)
MOE = ModelSpec(family="llama", num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                seq_length=128, vocab_size=1024, dtype="bf16", num_experts=4, moe_router_topk=2,
                moe_ffn_hidden_size=192)
# Every axis that changes model states (TP, PP, VP, DP, EP, the distributed optimizer); the activations
# only add to the peak, so one micro-batch size and the fewest saved (full recompute, no SP) suffice.
SPACE = SearchSpace(tensor_parallel=(1, 2), pipeline_parallel=(1, 2), micro_batch_size=(1,),
                    sequence_parallel=(False,), recompute=("full",), grad_reduce=("after_backward",))
MOE_SPACE = replace(SPACE, sequence_parallel=(True, False))  # MoE with TP needs SP
HYBRID = ModelSpec(num_layers=6, hidden_size=256, num_attention_heads=4, seq_length=256, vocab_size=1024, dtype="bf16",
                   hybrid_layer_pattern="M*-M-M", mamba_state_dim=16, mamba_head_dim=32, mamba_num_groups=2)
# Every axis that changes the activations held: TP with and without SP, recompute, the schedule (PP 2
# with and without VP), the software stack (what TE saves instead of the traced ops), at one micro-batch
# size (the floor and the trace are affine in it: capture/rescale.py); the global batch leaves a few
# micro-batches so that PP - rank of them are in flight.
ACTIVATION_SPACE = SearchSpace(tensor_parallel=(2,), pipeline_parallel=(2,), micro_batch_size=(2,),
                               grad_reduce=("after_backward",),
                               software_stack=("megatron_core_te", "megatron_deepspeed_2023"))


@pytest.mark.parametrize("model,space,optimizer", [
    (DENSE, SPACE, OptimizerSpec()),
    (UNTIED_BF16, SPACE, OptimizerSpec(kind="muon")),
    (MOE, MOE_SPACE, OptimizerSpec()),
], ids=["gpt-fp16", "llama-bf16-muon", "moe-bf16"])
def test_the_floor_is_below_the_peak_of_every_plan_of_a_small_space(model, space, optimizer):
    training = TrainingSpec(global_batch_size=8, optimizer=optimizer)
    candidates = enumerate_plans(model, space, global_batch_size=8, budget=GpuBudget.parse("1,2,4"),
                                 training=training, gpus_per_node=8).candidates
    assert len(candidates) >= 12
    for candidate in candidates:
        floor = memory_floor_gib(model, candidate.parallel, candidate.training)
        peak = evaluate(model, candidate, CLUSTER).peak_memory_gib
        assert floor is not None and floor <= peak, (candidate.parallel, candidate.training.distributed_optimizer)


@pytest.mark.parametrize("model", [DENSE, UNTIED_BF16, MOE, HYBRID], ids=["gpt-fp16", "llama-bf16", "moe-bf16", "hybrid-bf16"])
def test_the_activation_floor_is_below_the_peak_of_every_plan(model):
    training = TrainingSpec(global_batch_size=16)
    candidates = enumerate_plans(model, ACTIVATION_SPACE, global_batch_size=16, budget=GpuBudget.parse("2,4"),
                                 training=training, gpus_per_node=8).candidates
    assert len(candidates) >= 8, len(candidates)
    for candidate in candidates:
        plan = candidate.parallel
        floor = memory_floor_gib(model, plan, candidate.training)
        ranks = evaluate(model, candidate, CLUSTER).memory_gib
        activations = activation_floor_nbytes(model, plan, candidate.training)
        where = (plan, candidate.training.software_stack.value)
        assert floor is not None and floor <= max(rank.total_gib for rank in ranks), where
        for rank, held in zip(ranks, activations, strict=True):
            assert 0 < held <= rank.activations_gib * 2**30, where


def test_the_floor_of_one_unsplit_gpu_is_the_model_states_of_every_parameter_and_each_layers_input():
    training = TrainingSpec(global_batch_size=8)
    plan = enumerate_plans(DENSE, replace(SPACE, tensor_parallel=(1,), pipeline_parallel=(1,)), global_batch_size=8,
                           budget=GpuBudget.parse("1"), training=training, gpus_per_node=8).candidates[0].parallel
    # fp16: 2 bytes of weight, 2 of gradient (Megatron's default for fp16), 12 of fp32 main weight and
    # moments; each of the 4 layers keeps its 128 x 1 x 256 fp16 input under full recompute
    assert activation_floor_nbytes(DENSE, plan, training) == (4 * 128 * 256 * 2,)
    tensors = (DENSE.num_parameters * 16 + 4 * 128 * 256 * 2) / 2**30
    assert memory_floor_gib(DENSE, plan, training) == pytest.approx(tensors * 1.05 + 2.0, rel=1e-12)


def test_no_floor_where_weights_are_sharded_or_quantised():
    plan = enumerate_plans(DENSE, SPACE, global_batch_size=8, budget=GpuBudget.parse("2"),
                           training=TrainingSpec(global_batch_size=8), gpus_per_node=8).candidates[0].parallel
    assert memory_floor_gib(DENSE, plan, TrainingSpec(global_batch_size=8, fsdp={})) is None
    assert memory_floor_gib(DENSE, plan, TrainingSpec(global_batch_size=8, fp8="hybrid",
                                                      software_stack="megatron_core_te")) is None


def test_plans_whose_model_states_exceed_the_gpu_are_counted_and_never_traced(monkeypatch):
    # 32B parameters on one or two 80 GiB GPUs: 18 bytes each is 540 GiB, well above
    big = ModelSpec(num_layers=40, hidden_size=8192, num_attention_heads=64, seq_length=512, vocab_size=32000)

    def no_trace(*args, **kwargs):
        raise AssertionError("a pruned plan was traced")

    monkeypatch.setattr("vtrain_plugin.planning.evaluate.trace", no_trace)
    result = search(big, cluster=CLUSTER, global_batch_size=8, gpus="1,2", workers=1,
                    space=SearchSpace(tensor_parallel=(1, 2), pipeline_parallel=(1,)))
    assert result.table.empty
    assert result.skipped[MEMORY_RULE] > 0
