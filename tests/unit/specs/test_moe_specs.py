"""MoE fields of the specs, the routing assumption's counts, expert group placement, the EP search axis."""

import numpy as np
import pytest

from megatron_adapters.moe_routing import DispatchCounts, expert_token_counts
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import CollectiveKind, ParallelGroup
from vtrain_plugin.cost.comm.collectives import CommModel
from vtrain_plugin.cost.comm.topology import GroupPlacement, Layout
from vtrain_plugin.planning.space import GpuBudget, SearchSpace, enumerate_plans
from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

MIXTRAL = ModelSpec(name="mixtral-8x7b", family="llama", num_layers=32, hidden_size=4096, num_attention_heads=32,
                    num_query_groups=8, ffn_hidden_size=14336, seq_length=4096, vocab_size=32000, dtype="bf16",
                    num_experts=8, moe_router_topk=2)


def moe(**kw):
    base = dict(family="llama", num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=256, num_experts=8)
    return ModelSpec(**{**base, **kw})


# -- model fields ------------------------------------------------------------------------------------

def test_mixtral_parameter_count_is_46_7_billion():
    h, f, e, kv = 4096, 14336, 8, 2 * 8 * 128
    layer = h * (h + kv) + h * h + e * h + e * (3 * h * f) + 2 * h
    assert MIXTRAL.num_parameters == 32 * layer + 2 * 32000 * h + h == 46_702_792_704
    assert MIXTRAL.router_topk == 2 and MIXTRAL.expert_ffn_size == 14336


@pytest.mark.parametrize("kw, message", [
    (dict(num_experts=4, moe_router_topk=8), "model.moe_router_topk (8) must not exceed model.num_experts (4)"),
    (dict(num_experts=None, moe_router_topk=2), "model.moe_router_topk needs model.num_experts"),
    (dict(num_experts=None, moe_routing_skew=2.0), "model.moe_routing_skew needs model.num_experts"),
    (dict(moe_routing_skew=5.0), "model.moe_routing_skew (5) must lie in [1, num_experts / moe_router_topk "
                                 "= 8 / 2 = 4]"),
    (dict(moe_routing_skew=0.5), "model.moe_routing_skew (0.5) must lie in [1,"),
    (dict(num_experts=0), "model.num_experts must be positive, got 0"),
    (dict(num_experts=None, moe_shared_expert_intermediate_size=1024),
     "model.moe_shared_expert_intermediate_size needs model.num_experts"),
    (dict(moe_shared_expert_overlap=True), "model.moe_shared_expert_overlap needs "
                                          "model.moe_shared_expert_intermediate_size"),
    (dict(moe_layer_freq=(0, 1, 1)), "model.moe_layer_freq: a per-layer pattern needs model.num_layers (4) entries"),
    (dict(moe_layer_freq=(0, 0, 0, 0)), "the pattern has no MoE layer"),
    (dict(moe_layer_freq=0), "model.moe_layer_freq must be a positive integer or a list of 0 / 1 per layer"),
    (dict(moe_router_score_function="tanh"), "model.moe_router_score_function must be one of"),
    (dict(moe_router_enable_expert_bias=True), "model.moe_router_enable_expert_bias needs "
                                               "model.moe_router_score_function sigmoid"),
    (dict(moe_router_num_groups=4), "model.moe_router_num_groups and model.moe_router_group_topk go together"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "model.moe_router_num_groups (3) must divide "
                                                             "model.num_experts (8)"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=1, moe_router_topk=4),
     "model.moe_router_topk (4) must not exceed moe_router_group_topk (1) x experts per group (2) = 2"),
    (dict(moe_pad_expert_input_to_capacity=True), "model.moe_pad_expert_input_to_capacity needs "
                                                  "model.moe_expert_capacity_factor"),
    (dict(moe_expert_capacity_factor=0.0), "model.moe_expert_capacity_factor"),
    (dict(moe_expert_capacity_factor=1.0, moe_routing_skew=2.0), "vtrain assumes balanced routing under a capacity"),
    (dict(moe_router_load_balancing_type="none"),
     "model.moe_router_load_balancing_type must be one of aux_loss, seq_aux_loss, global_aux_loss, sinkhorn"),
    (dict(moe_router_dtype="bf16"), "model.moe_router_dtype must be one of fp32, fp64"),
    (dict(num_experts=None, moe_router_pre_softmax=True), "model.moe_router_pre_softmax needs model.num_experts"),
    (dict(num_experts=None, moe_router_load_balancing_type="sinkhorn"),
     "model.moe_router_load_balancing_type needs model.num_experts"),
])
def test_bad_moe_fields_name_the_rule(kw, message):
    with pytest.raises(ConfigError) as err:
        moe(**kw)
    assert message in str(err.value)


