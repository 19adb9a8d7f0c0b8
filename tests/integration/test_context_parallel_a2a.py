"""Context parallelism over all-to-all (TE's a2a, DeepSpeed-Ulysses) and hierarchical a2a+p2p on real
megatron-core layers traced on one CP rank's tokens: exact all-to-all bytes, the group placement,
the heads rule, and a2a against the p2p ring on one node (other time, same FLOPs)."""

from collections import Counter
from dataclasses import replace

import pytest

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import CP_GROUPS, ParallelGroup, Phase
from vtrain_plugin.cost import Layout
from vtrain_plugin.cost.comm.context_parallel import with_context_parallel
from vtrain_plugin.cost.prepare import prepare
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

SEQ, HEAD_DIM, BF16 = 128, 32, 2
# 8 query heads, 4 key/value heads of 32, TP 1: the all-to-all splits both over CP 2 or 4
GQA = ModelSpec(family="llama", num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=4,
                seq_length=SEQ, vocab_size=1000, dtype="bf16")


@pytest.fixture(scope="module")
def cp4():
    return trace(GQA, ParallelPlan(context_parallel=4, cp_comm_type="a2a"))


@pytest.fixture(scope="module")
def cp2():
    return trace(GQA, ParallelPlan(context_parallel=2, cp_comm_type="a2a"))


def _layer(graph, **changes):
    graph = replace(graph, parallel=replace(graph.parallel, **changes)) if changes else graph
    return with_context_parallel(graph).stages[0].layer_template()


def _collectives(layer):
    return Counter((c.phase.value, c.group.value, c.kind.value, c.nbytes) for c in layer.collectives()
                   if c.group in CP_GROUPS)


@pytest.mark.parametrize("cp", [2, 4])
def test_a2a_bytes_of_one_layer_are_exact(cp, cp2, cp4):
    s_l = SEQ // cp
    q, kv = 8 * s_l * HEAD_DIM * BF16, 4 * s_l * HEAD_DIM * BF16  # the rank's local Q (O, dO, dQ) and K (V)
    layer = _layer(cp2 if cp == 2 else cp4)
    assert _collectives(layer) == Counter({
        ("forward", "cp", "all_to_all", q): 2, ("forward", "cp", "all_to_all", kv): 2,  # Q, K, V; O back
        ("backward", "cp", "all_to_all", q): 3, ("backward", "cp", "all_to_all", kv): 2})  # O, dO; dQ, dK, dV
    assert all(c.group_size == cp and c.synthesized for c in layer.collectives() if c.group in CP_GROUPS)
    kernels = [op for op in layer.ops(Phase.FORWARD) if op.op.startswith("te.fused_attention")]
    # one kernel over the whole sequence for 8 / cp heads, causal half
    assert [(k.key.input_shapes[0], k.flops) for k in kernels] == [
        ((SEQ, 8 // cp, HEAD_DIM), 4 * (8 // cp) * SEQ * SEQ * HEAD_DIM // 2)]


def test_a2a_p2p_runs_the_all_to_all_inside_and_the_ring_across(cp4):
    s_l = SEQ // 4
    q, kv = 8 * s_l * HEAD_DIM * BF16, 4 * s_l * HEAD_DIM * BF16
    chunk = 2 * (4 // 2) * (2 * s_l) * HEAD_DIM * BF16  # K/V of 2 heads over the 2 ranks' tokens
    layer = _layer(cp4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=(2, 2))
    assert _collectives(layer) == Counter({
        ("forward", "cp_a2a", "all_to_all", q): 2, ("forward", "cp_a2a", "all_to_all", kv): 2,
        ("forward", "cp_p2p", "send", chunk): 1, ("forward", "cp_p2p", "recv", chunk): 1,
        ("backward", "cp_a2a", "all_to_all", q): 3, ("backward", "cp_a2a", "all_to_all", kv): 2,
        ("backward", "cp_p2p", "send", chunk): 2, ("backward", "cp_p2p", "recv", chunk): 2})


def test_a2a_p2p_groups_are_placed_by_level():
    # TP 2, CP 4 = [2 inner, 2 outer] on nodes of 4: the a2a pairs CP neighbours (ranks 0, 2) on one
    # node, the ring joins ranks 0 and 4 across nodes (megatron-core's create_hierarchical_groups)
    layout = Layout(tensor_parallel=2, context_parallel=4, pipeline_parallel=1, data_parallel=1, gpus_per_node=4,
                    cp_a2a=2)
    inner, outer = layout.placement(ParallelGroup.CP_A2A), layout.placement(ParallelGroup.CP_P2P)
    assert (inner.size, inner.num_nodes, outer.size, outer.num_nodes) == (2, 1, 2, 2)


@pytest.mark.parametrize("fields, message", [
    (dict(context_parallel=4, cp_comm_type="a2a+p2p"),
     r"parallel.cp_comm_type a2a\+p2p requires parallel.hierarchical_context_parallel_sizes"),
    (dict(context_parallel=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=(2, 4)),
     r"parallel.hierarchical_context_parallel_sizes \(2 x 4 = 8\) must multiply to context_parallel \(4\)"),
    (dict(context_parallel=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=(1, 2, 2)),
     r"parallel.hierarchical_context_parallel_sizes has 3 levels; cp_comm_type a2a\+p2p takes two"),
])
def test_hierarchical_sizes_are_validated(fields, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        ParallelPlan(**fields)


def test_the_all_to_all_group_must_divide_the_heads_of_a_tp_rank():
    with pytest.raises(ConfigError, match=r"^the CP all-to-all group size \(4, cp_comm_type a2a\) must divide the "
                                          r"key/value heads per tensor-parallel rank \(num_query_groups 4 / "
                                          r"tensor_parallel_size 2 = 2\)$"):
        ParallelPlan(tensor_parallel=2, context_parallel=4, cp_comm_type="a2a").check_fits(GQA)
    with pytest.raises(ConfigError, match=r"must divide the attention heads per tensor-parallel rank "
                                          r"\(num_attention_heads 8 / tensor_parallel_size 4 = 2\)$"):
        ParallelPlan(tensor_parallel=4, context_parallel=4, cp_comm_type="a2a+p2p",
                     hierarchical_context_parallel_sizes=(4, 1)).check_fits(GQA)
    ParallelPlan(tensor_parallel=2, context_parallel=4, cp_comm_type="a2a+p2p",
                 hierarchical_context_parallel_sizes=(2, 2)).check_fits(GQA)  # 4 / 2 and 2 / 2 heads


def test_a2a_and_p2p_on_one_node_differ_in_time_not_in_flops(cp4):
    cluster, training = get_cluster_preset("dgx-h100"), TrainingSpec(global_batch_size=8)
    ring_graph = replace(cp4, parallel=replace(cp4.parallel, cp_comm_type="p2p"))
    a2a, ring = (estimate(g, cluster=cluster, training=training) for g in (cp4, ring_graph))
    assert a2a.iteration_time_ms != ring.iteration_time_ms
    assert a2a.breakdown_ms["cp_comm"] > 0
    flops_a2a, flops_ring = prepare(cp4, "megatron_core_te").flops, prepare(ring_graph, "megatron_core_te").flops
    assert flops_a2a == flops_ring
    assert a2a.tflops_per_gpu * a2a.iteration_time_ms == pytest.approx(ring.tflops_per_gpu * ring.iteration_time_ms)
