"""Exact arithmetic of costing: host/device segment pipelines, DP gradient buckets, memory per rank."""

import numpy as np
import pytest

from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.cost.comm.collectives import CommModel
from vtrain_plugin.cost.comm.dp_buckets import BlockGradients, dp_buckets
from vtrain_plugin.cost.kernels.host_device import Segment, SegmentTime, segment_times, sequence
from vtrain_plugin.core.graph import Block, BlockKind, CollectiveKind, OpGraph, ParallelGroup, Phase, StageGraph
from vtrain_plugin.cost.memory import FRAGMENTATION, RESERVED_GIB, rank_memory
from vtrain_plugin.sim.schedules import build_schedule
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

GIB = 2**30


def _segments(*bounds):
    return [Segment(block=i, phase=Phase.FORWARD, start=a, stop=b, count=1) for i, (a, b) in enumerate(bounds)]


def test_segment_host_device_and_pipelined_times_are_exact():
    host = np.array([1.0, 2.0, 3.0, 4.0])
    device = np.array([5.0, 1.0, 1.0, 5.0])
    h, d, p = segment_times(host, device, _segments((0, 2), (2, 4), (4, 4)))
    # P = max_k (host up to k + device from k): [1+6, 3+1] -> 7 and [3+6, 7+5] -> 12
    assert h.tolist() == [3.0, 7.0, 0.0]
    assert d.tolist() == [6.0, 6.0, 0.0]
    assert p.tolist() == [7.0, 12.0, 0.0]


def test_repeated_segments_in_sequence_are_exact():
    # two repetitions of (H 3, D 6, P 7): P + (n-1) max(H, D) = 13, then (H 7, D 6, P 12) once:
    # max(13 + 6, 6 + 12) = 19; empty segments add nothing
    parts = [SegmentTime(3.0, 6.0, 7.0, 2), SegmentTime(0.0, 0.0, 0.0, 5), SegmentTime(7.0, 6.0, 12.0, 1)]
    assert sequence(parts) == 19.0
    assert sequence([]) == 0.0


@pytest.fixture
def comm():
    plan = ParallelPlan(tensor_parallel=1, pipeline_parallel=1, data_parallel=8)
    return CommModel.for_plan(get_cluster_preset("dgx-h100"), plan)


def test_gradients_reduce_in_one_message_after_backward(comm):
    training = TrainingSpec(global_batch_size=8)
    blocks = [BlockGradients(2.0, 10_000_000, 1), BlockGradients(1.0, 30_000_000, 3)]
    (bucket,) = dp_buckets(blocks, comm, training, 0, grad_nbytes=4)
    assert bucket.ready_fraction == 1.0
    assert bucket.comm_ns == comm.time_ns(CollectiveKind.ALL_REDUCE, 100_000_000, ParallelGroup.DP)


def test_overlapped_buckets_fill_in_backward_order_and_are_ready_when_full(comm):
    training = TrainingSpec(global_batch_size=8, grad_reduce="overlap", bucket_size_mb=50)
    blocks = [BlockGradients(2.0, 10_000_000, 1), BlockGradients(1.0, 30_000_000, 3)]  # embedding, 3 x 30 MB layers
    buckets = dp_buckets(blocks, comm, training, 0, grad_nbytes=4)
    # backward: layer (30 MB, t=1), layer (60 MB >= 50: bucket at 2/5), layer (30 MB), embedding
    # (40 MB at t=5): the rest goes at the end
    assert [b.ready_fraction for b in buckets] == [0.4, 1.0]
    assert [b.comm_ns for b in buckets] == [comm.time_ns(CollectiveKind.ALL_REDUCE, n, ParallelGroup.DP)
                                           for n in (60_000_000, 40_000_000)]


