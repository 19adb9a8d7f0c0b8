"""MoE layers traced from megatron-core on CPU: router and expert GEMMs, the dispatch and combine
collectives, expert-DP gradients and memory, exact for one layer under the routing assumption."""

from collections import Counter
from dataclasses import replace

import pytest

from megatron_adapters.moe_routing import expert_token_counts
from tests.support.quiet_host import write_quiet_host_calibration
from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.graph import CollectiveKind as K
from vtrain_plugin.core.graph import ParallelGroup as G
from vtrain_plugin.core.graph import Phase
from vtrain_plugin.core.units import GIB
from vtrain_plugin.cost.prepare import prepare
from vtrain_plugin.cost.comm.runtime_collectives import runtime_collectives
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

H, S, E, TOPK, FFN, BF16, FP32 = 512, 256, 8, 2, 384, 2, 4
MOE = ModelSpec(name="moe-test", family="llama", num_layers=4, hidden_size=H, num_attention_heads=8,
                num_query_groups=2, seq_length=S, vocab_size=1024, dtype="bf16", num_experts=E,
                moe_router_topk=TOPK, moe_ffn_hidden_size=FFN)
# TP 2 with SP, EP 2 and expert TP 2 over the 8 TP x DP ranks of a stage: expert DP 2.
PLAN = ParallelPlan(tensor_parallel=2, sequence_parallel=True, pipeline_parallel=2, data_parallel=4, expert_parallel=2)
TP, EP, ETP = 2, 2, 2
TOKENS = S // TP  # tokens entering a MoE layer on one rank (sequence parallel)
LOCAL_EXPERTS = E // EP
PER_EXPERT = TOKENS * TOPK // E  # balanced: token-expert pairs one rank routes to each expert
ROWS = ETP * EP * PER_EXPERT  # tokens one local expert computes: its pairs from every rank of expert TP x EP


@pytest.fixture(scope="module")
def alltoall():
    return trace(MOE, PLAN)


@pytest.fixture(scope="module")
def allgather():
    return trace(MOE, replace(PLAN, moe_token_dispatcher="allgather"))


def gemms(layer, phase, module=""):
    return Counter(op.key.input_shapes for op in layer.ops(phase)
                   if op.op == "aten.mm.default" and module in op.module)


def moe_collectives(layer):
    return Counter((c.phase, c.kind, c.nbytes, c.group, c.group_size) for c in layer.collectives()
                   if c.module.endswith(".mlp") or ".mlp." in c.module)


def test_router_gemm_is_tokens_by_hidden_by_experts(alltoall):
    layer = alltoall.stages[1].layer_template()
    assert gemms(layer, Phase.FORWARD, ".mlp.router") == Counter({((TOKENS, H), (H, E)): 1})
    assert gemms(layer, Phase.BACKWARD, ".mlp.router") == Counter({((TOKENS, E), (E, H)): 1, ((E, TOKENS), (TOKENS, H)): 1})


def test_each_local_expert_computes_the_balanced_token_count(alltoall):
    layer = alltoall.stages[1].layer_template()
    fc1, fc2 = 2 * FFN // ETP, FFN // ETP  # SwiGLU: gate and up projections in one fc1
    assert ROWS == 128
    assert gemms(layer, Phase.FORWARD, ".mlp.experts.") == Counter({
        ((ROWS, H), (H, fc1)): LOCAL_EXPERTS, ((ROWS, fc2), (fc2, H)): LOCAL_EXPERTS})
    assert gemms(layer, Phase.BACKWARD, ".mlp.experts.") == Counter({
        ((ROWS, H), (H, fc2)): LOCAL_EXPERTS, ((H, ROWS), (ROWS, fc2)): LOCAL_EXPERTS,  # fc2 dgrad, wgrad
        ((ROWS, fc1), (fc1, H)): LOCAL_EXPERTS, ((fc1, ROWS), (ROWS, H)): LOCAL_EXPERTS})  # fc1


