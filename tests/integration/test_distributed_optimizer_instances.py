"""The distributed optimizer in several instances (megatron-core's partial distributed optimizer):
optimizer state sharded over DP / N, reduce-scatter and all-gather inside an instance, the reduced
shard all-reduced across instances, on a tiny traced megatron-core GPT."""

import json
from dataclasses import replace

import pytest

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.graph import CollectiveKind, ParallelGroup
from vtrain_plugin.core.units import GIB
from vtrain_plugin.cost.comm.collectives import CommModel
from vtrain_plugin.cost.comm.dp_buckets import ZeroRuntime, zero_layout
from vtrain_plugin.cost.comm.runtime_collectives import runtime_collectives
from vtrain_plugin.cost.comm.topology import Layout
from vtrain_plugin.cost.costing import cost
from vtrain_plugin.cost.kernels.timer import KernelTimer
from vtrain_plugin.cost.prepare import prepare
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.calibration import calibration_for
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

GPT = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128, dtype="bf16")
PLAN = ParallelPlan(data_parallel=16, distributed_optimizer_instances=2)  # two DGX H100 nodes, an instance on each
TRAINING = TrainingSpec(global_batch_size=32, distributed_optimizer=True, grad_reduce="overlap")
CLUSTER = get_cluster_preset("dgx-h100")


@pytest.fixture(scope="module")
def graph():
    return trace(GPT, PLAN)


def test_instances_are_consecutive_data_parallel_ranks():
    layout = Layout(tensor_parallel=2, pipeline_parallel=1, data_parallel=8, gpus_per_node=8, optimizer_instances=2)
    # DP ranks 0, 2, ..., 14 (stride TP): the instance holds 0..6 (one node), the shard's peers are 0 and 8
    assert (layout.placement(ParallelGroup.DP_INTRA).size, layout.placement(ParallelGroup.DP_INTRA).num_nodes) == (4, 1)
    inter = layout.placement(ParallelGroup.DP_INTER)
    assert (inter.size, inter.num_nodes, inter.gpus_per_node) == (2, 2, 1)
    assert layout.placement(ParallelGroup.DP).num_nodes == 2


