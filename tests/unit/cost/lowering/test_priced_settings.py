"""Settings NVIDIA's functional tests use, priced rather than refused: the optimizers' state bytes and
step, deterministic mode's kernels and NCCL ring, the tp-pp-dp rank order (exact arithmetic on
hand-built nodes), and their directions on a traced megatron-core model."""

from dataclasses import replace

import pytest

import vtrain_plugin as vtrain
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import CollectiveKind, CollectiveNode, KernelKey, OpNode, ParallelGroup, Phase
from vtrain_plugin.cost.comm.collectives import CommModel
from vtrain_plugin.cost.comm.topology import GroupPlacement, Layout
from vtrain_plugin.cost.lowering.deterministic import DETERMINISTIC_ATTENTION_BACKWARD, deterministic_kernels
from vtrain_plugin.cost.lowering.optimizer_step import newton_schulz_flops, optimizer_step
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.optimizer import OptimizerSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec


# -- optimizer state and step bytes ------------------------------------------------------------------

@pytest.mark.parametrize("spec, state_2_byte_model, matrix, step", [
    (OptimizerSpec(), 12, 12, 28),  # fp32 main weights and moments; read g, p, m, v, write p, m, v
    (OptimizerSpec(kind="sgd"), 8, 8, 28),  # main weights + one fp32 momentum
    (OptimizerSpec(kind="muon"), 12, 8, 28),  # matrices: momentum only; the rest: Adam
    # precision-aware: 16-bit remainders of the fp32 main weights, bf16 moments: 2 + 2 + 2
    (OptimizerSpec(precision_aware=True, exp_avg="bf16", exp_avg_sq="bf16"), 6, 6, 4 + 2 * (4 + 2 + 2)),
    (OptimizerSpec(precision_aware=True, main_params="fp16", exp_avg="fp8", exp_avg_sq="bf16",
                   main_grads="bf16"), 2 + 1 + 2, 5, 2 + 2 * (2 + 1 + 2)),
])
def test_optimizer_state_and_step_bytes_per_parameter(spec, state_2_byte_model, matrix, step):
    assert spec.state_nbytes(2, matrix=False) == state_2_byte_model
    assert spec.state_nbytes(2, matrix=True) == matrix
    assert spec.adam_step_nbytes() == step
    # an fp32 model has no main copy
    assert spec.state_nbytes(4, matrix=False) == state_2_byte_model - spec.main_param_nbytes(2)


def test_state_dtypes_need_the_precision_aware_optimizer_in_one_line():
    with pytest.raises(ConfigError, match=r"^training.optimizer.exp_avg bf16 requires "
                                          r"training.optimizer.precision_aware \(megatron-core keeps"):
        OptimizerSpec(exp_avg="bf16")
    with pytest.raises(ConfigError, match=r"^training.optimizer.precision_aware requires training.distributed_"):
        TrainingSpec(global_batch_size=8, optimizer={"precision_aware": True})


LAYER = "decoder.layers.0"


def _norm(module: str, shape: tuple[int, ...]) -> OpNode:
    return OpNode(key=KernelKey(op="aten.linalg_vector_norm.default", input_shapes=(shape,), dtypes=("float32",)),
                  phase=Phase.OPTIMIZER, module=module)


def _adam_pass(numel: int) -> OpNode:
    return OpNode(key=KernelKey(op="te.multi_tensor_adam.default", input_shapes=((numel,),), dtypes=("float32",)),
                  phase=Phase.OPTIMIZER, module=f"{LAYER}.mlp.linear_fc2", output_shapes=((numel,),),
                  nbytes=28 * numel)


def test_newton_schulz_flops_are_three_gemms_per_step():
    m, n = 128, 512  # X Xᵀ: 2 m² n, A A: 2 m³, B X: 2 m² n
    assert newton_schulz_flops(512, 128, 5) == 5 * (2 * m * m * n + 2 * m ** 3 + 2 * m * m * n)