def test_all_to_all_dispatch_and_combine_bytes(alltoall):
    layer = alltoall.stages[1].layer_template()
    pairs = TOKENS * TOPK  # rows a rank sends (and, balanced, receives) in one all-to-all
    gathered = ETP * EP * LOCAL_EXPERTS * PER_EXPERT  # rows after the expert-TP all-gather
    tokens, probs = pairs * H * BF16, pairs * BF16
    assert moe_collectives(layer) == Counter({
        (Phase.FORWARD, K.ALL_REDUCE, E * 8, G.TP, TP): 1,  # router: tokens per expert for the aux loss
        (Phase.FORWARD, K.ALL_GATHER, ETP * EP * E * 8, G.EXPERT_TP_EP, ETP * EP): 1,  # routed counts
        (Phase.FORWARD, K.ALL_TO_ALL, tokens, G.EP, EP): 2,  # dispatch, combine
        (Phase.FORWARD, K.ALL_TO_ALL, probs, G.EP, EP): 1,
        (Phase.FORWARD, K.ALL_GATHER, gathered * H * BF16, G.EXPERT_TP, ETP): 1,
        (Phase.FORWARD, K.ALL_GATHER, gathered * BF16, G.EXPERT_TP, ETP): 1,
        (Phase.FORWARD, K.REDUCE_SCATTER, gathered * H * BF16, G.EXPERT_TP, ETP): 1,
        (Phase.BACKWARD, K.ALL_TO_ALL, tokens, G.EP, EP): 2,
        (Phase.BACKWARD, K.ALL_TO_ALL, probs, G.EP, EP): 1,
        (Phase.BACKWARD, K.ALL_GATHER, gathered * H * BF16, G.EXPERT_TP, ETP): 1,
        (Phase.BACKWARD, K.REDUCE_SCATTER, gathered * H * BF16, G.EXPERT_TP, ETP): 1,
        (Phase.BACKWARD, K.REDUCE_SCATTER, gathered * BF16, G.EXPERT_TP, ETP): 1,
    })
    assert not any(c.synthesized for c in layer.collectives())  # traced as megatron runs them


def test_allgather_dispatcher_gathers_every_token_over_expert_tp_x_ep(allgather):
    layer = allgather.stages[1].layer_template()
    gathered = ETP * EP * TOKENS
    assert moe_collectives(layer) == Counter({
        (Phase.FORWARD, K.ALL_REDUCE, E * 8, G.TP, TP): 1,
        (Phase.FORWARD, K.ALL_GATHER, gathered * E, G.EXPERT_TP_EP, ETP * EP): 1,  # routing map (bool)
        (Phase.FORWARD, K.ALL_GATHER, gathered * E * BF16, G.EXPERT_TP_EP, ETP * EP): 1,  # probabilities
        (Phase.FORWARD, K.ALL_GATHER, gathered * H * BF16, G.EXPERT_TP_EP, ETP * EP): 1,  # tokens
        (Phase.FORWARD, K.REDUCE_SCATTER, gathered * H * BF16, G.EXPERT_TP_EP, ETP * EP): 1,
        (Phase.BACKWARD, K.ALL_GATHER, gathered * H * BF16, G.EXPERT_TP_EP, ETP * EP): 1,
        (Phase.BACKWARD, K.REDUCE_SCATTER, gathered * H * BF16, G.EXPERT_TP_EP, ETP * EP): 1,
        (Phase.BACKWARD, K.REDUCE_SCATTER, gathered * E * BF16, G.EXPERT_TP_EP, ETP * EP): 1,
    })
    fc1 = 2 * FFN // ETP
    assert gemms(layer, Phase.FORWARD, ".mlp.experts.")[((ROWS, H), (H, fc1))] == LOCAL_EXPERTS


