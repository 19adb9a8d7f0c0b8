"""Context parallelism without tracing: layout rules, rank placement, CP transfers, the CP attention
synthesized for a layer, and the exposed time of a ring step (hand-built graphs, exact arithmetic)."""

from fractions import Fraction

import pytest

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import (Block, BlockKind, CollectiveKind, CollectiveNode, KernelKey, OpGraph, OpNode,
                                      ParallelGroup, Phase, StageGraph)
from vtrain_plugin.cost import CommModel, Layout
from vtrain_plugin.cost.comm.context_parallel import ContextParallel
from vtrain_plugin.cost.memory import rank_memory
from vtrain_plugin.cost.comm.runtime_collectives import runtime_collectives
from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import CpCommType, ParallelPlan
from vtrain_plugin.specs.plan_file import parse_plan
from vtrain_plugin.specs.training import SoftwareStack, TrainingSpec

from tests.support.one_layer_cost import LAYER, cost_one_layer

MODEL = ModelSpec(family="llama", num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                  seq_length=96, vocab_size=1024)
# 100 GB/s NVLink (100 bytes/ns), 400 Gb/s per node (6.25 bytes/ns per GPU), 2 us / 5 us latency.
PLAIN = ClusterSpec(gpu="h100-sxm", gpus_per_node=8, intra_node_bandwidth_gbytes_per_s=100.0,
                    intra_node_latency_us=2.0, inter_node_bandwidth_gbps=400.0, inter_node_latency_us=5.0)


# -- the plan ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, message", [
    (dict(context_parallel=5), "context_parallel_size (5) must divide seq_length (96)"),
    (dict(context_parallel=32), "2 * context_parallel_size (2 * 32 = 64) must divide seq_length (96): "
                                "Megatron's load-balanced causal split"),
    (dict(context_parallel=4, tensor_parallel=2, sequence_parallel=True), None),  # 2 chunks of 12 per rank, 24 / 2
])
def test_context_parallel_must_split_the_sequence_evenly(fields, message):
    plan = ParallelPlan(**fields)
    if message is None:
        plan.check_fits(MODEL)
        return
    with pytest.raises(ConfigError) as err:
        plan.check_fits(MODEL)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_sequence_parallelism_splits_each_cp_ranks_tokens():
    model = ModelSpec(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=96)
    ParallelPlan(tensor_parallel=8, sequence_parallel=True, context_parallel=4).check_fits(model)  # 24 / 8
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size \(8\) must divide seq_length / "
                                          r"context_parallel_size \(96 / 16 = 6\) with sequence parallelism$"):
        ParallelPlan(tensor_parallel=8, sequence_parallel=True, context_parallel=16).check_fits(model)


def test_plan_fields_world_size_and_gradient_group():
    plan = ParallelPlan(tensor_parallel=4, context_parallel=2, pipeline_parallel=3, data_parallel=5,
                        cp_comm_type="all_gather")
    assert plan.world_size == 4 * 2 * 3 * 5
    assert plan.grad_reduce_group_size == 10 and plan.local_seq_length(MODEL) == 48
    assert plan.cp_comm_type is CpCommType.ALL_GATHER
    assert plan.to_dict()["cp_comm_type"] == "all_gather" and plan.to_dict()["context_parallel"] == 2
    with pytest.raises(ConfigError, match=r"^parallel.cp_comm_type must be one of p2p, all_gather, a2a, a2a\+p2p; "
                                          r"got 'ring'$"):
        ParallelPlan(cp_comm_type="ring")
    with pytest.raises(ConfigError, match="^parallel.context_parallel must be positive, got 0$"):
        ParallelPlan(context_parallel=0)


def test_plan_files_set_context_parallelism_and_tp_overlap():
    sections = parse_plan({"model": MODEL.to_dict(),
                           "parallel": {"tensor_parallel": 2, "sequence_parallel": True, "context_parallel": 4,
                                        "cp_comm_type": "all_gather"},
                           "training": {"global_batch_size": 8, "tp_comm_overlap": True}})
    assert (sections.parallel.context_parallel, sections.parallel.cp_comm_type) == (4, CpCommType.ALL_GATHER)
    assert sections.training.tp_comm_overlap is True


# -- placement and transfers ------------------------------------------------------------------------

