"""The flex dispatcher's (DeepEP's) volume and time: exact values under the balanced routing
assumption, and the directions they move in."""

from math import comb

import pytest

from megatron_adapters.flex_routing import FlexDispatch, expected_units_hit
from vtrain_plugin.core.graph import CollectiveKind, ParallelGroup
from vtrain_plugin.cost.comm.collectives import CommModel
from vtrain_plugin.cost.comm.moe_dispatch import FLEX_NVLINK_EFFICIENCY, FLEX_RDMA_EFFICIENCY, flex_time_ns
from vtrain_plugin.cost.comm.topology import GroupPlacement
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan


def test_units_hit_by_a_token_of_uniform_top_k():
    # 8 experts over 4 ranks, top-2: a rank is missed when both experts lie among the other 6
    assert expected_units_hit(4, 8, 2) == pytest.approx(4 * (1 - 15 / 28))
    assert expected_units_hit(8, 8, 1) == pytest.approx(1.0)  # top-1: one rank
    assert expected_units_hit(2, 8, 8) == pytest.approx(2.0)  # every expert: every rank
    assert expected_units_hit(1, 8, 2) == 1.0


def test_group_limited_routing_reaches_fewer_nodes():
    # DeepSeek-V3: 256 experts in 8 groups, top-8 from 4 groups; over 8 nodes a node is one group
    limited = expected_units_hit(8, 256, 8, num_groups=8, group_topk=4)
    missed_chosen = comb(128 - 32, 8) / comb(128, 8)
    assert limited == pytest.approx(8 * (4 / 8) * (1 - missed_chosen))
    assert limited <= 4 < expected_units_hit(8, 256, 8)
    # 2 nodes of 4 groups each: hypergeometric over the chosen groups on the node
    two = expected_units_hit(2, 256, 8, num_groups=8, group_topk=4)
    missed = sum(comb(4, j) * comb(4, 4 - j) / comb(8, 4) * comb(128 - 32 * j, 8) / comb(128, 8) for j in range(5))
    assert two == pytest.approx(2 * (1 - missed))


def test_flex_time_inside_a_node_is_nvlink_at_deepeps_efficiency():
    flex = FlexDispatch(num_experts=8, topk=2, expert_parallel=8, expert_tensor_parallel=1)
    hit = flex.ranks_hit()  # 8 * (1 - C(7,2)/C(8,2)) = 2
    assert hit == pytest.approx(2.0)
    placement = GroupPlacement(size=8, num_nodes=1, gpus_per_node=8, max_gpus_per_node=8)
    nbytes = 4096 * 7168 * 2  # 2048 tokens of hidden 7168 in bf16, each to 2 ranks
    ns = flex_time_ns(nbytes, placement, flex, nvlink_bytes_per_ns=450.0, nic_bytes_per_ns=50.0,
                      intra_latency_ns=1000.0, inter_latency_ns=5000.0)
    assert ns == pytest.approx(nbytes * (1 - 1 / 8) / (FLEX_NVLINK_EFFICIENCY * 450.0) + 1000.0)


def test_flex_time_across_nodes_sends_each_token_once_per_node():
    flex = FlexDispatch(num_experts=64, topk=8, expert_parallel=32, expert_tensor_parallel=1)
    placement = GroupPlacement(size=32, num_nodes=4, gpus_per_node=8, max_gpus_per_node=8)
    token_nbytes = 4096 * 7168 * 2
    nbytes = round(token_nbytes * flex.ranks_hit())
    ns = flex_time_ns(nbytes, placement, flex, nvlink_bytes_per_ns=450.0, nic_bytes_per_ns=50.0,
                      intra_latency_ns=1000.0, inter_latency_ns=5000.0)
    nodes_hit = 4 * (1 - comb(48, 8) / comb(64, 8))
    rdma = nbytes / flex.ranks_hit() * nodes_hit * (3 / 4) / (FLEX_RDMA_EFFICIENCY * 50.0)
    nvlink = nbytes * (1 - 1 / 8) / (FLEX_NVLINK_EFFICIENCY * 450.0)
    assert rdma > nvlink  # the NICs bound it
    assert ns == pytest.approx(max(rdma, nvlink) + 1000.0 + 5000.0)


def test_flex_beats_nccl_all_to_all_across_nodes():
    """DeepEP's RDMA carries each token once per node; NCCL's all-to-all once per expert pair off the node."""
    model = ModelSpec(num_layers=2, hidden_size=4096, num_attention_heads=32, seq_length=4096, vocab_size=32000,
                      family="llama", dtype="bf16", num_experts=64, moe_router_topk=8)
    cluster = get_cluster_preset("dgx-h100")
    tokens, h = 4096, 4096
    nccl = CommModel.for_plan(cluster, ParallelPlan(data_parallel=32, expert_parallel=32,
                                                    moe_token_dispatcher="alltoall"), model=model)
    flex_plan = ParallelPlan(data_parallel=32, expert_parallel=32, moe_token_dispatcher="flex")
    flex = CommModel.for_plan(cluster, flex_plan, model=model)
    nccl_ns = nccl.time_ns(CollectiveKind.ALL_TO_ALL, tokens * 8 * h * 2, ParallelGroup.EP)
    received = round(tokens * flex.flex.ranks_hit()) * h * 2
    flex_ns = flex.time_ns(CollectiveKind.ALL_TO_ALL, received, ParallelGroup.EXPERT_TP_EP)
    assert 0 < flex_ns < nccl_ns
    # without the model, or with another dispatcher, no flex pricing
    assert CommModel.for_plan(cluster, flex_plan).flex is None and nccl.flex is None