def test_expert_gradients_reduce_over_expert_dp_and_dense_ones_over_dp(alltoall):
    stage = alltoall.stages[1]
    layer = stage.layer_template()
    expert = LOCAL_EXPERTS * (H * 2 * FFN + FFN * H) // ETP
    qkv = (H + 2 * 2 * (H // 8)) * H // TP
    dense = qkv + H * H // TP + 2 * H + E * H  # QKV, projection, two RMSNorms, router
    assert (layer.num_parameters, layer.num_expert_parameters) == (dense + expert, expert)
    runtime = runtime_collectives(stage, PLAN, dtype=alltoall.dtype, tied_embeddings=False)
    reductions = {(n.group, n.group_size, n.module): n.nbytes for n in runtime.nodes(stage)
                  if n.kind is K.ALL_REDUCE and n.module == layer.name}
    # bf16 gradients are reduced in fp32 (Megatron's main_grad)
    assert reductions == {(G.DP, 4, layer.name): dense * FP32, (G.EXPERT_DP, 2, layer.name): expert * FP32}


def test_memory_holds_the_local_experts_only(alltoall):
    est = estimate(alltoall, cluster=get_cluster_preset("dgx-h100"), training=TrainingSpec(global_batch_size=16))
    stage = alltoall.stages[1]
    assert est.memory_gib[1].weights_gib * GIB == stage.num_parameters * BF16
    assert est.memory_gib[1].optimizer_gib * GIB == stage.num_parameters * 12
    assert est.breakdown_ms["ep_comm"] > 0 and sum(est.breakdown_ms.values()) == pytest.approx(est.iteration_time_ms)


def test_skewed_routing_loads_the_traced_rank_and_keeps_the_model_flops(monkeypatch, tmp_path):
    skewed_model = replace(MOE, moe_routing_skew=2.0)
    plan = ParallelPlan(pipeline_parallel=1, data_parallel=4, expert_parallel=4)
    counts = expert_token_counts(S, TOPK, E, skew=2.0)
    assert counts[:2] == (128, 55)
    layer = trace(skewed_model, plan).stages[0].layer_template()
    fc1 = 2 * FFN
    assert gemms(layer, Phase.FORWARD, ".mlp.experts.") == Counter({
        ((4 * 128, H), (H, fc1)): 1, ((4 * 128, FFN), (FFN, H)): 1, ((4 * 55, H), (H, fc1)): 1, ((4 * 55, FFN), (FFN, H)): 1})
    received = 4 * (128 + 55)  # the busiest rank receives its two experts' pairs from each of 4 ranks
    a2a = Counter((c.phase, c.nbytes) for c in layer.collectives() if c.kind is K.ALL_TO_ALL and c.nbytes > 4096)
    assert a2a == Counter({(Phase.FORWARD, received * H * BF16): 1, (Phase.FORWARD, S * TOPK * H * BF16): 1,
                           (Phase.BACKWARD, received * H * BF16): 1, (Phase.BACKWARD, S * TOPK * H * BF16): 1})
    # A model this small is host-bound under any stack's host costs, where the busiest rank's extra
    # device time is hidden: here the H100's device constants with the least host cost their ranges allow.
    monkeypatch.setenv("VTRAIN_CALIBRATION_DIR", str(tmp_path))
    write_quiet_host_calibration("h100-sxm")
    cluster, training = get_cluster_preset("dgx-h100"), TrainingSpec(global_batch_size=16, software_stack="local_spec")
    skewed = estimate(trace(skewed_model, plan), cluster=cluster, training=training)
    balanced = estimate(trace(MOE, plan), cluster=cluster, training=training)
    assert skewed.iteration_time_ms > balanced.iteration_time_ms
    assert skewed.breakdown_ms["ep_comm"] > balanced.breakdown_ms["ep_comm"]
    assert skewed.tflops_per_gpu * skewed.iteration_time_ms == pytest.approx(
        balanced.tflops_per_gpu * balanced.iteration_time_ms)


def test_transformer_config_moe_fields_are_honoured():
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                               ffn_hidden_size=512, normalization="RMSNorm", gated_linear_unit=True,
                               activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
                               attention_dropout=0.0, bf16=True, num_moe_experts=4, moe_router_topk=2,
                               moe_ffn_hidden_size=256, moe_token_dispatcher_type="alltoall",
                               expert_model_parallel_size=2)
    graph = trace(config, ParallelPlan(data_parallel=2, expert_parallel=2), vocab_size=1024, seq_length=128)
    model = graph.model
    assert (model.num_experts, model.router_topk, model.expert_ffn_size) == (4, 2, 256)
    layer = graph.stages[0].layer_template()
    rows = 128 * 2 // 4 * 2  # 64 pairs per expert from each of the 2 EP ranks
    assert gemms(layer, Phase.FORWARD, ".mlp.experts.") == Counter({((rows, 256), (256, 512)): 2,
                                                                    ((rows, 256), (256, 256)): 2})


@pytest.mark.parametrize("change, message", [
    ({"expert_parallel": 3, "data_parallel": 3}, "expert_parallel_size (3) must divide num_experts (8)"),
    ({"moe_router_topk": 16}, "model.moe_router_topk (16) must not exceed model.num_experts (8)"),
])
def test_bad_moe_plans_are_one_line_exit_2(tmp_path, run_cli, change, message):
    import yaml

    model = {k: v for k, v in MOE.to_dict().items() if v is not None and k != "moe_routing_skew"}
    parallel = {"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 4, "expert_parallel": 2}
    for key, value in change.items():
        (model if key.startswith("moe_") else parallel)[key] = value
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump({"model": model, "parallel": parallel, "training": {"global_batch_size": 12},
                                    "cluster": {"preset": "dgx-h100"}}))
    for command in ("trace", "estimate"):
        proc = run_cli(command, str(path))
        assert proc.returncode == 2 and proc.stdout == ""
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], proc.stderr