def test_cp_groups_sit_inside_a_node_when_tp_times_cp_fits():
    inside = Layout(tensor_parallel=2, context_parallel=4, pipeline_parallel=2, data_parallel=2, gpus_per_node=8)
    assert inside.rank(tp_rank=1, cp_rank=3, dp_rank=1, pp_rank=1) == 1 + 2 * (3 + 4 * (1 + 2 * 1))
    cp, dp = inside.placement(ParallelGroup.CP), inside.placement(ParallelGroup.DP)
    assert (cp.size, cp.num_nodes, cp.gpus_per_node) == (4, 1, 4)  # ranks 0 2 4 6
    assert (dp.size, dp.num_nodes, dp.gpus_per_node) == (8, 2, 4)  # gradients over DP x CP: 0 2 .. 14
    assert inside.placement(ParallelGroup.PP).num_nodes == 2  # ranks 0, 16
    across = Layout(tensor_parallel=4, context_parallel=4, pipeline_parallel=1, data_parallel=1, gpus_per_node=8)
    cp = across.placement(ParallelGroup.CP)
    assert (cp.size, cp.num_nodes, cp.gpus_per_node) == (4, 2, 2)  # ranks 0 4 | 8 12


def test_a_ring_step_is_a_send_inside_the_node_or_over_the_network():
    inside = CommModel(cluster=PLAIN, tensor_parallel=2, pipeline_parallel=1, data_parallel=1, context_parallel=4)
    assert inside.time_ns(CollectiveKind.SEND, 1_000_000, ParallelGroup.CP) == 1_000_000 / 100 + 2000
    across = CommModel(cluster=PLAIN, tensor_parallel=4, pipeline_parallel=1, data_parallel=1, context_parallel=4)
    assert across.time_ns(CollectiveKind.SEND, 1_000_000, ParallelGroup.CP) == 1_000_000 / 6.25 + 5000
    alone = CommModel(cluster=PLAIN, tensor_parallel=4, pipeline_parallel=2, data_parallel=1)
    assert alone.time_ns(CollectiveKind.SEND, 1_000_000, ParallelGroup.CP) == 0.0
    # the all-gather of K/V over 4 ranks of one node: 3/4 of the gathered bytes, 3 steps
    assert inside.time_ns(CollectiveKind.ALL_GATHER, 4_000_000, ParallelGroup.CP) == 3 / 4 * 4_000_000 / 100 + 3 * 2000


# -- the CP attention of a layer --------------------------------------------------------------------

CORE = f"{LAYER}.self_attention.core_attention"
# B = 4 heads x micro-batch 1 on this TP rank, s_l = 32 tokens, head dim 32; one K/V head (GQA 4:1)
SCORES = OpNode(key=KernelKey(op="aten.baddbmm.default", input_shapes=((4, 32, 32), (4, 32, 32), (4, 32, 32)),
                              dtypes=("bfloat16",) * 3), phase=Phase.FORWARD, module=CORE, flops=2 * 4 * 32 * 32 * 32)


def _op(name, phase, module):
    return OpNode(key=KernelKey(op=f"aten.{name}.default", input_shapes=((8, 8),), dtypes=("bfloat16",)),
                  phase=phase, module=module)


def _layer_nodes():
    return (_op("mm", Phase.FORWARD, f"{LAYER}.self_attention.linear_qkv"), SCORES,
            _op("_softmax", Phase.FORWARD, f"{CORE}.scale_mask_softmax"), _op("bmm", Phase.FORWARD, CORE),
            _op("mm", Phase.FORWARD, f"{LAYER}.self_attention.linear_proj"),
            _op("mm", Phase.BACKWARD, f"{LAYER}.self_attention.linear_proj"),
            _op("bmm", Phase.BACKWARD, CORE), _op("_softmax_backward_data", Phase.BACKWARD, f"{CORE}.scale_mask_softmax"),
            _op("bmm", Phase.BACKWARD, CORE), _op("mm", Phase.BACKWARD, f"{LAYER}.self_attention.linear_qkv"))


def _summary(nodes):
    return [(n.phase.value[0], n.kind.value, n.nbytes) if isinstance(n, CollectiveNode)
            else (n.phase.value[0], n.op.split(".")[1], n.flops) for n in nodes]