@pytest.mark.parametrize("kw", [dict(moe_router_pre_softmax=True), dict(moe_router_score_function="sigmoid"),
                                dict(moe_router_num_groups=4, moe_router_group_topk=2)])
def test_settings_the_sinkhorn_router_ignores_are_accepted(kw):
    """megatron-core's sinkhorn router scores with softmax (sigmoid at top-1) alone: these change
    neither time nor memory, and a setting that changes neither is accepted."""
    assert moe(moe_router_load_balancing_type="sinkhorn", **kw).moe_router_load_balancing_type.value == "sinkhorn"


# -- layout rules ------------------------------------------------------------------------------------

@pytest.mark.parametrize("plan, message", [
    (ParallelPlan(expert_parallel=3, data_parallel=3), "expert_parallel_size (3) must divide num_experts (8)"),
    (ParallelPlan(expert_parallel=8, data_parallel=4),
     "expert_parallel (8) * expert_tensor_parallel (1) = 8 must divide tensor_parallel (1) * context_parallel (1) "
     "* data_parallel (4) = 4"),
    (ParallelPlan(tensor_parallel=2, sequence_parallel=True, data_parallel=2, expert_parallel=4),
     "expert_parallel (4) * expert_tensor_parallel (2) = 8 must divide tensor_parallel (2) * context_parallel (1) "
     "* data_parallel (2) = 4"),
    (ParallelPlan(tensor_parallel=2, sequence_parallel=True, context_parallel=2, data_parallel=1, expert_parallel=8,
                  expert_tensor_parallel=1),
     "expert_parallel (8) * expert_tensor_parallel (1) = 8 must divide tensor_parallel (2) * context_parallel (2) "
     "* data_parallel (1) = 4: the expert ranks of a pipeline stage are its TP x CP x DP ranks"),
    (ParallelPlan(tensor_parallel=2, data_parallel=2, expert_parallel=2),
     "with tensor_parallel (2) > 1 needs sequence_parallel"),
    (ParallelPlan(expert_tensor_parallel=5, data_parallel=5), "expert_tensor_parallel (5) must divide "
                                                              "moe_ffn_hidden_size (1536)"),
])
def test_expert_layout_rules(plan, message):
    with pytest.raises(ConfigError) as err:
        plan.check_fits(moe())
    assert message in str(err.value)


def test_expert_parallel_needs_a_moe_model():
    with pytest.raises(ConfigError, match=r"expert_parallel \(2\) and expert_tensor_parallel \(None\) need a "
                                          r"mixture-of-experts model"):
        ParallelPlan(expert_parallel=2, data_parallel=2).check_fits(moe(num_experts=None))


def test_expert_data_parallel_is_what_tp_x_dp_leaves():
    plan = ParallelPlan(tensor_parallel=2, sequence_parallel=True, data_parallel=16, expert_parallel=8,
                        expert_tensor_parallel=1)
    assert (plan.expert_tp, plan.expert_data_parallel, plan.world_size) == (1, 4, 32)
    assert ParallelPlan(tensor_parallel=4, data_parallel=2).expert_tp == 4