def test_memory_per_rank_is_model_states_plus_activations_in_flight():
    def stage(rank, params, activation):
        block = Block(kind=BlockKind.LAYER, name="decoder.layers.0", count=2, activation_nbytes=activation,
                      num_parameters=params // 2)
        return StageGraph(pipeline_rank=rank, blocks=(block,))

    model = ModelSpec(num_layers=4, hidden_size=8, num_attention_heads=1, seq_length=8, dtype="fp16")
    graph = OpGraph(model=model, parallel=ParallelPlan(pipeline_parallel=2), micro_batch_size=1, seq_length=8,
                    stages=(stage(0, GIB, 3 * GIB), stage(1, 2 * GIB, GIB)))
    schedule = build_schedule("1f1b", 2, 1, 4)
    first, second = rank_memory(graph, schedule.peak_live)
    # fp16 weights and gradients (2 bytes each), fp32 main weights and two Adam moments (12 bytes)
    assert (first.weights_gib, first.gradients_gib, first.optimizer_gib) == (2.0, 2.0, 12.0)
    assert (second.weights_gib, second.gradients_gib, second.optimizer_gib) == (4.0, 4.0, 24.0)
    # 1F1B keeps pp - rank micro-batches: 2 x (2 layers x 3 GiB) and 1 x (2 layers x 1 GiB)
    assert (first.inflight_microbatches, first.activations_gib) == (2, 12.0)
    assert (second.inflight_microbatches, second.activations_gib) == (1, 2.0)
    assert first.tensors_gib == 28.0
    assert first.allowance_gib == RESERVED_GIB + FRAGMENTATION * 28.0
    assert first.total_gib == first.tensors_gib + first.allowance_gib


def test_module_and_layer_host_work_falls_before_the_first_kernel_of_each_call():
    from vtrain_plugin.core.graph import KernelKey, OpNode
    from vtrain_plugin.cost.prepare import host_calls

    def op(module, phase):
        return OpNode(key=KernelKey(op="aten.mm.default", input_shapes=((2, 2), (2, 2)), dtypes=("fp16", "fp16")),
                      phase=phase, module=module)

    f, b, o = Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER
    nodes = [op("emb", f), op("l.qkv", f), op("l.qkv", f), None, op("l", f), op("l.qkv", f), op("l.fc", f),
             op("l.fc", b), op("l.qkv", b), op("l", o), op("l", o)]
    segments = [Segment(block=0, phase=f, start=0, stop=1, count=1),
                Segment(block=1, phase=f, start=1, stop=7, count=3),
                Segment(block=1, phase=b, start=7, stop=9, count=3),
                Segment(block=1, phase=o, start=9, stop=11, count=3)]
    blocks = (Block(kind=BlockKind.EMBEDDING, name="emb", nodes=()), Block(kind=BlockKind.LAYER, name="l", nodes=()))
    modules, layers = host_calls(nodes, segments, blocks)
    # one call per distinct module per segment, at its first kernel; no module calls in the optimizer
    assert modules.tolist() == [1, 1, 0, 0, 1, 0, 1, 1, 1, 0, 0]
    # one layer entry per forward / backward segment of a layer block, none for the embedding
    assert layers.tolist() == [0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0]


def test_bf16_gradients_are_fp32_and_the_distributed_optimizer_shards_the_optimizer_state():
    block = Block(kind=BlockKind.LAYER, name="decoder.layers.0", count=1, num_parameters=GIB)
    model = ModelSpec(num_layers=1, hidden_size=8, num_attention_heads=1, seq_length=8, dtype="bf16")
    graph = OpGraph(model=model, parallel=ParallelPlan(data_parallel=4), micro_batch_size=1, seq_length=8,
                    stages=(StageGraph(pipeline_rank=0, blocks=(block,)),))
    peak = build_schedule("1f1b", 1, 1, 1).peak_live
    (plain,) = rank_memory(graph, peak)
    (zero,) = rank_memory(graph, peak, distributed_optimizer=True)
    # Megatron-LM's theoretical_memory_usage: 18 bytes per parameter, 6 + 12 / DP with the distributed optimizer
    assert (plain.weights_gib, plain.gradients_gib, plain.optimizer_gib) == (2.0, 4.0, 12.0)
    assert (zero.weights_gib, zero.gradients_gib, zero.optimizer_gib) == (2.0, 4.0, 3.0)


def test_interleaved_peak_walks_the_schedule_with_each_chunks_activations():
    # pp 2, vp 2, 4 micro-batches. Rank 0 runs F(c0 0, 1) F(c1 0, 1) F(c0 2) B(c1 0) F(c0 3) ...:
    # at most 5 (chunk, micro-batch) pairs, and right after F(c0 3) 4 of chunk 0 and 1 of chunk 1.
    # Rank 1 runs F(c0 0, 1) F(c1 0) B(c1 0) ...: never more than one chunk-1 pair.
    schedule = build_schedule("interleaved_1f1b", 2, 2, 4)
    assert schedule.peak_live(0, [7, 7]) == (5 * 7, 5)
    assert schedule.peak_live(0, [100, 1]) == (4 * 100 + 1, 5)
    assert schedule.peak_live(1, [0, 10]) == (10, 3)


def test_each_backward_rises_above_the_level_it_starts_from():
    # the same schedule; a chunk's backward rise counts at its start, beside what is held then
    schedule = build_schedule("interleaved_1f1b", 2, 2, 4)
    # rank 0: B(c1 1) starts right after F(c0 3), with 4 chunk-0 pairs and one chunk-1 pair held
    assert schedule.peak_live(0, [100, 1], [0, 1000]) == (4 * 100 + 1 + 1000, 5)
    # rank 1: B(c0 0) starts once both chunk-1 pairs are gone, with three chunk-0 pairs of 0 bytes
    assert schedule.peak_live(1, [0, 10], [50, 0]) == (50, 3)
    # alike chunks: the peak level, which a backward starts from, plus the rise
    assert schedule.peak_live(0, [7, 7], [3, 3]) == (5 * 7 + 3, 5)
    assert build_schedule("1f1b", 4, 1, 8).peak_live(1, [7], [3]) == (3 * 7 + 3, 3)


def test_distributed_optimizer_runs_each_parameter_kernel_on_its_shard():
    from vtrain_plugin.core.graph import KernelKey, OpNode
    from vtrain_plugin.cost.comm.optimizer_shard import shard_optimizer

    def op(shapes, phase=Phase.OPTIMIZER, nbytes=0):
        return OpNode(key=KernelKey(op="aten.addcmul_.default", input_shapes=shapes, dtypes=("float32",) * len(shapes)),
                      phase=phase, module="decoder.layers.0.mlp.linear_fc1", output_shapes=shapes[:1], nbytes=nbytes)

    adam = op(((1000, 10), (1000, 10), (1000, 10)), nbytes=3 * 4 * 10_000 + 4 * 10_000)
    scalar = op(((), (1,)))
    forward = op(((1000, 10), (1000, 10)), phase=Phase.FORWARD)
    sharded, same_scalar, same_forward = shard_optimizer([adam, scalar, forward], 3)
    # ceil(10,000 / 3) = 3,334 elements of each parameter-sized operand, bytes scaled alike
    assert sharded.key.input_shapes == ((3334,),) * 3 and sharded.output_shapes == ((3334,),)
    assert sharded.nbytes == 160_000 * 3334 // 10_000
    assert (same_scalar, same_forward) == (scalar, forward)
    assert shard_optimizer([adam], 1) == (adam,)


@pytest.mark.parametrize("pipeline", [1, 2])
def test_the_iteration_overhead_is_paid_once_per_iteration_on_every_pipeline_rank(pipeline):
    """Added to each rank's optimizer step, after which the iteration ends: exactly once."""
    from dataclasses import replace

    from vtrain_plugin.capture.tracer import trace
    from vtrain_plugin.cost.prepare import prepare_run
    from vtrain_plugin.estimate import predict
    from vtrain_plugin.hardware.calibration import calibration_for

    model = ModelSpec(name="tiny", num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=256,
                      vocab_size=1024, dtype="bf16")
    plan = ParallelPlan(pipeline_parallel=pipeline, data_parallel=8 // pipeline, micro_batch_size=1)
    training = TrainingSpec(global_batch_size=16, software_stack="megatron_core_te")
    prepared = prepare_run(trace(model, plan), training.software_stack, training)
    cluster = get_cluster_preset("dgx-h100")
    base = calibration_for("h100-sxm", "megatron_core_te").constants
    for factor in (1.0, 1.5):  # a slower host CPU stretches it with every other host cost
        times = [predict(prepared, cluster=cluster, training=training,
                         constants=replace(base, iteration_overhead_ns=value, host_time_factor=factor))[1].iteration_ns
                 for value in (1e6, 4e6)]
        assert times[1] - times[0] == pytest.approx(3e6 * factor, rel=1e-9)


def test_the_host_time_factor_scales_the_host_cost_of_every_kernel():
    from dataclasses import replace

    from vtrain_plugin.core.graph import KernelKey, OpNode
    from vtrain_plugin.cost.kernels.model import KernelBatch, KernelModel
    from vtrain_plugin.hardware.calibration import calibration_for
    from vtrain_plugin.hardware.devices import get_device

    base = calibration_for("a100-sxm4-80gb", "megatron_core_te").constants
    nodes = [OpNode(key=KernelKey(op="aten.mm.default", input_shapes=((64, 64), (64, 64)), dtypes=("bf16", "bf16")),
                    phase=phase, module="m") for phase in (Phase.FORWARD, Phase.BACKWARD)]
    batch = KernelBatch.of(nodes)
    one = KernelModel(get_device("a100-sxm4-80gb"), replace(base, host_time_factor=1.0))
    slow = KernelModel(get_device("a100-sxm4-80gb"), replace(base, host_time_factor=1.25))
    assert slow.host_ns_batch(batch).tolist() == pytest.approx((1.25 * one.host_ns_batch(batch)).tolist(), rel=1e-12)
    assert slow.device_ns(batch).tolist() == one.device_ns(batch).tolist()