def test_ring_attention_replaces_the_core_attention_of_each_phase():
    cp = ContextParallel(size=4, comm_type=CpCommType.P2P, kv_heads_per_head=Fraction(1, 4))
    nodes = cp.layer_nodes(_layer_nodes())
    chunk = 2 * 1 * 32 * 32 * 2  # K and V of 32 tokens, 1 head of 32, bf16
    step = 2 * 4 * 32 * 32 * 32  # s_l^2 / 2 scores x 2 GEMMs x 2 FLOPs x B x d
    fwd = [("f", "send", chunk), ("f", "recv", chunk), ("f", "fused_attention", step)]
    # TE's backward kernel recomputes the scores: 2.5 x the forward's FLOPs, as lowering_te has it
    bwd = lambda n: [("b", "send", n * chunk), ("b", "recv", n * chunk),
                     ("b", "fused_attention_backward", 5 * step // 2)]
    assert _summary(nodes) == [
        ("f", "mm", 0), *fwd * 3, ("f", "fused_attention", step), ("f", "mm", 0),
        ("b", "mm", 0), *bwd(1), *bwd(2), *bwd(2), *bwd(1), ("b", "mm", 0)]
    collectives = [n for n in nodes if isinstance(n, CollectiveNode)]
    assert all(c.synthesized and c.group is ParallelGroup.CP and c.group_size == 4 and c.module == CORE
               for c in collectives)
    kernels = [n for n in nodes if isinstance(n, OpNode) and "fused_attention" in n.op]
    # step 0: the local block under the causal mask; later steps: rank 0's later half of its
    # queries against a whole remote chunk; operands [s, B, d]
    assert kernels[0].key.input_shapes == ((32, 4, 32), (32, 1, 32), (32, 1, 32))
    assert kernels[1].key.input_shapes == ((16, 4, 32), (32, 1, 32), (32, 1, 32))
    # bf16 Q, K, V read and O written, plus the fp32 log-sum-exp of each query row and head
    assert kernels[0].nbytes == 2 * (2 * 4 * 32 * 32 + 2 * 1 * 32 * 32) + 4 * 4 * 32
    assert kernels[-1].nbytes == 2 * (4 * 4 * 16 * 32 + 4 * 1 * 32 * 32) + 4 * 4 * 16
    # forward: its s/cp = 32 queries against all 128 keys, the causal half
    assert sum(k.flops for k in kernels if k.phase is Phase.FORWARD) == 4 * 4 * 32 * 128 * 32 // 2


def test_all_gather_attention_gathers_kv_and_reduce_scatters_their_gradients():
    cp = ContextParallel(size=4, comm_type=CpCommType.ALL_GATHER, kv_heads_per_head=Fraction(1, 4))
    gathered = 4 * 2 * 1 * 32 * 32 * 2
    total = 4 * 4 * 32 * 128 * 32 // 2
    assert _summary(cp.layer_nodes(_layer_nodes())) == [
        ("f", "mm", 0), ("f", "all_gather", gathered), ("f", "fused_attention", total), ("f", "mm", 0),
        ("b", "mm", 0), ("b", "all_gather", gathered), ("b", "fused_attention_backward", 5 * total // 2),
        ("b", "reduce_scatter", gathered), ("b", "mm", 0)]


def test_model_flops_count_the_core_attention_against_every_cp_ranks_keys():
    cp = ContextParallel(size=4, comm_type=CpCommType.P2P, kv_heads_per_head=Fraction(1, 4))
    qkv = OpNode(key=SCORES.key, phase=Phase.FORWARD, module=f"{LAYER}.self_attention.linear_qkv", flops=1000)
    assert cp.model_flops(SCORES) == 4 * SCORES.flops and cp.model_flops(qkv) == 1000


def test_context_parallelism_runs_transformer_engine():
    plan = ParallelPlan(context_parallel=2)
    fp16_gpt = ModelSpec(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=96, dtype="fp16")
    training = TrainingSpec(global_batch_size=8)
    assert training.stack_for(fp16_gpt, "ampere") is SoftwareStack.MEGATRON_DEEPSPEED_2023
    assert training.stack_for(fp16_gpt, "ampere", plan) is SoftwareStack.MEGATRON_CORE_TE
    with pytest.raises(ConfigError, match=r"^parallel.context_parallel 2 needs training.software_stack "
                                          r"megatron_core_te \(got local_spec\): megatron-core runs "
                                          r"context-parallel attention only through TransformerEngine$"):
        TrainingSpec(global_batch_size=8, software_stack="local_spec").check_plan(plan)


def test_a_layer_without_a_traced_score_gemm_is_refused():
    from vtrain_plugin.core.errors import TraceError

    cp = ContextParallel(size=2, comm_type=CpCommType.P2P, kv_heads_per_head=Fraction(1))
    with pytest.raises(TraceError, match="no score GEMM \\(baddbmm\\) traced in the forward of "):
        cp.layer_nodes((_op("bmm", Phase.FORWARD, CORE),))
    plain = (_op("mm", Phase.FORWARD, f"{LAYER}.mlp.linear_fc1"),)
    assert cp.layer_nodes(plain) == plain


def test_gradients_are_reduced_over_data_and_context_parallel_ranks():
    stage = StageGraph(pipeline_rank=0, blocks=(Block(kind=BlockKind.LAYER, name=LAYER, num_parameters=1000),))
    plan = ParallelPlan(context_parallel=4, data_parallel=2)
    runtime = runtime_collectives(stage, plan, dtype=Dtype.BF16, tied_embeddings=False)
    (grads,) = runtime.nodes(stage)
    assert (grads.group, grads.group_size, grads.nbytes) == (ParallelGroup.DP, 8, 4000)  # fp32 gradients
    alone = runtime_collectives(stage, ParallelPlan(context_parallel=2), dtype=Dtype.BF16, tied_embeddings=False)
    assert alone.dp_grad_nbytes == (4000,)  # DP 1, CP 2: the two CP ranks still share their gradients


def test_the_distributed_optimizer_shards_over_data_and_context_parallel_ranks():
    stage = StageGraph(pipeline_rank=0, blocks=(Block(kind=BlockKind.LAYER, name=LAYER, num_parameters=2**30),))
    graph = OpGraph(model=None, parallel=ParallelPlan(context_parallel=4, data_parallel=2), micro_batch_size=1,
                    seq_length=96, stages=(stage,))
    (whole,) = rank_memory(graph, lambda rank, chunks, rises: (0, 1))
    (sharded,) = rank_memory(graph, lambda rank, chunks, rises: (0, 1), distributed_optimizer=True)
    assert sharded.optimizer_gib == whole.optimizer_gib / 8 and sharded.weights_gib == whole.weights_gib


# -- exposed time of a ring step --------------------------------------------------------------------

KERNEL = OpNode(key=KernelKey(op="te.fused_attention.default", input_shapes=((4, 32, 32),), dtypes=("bfloat16",)),
                phase=Phase.FORWARD, module=CORE, flops=1)


def _ring_step_cost(kernel_ns: float, nbytes: int, comm_type: str = "p2p"):
    send = CollectiveNode(kind=CollectiveKind.SEND, nbytes=nbytes, group=ParallelGroup.CP, group_size=2,
                          phase=Phase.FORWARD, module=CORE, synthesized=True)
    recv = CollectiveNode(kind=CollectiveKind.RECV, nbytes=nbytes, group=ParallelGroup.CP, group_size=2,
                          phase=Phase.FORWARD, module=CORE, synthesized=True)
    plan = ParallelPlan(tensor_parallel=2, context_parallel=2, cp_comm_type=comm_type)
    chunk, comm = cost_one_layer((send, recv, KERNEL), plan, "megatron_core_te", {KERNEL.key: kernel_ns},
                                 seq_length=64)
    return chunk, comm.time_ns(CollectiveKind.SEND, nbytes, ParallelGroup.CP)


def test_a_ring_step_hides_its_send_behind_its_attention_kernel():
    chunk, send_ns = _ring_step_cost(kernel_ns=1e6, nbytes=1_000_000)
    assert send_ns < 1e6 and chunk.cp_comm_forward_ns == 0.0 and chunk.tp_comm_forward_ns == 0.0
    chunk, send_ns = _ring_step_cost(kernel_ns=1000.0, nbytes=100_000_000)
    assert send_ns > 1000.0 and chunk.cp_comm_forward_ns == send_ns - 1000.0