def test_optimizer_state_is_sharded_over_the_instance(graph):
    params = graph.stages[0].num_parameters
    for instances in (1, 2, 4):
        plan = replace(PLAN, distributed_optimizer_instances=instances)
        memory = estimate(replace(graph, parallel=plan), cluster=CLUSTER, training=TRAINING).memory_gib[0]
        # fp32 main weights and Adam's two moments of a bf16 model: 12 bytes, over the instance's ranks
        assert memory.optimizer_gib * GIB == pytest.approx(params * 12 / (16 // instances), rel=1e-12)


def test_collectives_reduce_scatter_in_the_instance_and_all_reduce_the_shard_across(graph):
    stage = graph.stages[0]
    runtime = runtime_collectives(stage, PLAN, dtype=GPT.dtype, tied_embeddings=True, distributed_optimizer=True)
    blocks = [block for block in stage.blocks if block.num_parameters]
    assert len(blocks) >= 3  # the embedding, a layer, the output layer
    for block in blocks:
        nodes = [n for n in runtime.nodes(stage) if n.module == block.name]
        grads = block.num_parameters * 4  # fp32 gradients of a bf16 model
        assert [(n.kind, n.group, n.group_size, n.nbytes) for n in nodes] == [
            (CollectiveKind.REDUCE_SCATTER, ParallelGroup.DP_INTRA, 8, grads),
            (CollectiveKind.ALL_REDUCE, ParallelGroup.DP_INTER, 2, grads // 8),
            (CollectiveKind.ALL_GATHER, ParallelGroup.DP_INTRA, 8, block.num_parameters * 2)]


def test_costing_adds_the_inter_instance_all_reduce_to_each_bucket(graph):
    comm = CommModel.for_plan(CLUSTER, PLAN)
    device = get_device(CLUSTER.gpu)
    stack = TRAINING.stack_for(GPT, device.architecture)
    prepared = prepare(graph, stack, distributed_optimizer=True)
    timer = KernelTimer(device, calibration_for(device.name, stack).constants)
    work = cost(prepared, timer=timer, comm=comm, training=TRAINING, num_microbatches=2).work
    stage = prepared.stages[0]
    numels = [n for block in stage.stage.blocks for _ in range(block.count) for n in block.parameter_sizes]
    zero = ZeroRuntime.of(stage.runtime, pipeline_rank=0, chunk=0)
    assert (zero.data_parallel, zero.shard_group_size) == (16, 8)
    (bucket,) = zero_layout(numels, TRAINING, zero)  # one bucket: padded to lcm(8, 128) elements
    assert bucket.numel % 128 == 0 and bucket.numel - sum(numels) < 128 + 64 * len(numels)
    reduce = (comm.time_ns(CollectiveKind.REDUCE_SCATTER, bucket.numel * 4, ParallelGroup.DP_INTRA)
              + comm.time_ns(CollectiveKind.ALL_REDUCE, bucket.numel // 8 * 4, ParallelGroup.DP_INTER))
    gather = comm.time_ns(CollectiveKind.ALL_GATHER, bucket.numel * 2, ParallelGroup.DP_INTRA)
    chunk = work.chunk(0, 0)
    assert [b.comm_ns for b in chunk.dp_buckets] == [reduce]
    assert [g.comm_ns for g in chunk.param_gathers] == [gather]


def test_more_instances_hold_more_optimizer_state_and_move_dp_traffic_off_the_network(graph):
    """Ablation: one instance shards over all 16 ranks across two nodes; two shard over the 8 of a
    node (NVLink) and all-reduce only an eighth of the gradients across nodes."""
    one = estimate(replace(graph, parallel=replace(PLAN, distributed_optimizer_instances=1)), cluster=CLUSTER,
                   training=TRAINING)
    two = estimate(graph, cluster=CLUSTER, training=TRAINING)
    assert two.memory_gib[0].optimizer_gib == pytest.approx(2 * one.memory_gib[0].optimizer_gib, rel=1e-12)
    comm = {n: CommModel.for_plan(CLUSTER, replace(PLAN, distributed_optimizer_instances=n)) for n in (1, 2)}
    grads = graph.stages[0].num_parameters * 4
    network_one = comm[1].time_ns(CollectiveKind.REDUCE_SCATTER, grads, ParallelGroup.DP)
    network_two = (comm[2].time_ns(CollectiveKind.REDUCE_SCATTER, grads, ParallelGroup.DP_INTRA)
                   + comm[2].time_ns(CollectiveKind.ALL_REDUCE, grads // 8, ParallelGroup.DP_INTER))
    assert network_two != network_one
    assert one.iteration_time_ms != two.iteration_time_ms


def test_instances_must_divide_the_data_parallel_group():
    with pytest.raises(Exception, match=r"parallel.distributed_optimizer_instances \(3\) must divide data_parallel "
                                        r"\* context_parallel \(16\)"):
        replace(PLAN, distributed_optimizer_instances=3)


def test_cli_estimate_with_two_instances(run_cli):
    flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
             "--micro-batch-size 1 --global-batch-size 16 --vocab-size 128 --bf16 --use-distributed-optimizer "
             "--num-distributed-optimizer-instances 2")
    args = ("estimate", "--megatron-args", flags, "--gpu", "H100", "--gpus", "8", "--format", "json", "--no-db")
    two = json.loads(run_cli(*args, check=True).stdout)
    one = json.loads(run_cli(*args[:2], flags.replace("instances 2", "instances 1"), *args[3:], check=True).stdout)
    optimizer = [m["optimizer"] for m in (one["memory_gib_per_stage"][0], two["memory_gib_per_stage"][0])]
    assert optimizer[1] == pytest.approx(2 * optimizer[0], rel=1e-9)
    refused = run_cli(*args[:2], flags.replace("instances 2", "instances 3"), *args[3:])
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "distributed_optimizer_instances (3) must divide" in refused.stderr