def test_expert_data_parallel_with_context_parallelism_spans_tp_x_cp_x_dp():
    # megatron-core's expert rank generator has no CP: the 2 x 2 x 4 = 16 TP x CP x DP ranks of a
    # stage hold EP 8 x expert TP 1, so expert DP is 16 / 8 = 2 (not TP x DP / 8 = 1).
    plan = ParallelPlan(tensor_parallel=2, sequence_parallel=True, context_parallel=2, data_parallel=4,
                        pipeline_parallel=2, expert_parallel=8, expert_tensor_parallel=1)
    plan.check_fits(moe())
    assert (plan.expert_data_parallel, plan.grad_reduce_group_size, plan.world_size) == (2, 8, 32)
    layout = Layout(tensor_parallel=2, context_parallel=2, pipeline_parallel=2, data_parallel=4, gpus_per_node=8,
                    expert_parallel=8, expert_tensor_parallel=1)
    assert layout.expert_sizes[ParallelGroup.EXPERT_DP] == 2
    # stage 1 starts at rank 16: EP is ranks 16..23 (one node), expert DP ranks 16 and 24 (two nodes)
    assert layout.placement(ParallelGroup.EXPERT_DP, pipeline_rank=1) == GroupPlacement(
        size=2, num_nodes=2, gpus_per_node=1, max_gpus_per_node=1)
    assert layout.placement(ParallelGroup.EP, pipeline_rank=1) == GroupPlacement(
        size=8, num_nodes=1, gpus_per_node=8, max_gpus_per_node=8)


# -- routing assumption ------------------------------------------------------------------------------

def test_balanced_routing_gives_every_expert_tokens_times_topk_over_experts():
    assert expert_token_counts(4096, 2, 8) == (1024,) * 8
    assert expert_token_counts(10, 1, 4) == (3, 3, 2, 2)  # an uneven division: one more to the first


def test_a_capacity_caps_each_expert_and_padding_fills_it():
    # 64 tokens x top-2 over 8 experts: a balanced share of 16; capacity ceil(16 x factor)
    assert expert_token_counts(64, 2, 8, capacity_factor=0.5) == (8,) * 8
    assert expert_token_counts(64, 2, 8, capacity_factor=1.5) == (16,) * 8  # above the share: nothing dropped
    assert expert_token_counts(64, 2, 8, capacity_factor=1.5, pad_to_capacity=True) == (24,) * 8
    assert expert_token_counts(64, 2, 8, capacity_factor=0.3) == (5,) * 8  # ceil(4.8)


def test_moe_layer_pattern_and_parameters_follow_the_frequency():
    every_other = moe(moe_layer_freq=2)
    assert every_other.moe_layer_pattern == (True, False, True, False) and every_other.num_moe_layers == 2
    first_dense = moe(moe_layer_freq=[0, 1, 1, 1])  # a plan file's list
    assert first_dense.moe_layer_freq == (0, 1, 1, 1) and first_dense.num_moe_layers == 3
    h, f, e, dense_f = 512, 1536, 8, 1536  # llama FFN of hidden 512: 2/3 x 4h rounded up to 256
    expert_mlp, dense_mlp = 3 * h * f, 3 * h * dense_f
    all_moe = moe()
    assert all_moe.num_parameters - first_dense.num_parameters == (e * h + e * expert_mlp) - dense_mlp
    shared = moe(moe_shared_expert_intermediate_size=256)
    assert shared.num_parameters - all_moe.num_parameters == 4 * 3 * h * 256


def test_skew_multiplies_the_busiest_expert_and_the_rest_share_evenly():
    counts = expert_token_counts(256, 2, 8, skew=2.0)
    assert counts == (128, 55, 55, 55, 55, 55, 55, 54) and sum(counts) == 512
    assert expert_token_counts(256, 2, 8, skew=4.0)[0] == 256  # every token, once


def test_dispatch_counts_of_expert_parallel_rank_zero():
    counts = DispatchCounts(per_expert=(128, 55, 55, 55, 55, 55, 55, 54), ep=4, etp=2)
    assert counts.num_local_experts == 2
    assert counts.input_splits.tolist() == [183, 110, 110, 109]
    assert counts.output_splits.tolist() == [183] * 4
    assert counts.output_splits_tp.tolist() == [4 * 183] * 2
    assert counts.tokens_per_local_expert.tolist() == [8 * 128, 8 * 55]
    assert np.array_equal(counts.global_tokens_per_local_expert, np.tile([128, 55], (8, 1)))