def test_distributed_optimizer_shards_the_experts_over_expert_dp(alltoall):
    stage = alltoall.stages[1]
    layer = stage.layer_template()
    runtime = runtime_collectives(stage, PLAN, dtype=alltoall.dtype, tied_embeddings=False, distributed_optimizer=True)
    assert {(n.kind, n.group, n.group_size) for n in runtime.nodes(stage) if n.module == layer.name} == {
        (K.REDUCE_SCATTER, G.DP, 4), (K.ALL_GATHER, G.DP, 4), (K.REDUCE_SCATTER, G.EXPERT_DP, 2),
        (K.ALL_GATHER, G.EXPERT_DP, 2)}
    training = TrainingSpec(global_batch_size=16, distributed_optimizer=True)
    est = estimate(alltoall, cluster=get_cluster_preset("dgx-h100"), training=training)
    dense, expert = stage.num_parameters - stage.num_expert_parameters, stage.num_expert_parameters
    assert est.memory_gib[1].optimizer_gib * GIB == dense * 12 / 4 + expert * 12 / 2
    # TransformerEngine's multi-tensor Adam runs over the dense shard and, apart, the expert shard
    prepared = prepare(alltoall, "megatron_core_te", distributed_optimizer=True)
    role = next(s.role for s in prepared.stages if s.stage is stage)
    adam = sorted(n.key.input_shapes[0][0] for n in role.nodes
                  if n is not None and n.op == "te.multi_tensor_adam.default" and ".layers." in f".{n.module}")
    dense_layer = layer.num_parameters - layer.num_expert_parameters
    assert adam == sorted([-(-dense_layer // 4), -(-layer.num_expert_parameters // 2)])


def test_known_count_permutation_is_megatrons_on_real_routing():
    """The permutation traced in place of megatron's dropless one gives the same tokens, order and
    probabilities on real data (its masked_select run as nonzero + gather with the count known)."""
    import torch
    from megatron.core.transformer.moe.moe_utils import permute

    from megatron_adapters.moe import _permute

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(32, 16, generator=generator)
    scores = torch.randn(32, E, generator=generator).softmax(dim=-1)
    top = scores.topk(TOPK, dim=-1).indices
    routing_map = torch.zeros(32, E, dtype=torch.bool).scatter(1, top, True)
    probs = scores * routing_map
    expected = permute(tokens, routing_map, probs=probs, num_out_tokens=32 * TOPK)
    got = _permute(tokens, routing_map, probs=probs, num_out_tokens=32 * TOPK)
    for want, have in zip(expected, got):
        assert torch.equal(want, have)


def test_an_unknown_permutation_variant_is_a_trace_error():
    import torch

    from megatron_adapters.moe import _permute
    from vtrain_plugin.core.errors import TraceError

    tokens, routing = torch.zeros(4, 8), torch.ones(4, 2, dtype=torch.bool)
    with pytest.raises(TraceError, match=r"fused=True, drop_and_pad=False, num_out_tokens=8"):
        _permute(tokens, routing, num_out_tokens=8, fused=True)
    assert _permute(tokens, routing, num_out_tokens=8)[0].shape == (8, 8)
