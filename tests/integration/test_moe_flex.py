"""The flex dispatcher (DeepEP) traced on the fake process group: one all-to-all over expert TP x EP
per dispatch and combine carrying each token once per destination rank, against the all-to-all
dispatcher's once per expert pair with its count all-gather; and its estimate on a cluster."""

from collections import Counter
from dataclasses import replace

import pytest

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.graph import CollectiveKind as K
from vtrain_plugin.core.graph import ParallelGroup as G
from vtrain_plugin.core.graph import Phase
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

H, S, E, TOPK, EP, BF16 = 256, 128, 8, 2, 4, 2
MOE = ModelSpec(name="moe-flex", family="llama", num_layers=2, hidden_size=H, num_attention_heads=4,
                num_query_groups=2, seq_length=S, vocab_size=512, dtype="bf16", num_experts=E,
                moe_router_topk=TOPK, moe_ffn_hidden_size=128)
PLAN = ParallelPlan(data_parallel=EP, expert_parallel=EP, moe_token_dispatcher="alltoall")


@pytest.fixture(scope="module")
def graphs():
    return {d: trace(MOE, replace(PLAN, moe_token_dispatcher=d)) for d in ("alltoall", "flex")}


def moe_collectives(graph):
    layer = graph.stages[0].layer_template()
    return Counter((c.phase, c.kind, c.nbytes, c.group, c.group_size) for c in layer.collectives())


def test_flex_sends_each_token_once_per_destination_rank(graphs):
    ranks_hit = EP * (1 - 15 / 28)  # 2 of 8 experts, 2 per rank: a rank is missed with C(6,2)/C(8,2)
    received = round(S * ranks_hit)  # 238 rows
    assert moe_collectives(graphs["flex"]) == Counter({
        (Phase.FORWARD, K.ALL_TO_ALL, received * H * BF16, G.EXPERT_TP_EP, EP): 2,  # dispatch, combine
        (Phase.BACKWARD, K.ALL_TO_ALL, received * H * BF16, G.EXPERT_TP_EP, EP): 2})
    pairs = S * TOPK
    assert moe_collectives(graphs["alltoall"]) == Counter({
        (Phase.FORWARD, K.ALL_TO_ALL, pairs * H * BF16, G.EP, EP): 2,
        (Phase.BACKWARD, K.ALL_TO_ALL, pairs * H * BF16, G.EP, EP): 2,
        (Phase.FORWARD, K.ALL_TO_ALL, pairs * BF16, G.EP, EP): 1,  # the routing probabilities
        (Phase.BACKWARD, K.ALL_TO_ALL, pairs * BF16, G.EP, EP): 1,
        (Phase.FORWARD, K.ALL_GATHER, EP * E * 8, G.EXPERT_TP_EP, EP): 1})  # the routed counts


def test_flex_experts_compute_the_same_tokens(graphs):
    def expert_gemms(graph):
        layer = graph.stages[0].layer_template()
        return Counter(op.key.input_shapes for op in layer.ops(Phase.FORWARD)
                       if op.op == "aten.mm.default" and ".mlp.experts." in op.module)
    assert expert_gemms(graphs["flex"]) == expert_gemms(graphs["alltoall"])


def test_flex_shortens_the_exposed_dispatch_across_nodes(graphs):
    """On 1-GPU nodes every peer is off the node: DeepEP sends a token once per node, NCCL once per pair."""
    cluster = replace(get_cluster_preset("dgx-h100"), gpus_per_node=1)
    training = TrainingSpec(global_batch_size=8)
    ep = {d: estimate(g, cluster=cluster, training=training).breakdown_ms["ep_comm"] for d, g in graphs.items()}
    assert 0 < ep["flex"] < ep["alltoall"]


@pytest.mark.parametrize("dispatcher", ["alltoall", "flex"])
def test_ep_overlap_hides_exposed_all_to_alls(graphs, dispatcher):
    """Ablation: the combined 1F1B overlap shortens an iteration whose all-to-alls are exposed;
    delaying the experts' weight gradients hides at least as much."""
    cluster = replace(get_cluster_preset("dgx-h100"), gpus_per_node=1)
    training = TrainingSpec(global_batch_size=16)
    plan = replace(PLAN, moe_token_dispatcher=dispatcher)

    def run(**fields):
        graph = trace(MOE, replace(plan, **fields))
        assert graph.parallel == replace(plan, **fields)
        return estimate(graph, cluster=cluster, training=training)
    base, overlap = run(), run(overlap_moe_expert_parallel_comm=True)
    delayed = run(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    assert base.breakdown_ms["ep_comm"] > 0
    assert overlap.iteration_time_ms < base.iteration_time_ms
    assert overlap.breakdown_ms["ep_comm"] < base.breakdown_ms["ep_comm"]
    assert delayed.iteration_time_ms <= overlap.iteration_time_ms * (1 + 1e-12)  # equal where the host sets the pace


def test_flex_kernels_slow_the_compute_they_overlap(graphs):
    """The SMs DeepEP occupies are lost to the compute beside it: more of them, less hidden."""
    cluster = replace(get_cluster_preset("dgx-h100"), gpus_per_node=1)
    training = TrainingSpec(global_batch_size=16)
    plan = replace(PLAN, moe_token_dispatcher="flex", overlap_moe_expert_parallel_comm=True)
    few, many = (estimate(trace(MOE, replace(plan, moe_flex_num_sms=n)), cluster=cluster, training=training)
                 for n in (8, 100))
    assert few.iteration_time_ms < many.iteration_time_ms


def test_the_same_plan_from_a_transformer_config_a_plan_file_and_flags():
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_adapters.config_map import parallel_plan_from_transformer_config
    from vtrain_plugin.specs.megatron.args import megatron_plan
    from vtrain_plugin.specs.megatron.launch_script import read_command_line
    from vtrain_plugin.specs.plan_file import parse_plan

    expected = ParallelPlan(data_parallel=1, expert_parallel=4, moe_token_dispatcher="flex",
                            moe_flex_dispatcher_backend="hybridep", moe_flex_num_sms=24,
                            overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    config = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=4, bf16=True,
                               gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                               num_moe_experts=8, expert_model_parallel_size=4, moe_token_dispatcher_type="flex",
                               moe_flex_dispatcher_backend="hybridep", moe_hybridep_num_sms=24,
                               overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    assert parallel_plan_from_transformer_config(config, None) == expected
    fields = {"expert_parallel": 4, "moe_token_dispatcher": "flex", "moe_flex_dispatcher_backend": "hybridep",
              "moe_flex_num_sms": 24, "overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True}
    plan_file = parse_plan({"model": {"family": "llama", "num_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
                                      "seq_length": 128, "vocab_size": 512, "num_experts": 8},
                            "parallel": fields, "training": {"global_batch_size": 8}})
    assert plan_file.parallel == expected
    flags = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 128 --vocab-size 512 --bf16 "
             "--micro-batch-size 1 --num-experts 8 --expert-model-parallel-size 4 --moe-token-dispatcher-type flex "
             "--moe-flex-dispatcher-backend hybridep --moe-hybridep-num-sms 24 --overlap-moe-expert-parallel-comm "
             "--delay-wgrad-compute")
    assert megatron_plan(read_command_line(flags), gpus=4).parallel == replace(expected, data_parallel=4)