# -- placement and the all-to-all ---------------------------------------------------------------------

def test_expert_groups_follow_megatrons_expert_rank_numbering():
    # tp 2 x dp 8 per stage, ep 8 x etp 1: the EP group is 8 consecutive ranks (one node), expert DP
    # every 8th rank; with etp 2 the EP group strides by 2 over two nodes.
    layout = Layout(tensor_parallel=2, pipeline_parallel=4, data_parallel=8, gpus_per_node=8, expert_parallel=8)
    assert layout.placement(ParallelGroup.EP, pipeline_rank=1) == GroupPlacement(
        size=8, num_nodes=1, gpus_per_node=8, max_gpus_per_node=8)
    assert layout.placement(ParallelGroup.EXPERT_DP, pipeline_rank=1) == GroupPlacement(
        size=2, num_nodes=2, gpus_per_node=1, max_gpus_per_node=1)
    wide = Layout(tensor_parallel=2, pipeline_parallel=4, data_parallel=8, gpus_per_node=8, expert_parallel=8,
                  expert_tensor_parallel=2)
    assert wide.placement(ParallelGroup.EP) == GroupPlacement(size=8, num_nodes=2, gpus_per_node=4, max_gpus_per_node=4)
    assert wide.placement(ParallelGroup.EXPERT_TP_EP).size == 16


def test_all_to_all_over_nvlink_inside_a_node_and_the_nics_across_nodes():
    cluster = ClusterSpec(gpu="h100-sxm", gpus_per_node=8, intra_node_bandwidth_gbytes_per_s=450,
                          intra_node_latency_us=1.0, inter_node_bandwidth_gbps=3200, inter_node_latency_us=5.0)
    nbytes = 64 * 2**20
    inside = CommModel(cluster=cluster, tensor_parallel=1, pipeline_parallel=1, data_parallel=8, expert_parallel=8)
    assert inside.time_ns(CollectiveKind.ALL_TO_ALL, nbytes, ParallelGroup.EP) == pytest.approx(
        7 / 8 * nbytes / 450 + 7 * 1000)
    across = CommModel(cluster=cluster, tensor_parallel=2, pipeline_parallel=1, data_parallel=8, expert_parallel=8,
                       expert_tensor_parallel=2)
    nic_share = 3200 / 8 / 8  # bytes per ns per GPU: 400 GB/s per node over 8 GPUs
    assert across.time_ns(CollectiveKind.ALL_TO_ALL, nbytes, ParallelGroup.EP) == pytest.approx(
        max(3 / 8 * nbytes / 450, 4 / 8 * nbytes / nic_share) + 7 * 5000)


# -- search axis -------------------------------------------------------------------------------------

def test_search_expert_parallel_axis():
    found = enumerate_plans(MIXTRAL, SearchSpace(tensor_parallel=(1,), pipeline_parallel=(4,), micro_batch_size=(1,),
                                                 virtual_pipeline=(1,), recompute=("full",),
                                                 grad_reduce=("overlap",), distributed_optimizer=(False,)),
                            global_batch_size=256, budget=GpuBudget(counts=(64,)),
                            training=TrainingSpec(global_batch_size=256), gpus_per_node=8)
    assert sorted(c.parallel.expert_parallel for c in found.candidates) == [1, 2, 4, 8]
    dense = ModelSpec(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=256)
    pinned = enumerate_plans(dense, SearchSpace(tensor_parallel=(1,), pipeline_parallel=(1,), expert_parallel=(1, 2),
                                                micro_batch_size=(1,), recompute=("none",),
                                                grad_reduce=("overlap",), sequence_parallel=(False,),
                                                distributed_optimizer=(False,)),
                             global_batch_size=8, budget=GpuBudget(counts=(8,)),
                             training=TrainingSpec(global_batch_size=8), gpus_per_node=8)
    assert [c.parallel.expert_parallel for c in pinned.candidates] == [1]
    assert pinned.skipped == {"ep needs moe": 1}