def test_muon_steps_matrices_with_newton_schulz_and_the_rest_with_adam():
    traced = [_norm(f"{LAYER}.input_layernorm", (256,)), _norm(f"{LAYER}.self_attention.linear_proj", (256, 128)),
              _norm(f"{LAYER}.mlp.linear_fc1", (512, 256))]
    count = 256 + 256 * 128 + 512 * 256
    out = optimizer_step([_adam_pass(count)], OptimizerSpec(kind="muon", muon_ns_steps=3), traced=traced,
                         tensor_parallel=2, expert_tensor_parallel=2, shards=1, expert_shards=1)
    passes = [n for n in out if isinstance(n, OpNode) and "multi_tensor" in n.op]
    assert [(n.op, n.nbytes) for n in passes] == [("te.multi_tensor_adam.default", 28 * 256),
                                                  ("te.multi_tensor_sgd.default", 20 * (count - 256))]
    gathers = [n for n in out if isinstance(n, CollectiveNode)]
    # TP 2: linear_proj is row-parallel (whole: 256 x 256), fc1 column-parallel (whole: 1024 x 256), fp32
    assert [(g.kind, g.group, g.nbytes) for g in gathers] == [
        (CollectiveKind.ALL_GATHER, ParallelGroup.TP, 4 * 256 * 256), (CollectiveKind.ALL_GATHER, ParallelGroup.TP,
                                                                       4 * 1024 * 256)]
    gemms = [n for n in out if isinstance(n, OpNode) and n.op == "aten.mm.default"]
    assert len(gemms) == 2 * 3 * 3
    assert sum(g.flops for g in gemms) == newton_schulz_flops(256, 256, 3) + newton_schulz_flops(1024, 256, 3)
    halved = optimizer_step([_adam_pass(count // 2)], OptimizerSpec(kind="muon", muon_ns_steps=3), traced=traced,
                            tensor_parallel=2, expert_tensor_parallel=2, shards=2, expert_shards=2)
    assert sum(n.flops for n in halved if isinstance(n, OpNode) and n.op == "aten.mm.default") == sum(
        g.flops // 2 for g in gemms)  # the layer-wise distributed optimizer: each DP rank steps half the weights


def test_fp32_adam_leaves_the_step_as_lowered_and_sgd_moves_20_bytes():
    adam = _adam_pass(1000)
    assert optimizer_step([adam], OptimizerSpec(), traced=[], tensor_parallel=1, expert_tensor_parallel=1, shards=1,
                          expert_shards=1) == (adam,)
    (sgd,) = optimizer_step([adam], OptimizerSpec(kind="sgd"), traced=[], tensor_parallel=1, expert_tensor_parallel=1,
                            shards=1, expert_shards=1)
    assert (sgd.op, sgd.nbytes) == ("te.multi_tensor_sgd.default", 20 * 1000)


# -- deterministic mode ------------------------------------------------------------------------------

def test_deterministic_attention_backward_costs_more_flops_under_a_key_of_its_own():
    key = KernelKey(op="te.fused_attention_backward.default", input_shapes=((64, 4, 32),), dtypes=("bfloat16",))
    node = OpNode(key=key, phase=Phase.BACKWARD, module=f"{LAYER}.self_attention.core_attention", flops=1000,
                  nbytes=50)
    (det,) = deterministic_kernels([node])
    assert det.flops == 1100 == round(1000 * DETERMINISTIC_ATTENTION_BACKWARD) and det.nbytes == 50
    assert det.key != key and dict(det.key.args)["deterministic"] is True


def test_ring_only_nccl_never_takes_the_tree():
    cluster = ClusterSpec(gpu="h100-sxm", gpus_per_node=8, intra_node_bandwidth_gbytes_per_s=100.0,
                          intra_node_latency_us=2.0, inter_node_bandwidth_gbps=400.0, inter_node_latency_us=5.0)
    free = CommModel(cluster=cluster, tensor_parallel=1, pipeline_parallel=1, data_parallel=64)
    ring = replace(free, ring_only=True)
    small = 4096  # latency-bound: the tree's 2 log2(8) network steps beat the ring's 2 x 7
    assert ring.time_ns(CollectiveKind.ALL_REDUCE, small, ParallelGroup.DP) > free.time_ns(
        CollectiveKind.ALL_REDUCE, small, ParallelGroup.DP)
    n = 64  # ring: 2(n-1)/n S / B (one NIC share per GPU of the node) + 2(n-1) steps, 2 x 7 of them network
    nic = 400e9 / 8 / 8 / 1e9
    expected = 2 * (n - 1) / n * small / min(100.0, 8 * nic) + (2 * 63 - 14) * 2000 + 14 * 5000
    assert ring.time_ns(CollectiveKind.ALL_REDUCE, small, ParallelGroup.DP) == pytest.approx(expected)


# -- the tp-pp-dp rank order -------------------------------------------------------------------------

def test_tp_pp_dp_mapping_puts_pipeline_stages_together_and_data_parallel_peers_apart():
    default = Layout(tensor_parallel=2, pipeline_parallel=4, data_parallel=2, gpus_per_node=8)
    mapped = replace(default, tp_pp_dp_mapping=True)
    assert default.placement(ParallelGroup.DP) == GroupPlacement(size=2, num_nodes=1, gpus_per_node=2,
                                                                 max_gpus_per_node=2)  # ranks 0, 2
    assert mapped.placement(ParallelGroup.DP) == GroupPlacement(size=2, num_nodes=2, gpus_per_node=1,
                                                                max_gpus_per_node=1)  # ranks 0, 8
    assert default.p2p_crosses_nodes(1) and not mapped.p2p_crosses_nodes(1)  # rank 4 -> 8 / rank 2 -> 4
    # with CP the gradient group (CP x DP) is two progressions: ranks 0, 1 (CP) and 4, 5 (DP): 2 nodes of 4 GPUs
    grid = Layout(tensor_parallel=1, context_parallel=2, pipeline_parallel=2, data_parallel=2, gpus_per_node=4,
                  tp_pp_dp_mapping=True)
    assert grid.placement(ParallelGroup.DP) == GroupPlacement(size=4, num_nodes=2, gpus_per_node=2,
                                                              max_gpus_per_node=2)


# -- directions on a traced megatron-core model ------------------------------------------------------

@pytest.fixture(scope="module")
def traced():
    model = ModelSpec(family="llama", num_layers=1, hidden_size=1024, num_attention_heads=8, seq_length=4096,
                      vocab_size=1024, dtype="bf16")
    # micro-batch 8: the device, not the host, bounds the layer, so slower kernels show
    return vtrain.trace(model, ParallelPlan(tensor_parallel=1, data_parallel=2, micro_batch_size=8))


def _estimate(graph, **fields):
    training = TrainingSpec(**{"global_batch_size": 16, "software_stack": "megatron_core_te",
                               "distributed_optimizer": True, **fields})
    return vtrain.estimate(graph, cluster=get_cluster_preset("dgx-h100"), training=training, profile_db=False)


def test_ablations_move_time_and_memory_the_expected_way(traced):
    base = _estimate(traced)
    deterministic = _estimate(traced, deterministic=True)
    assert deterministic.iteration_time_ms > base.iteration_time_ms
    assert any(line.startswith("deterministic mode") and "not validated" in line for line in deterministic.assumptions)
    unfused = _estimate(traced, unfused_attention=True)  # s x s scores kept for backward at 4096 tokens
    assert unfused.memory_gib[0].activations_gib > base.memory_gib[0].activations_gib
    muon = _estimate(traced, optimizer=OptimizerSpec(kind="muon"))
    assert muon.breakdown_ms["optimizer"] > base.breakdown_ms["optimizer"]
    # one momentum instead of two moments on the matrices, compared unsharded (under the distributed
    # optimizer Muon deals whole parameters to the ranks, not even shards)
    unsharded = {"distributed_optimizer": False}
    assert (_estimate(traced, optimizer=OptimizerSpec(kind="muon"), **unsharded).memory_gib[0].optimizer_gib
            < _estimate(traced, **unsharded).memory_gib[0].optimizer_gib)
    bf16 = _estimate(traced, optimizer=OptimizerSpec(precision_aware=True, exp_avg="bf16", exp_avg_sq="bf16"))
    assert bf16.memory_gib[0].optimizer_gib < base.memory_gib[0].optimizer_gib
    assert bf16.breakdown_ms["optimizer"] < base.breakdown_ms["optimizer"]
