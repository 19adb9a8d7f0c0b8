"""Exact arithmetic of costing: host/device segment pipelines, DP gradient buckets, memory per rank."""

import numpy as np
import pytest

from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.cost.comm import CommModel
from vtrain_plugin.cost.dp_buckets import BlockGradients, dp_buckets
from vtrain_plugin.cost.host_device import Segment, SegmentTime, segment_times, sequence
from vtrain_plugin.core.graph import Block, BlockKind, CollectiveKind, OpGraph, ParallelGroup, Phase, StageGraph
from vtrain_plugin.cost.memory import rank_memory
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
    (bucket,) = dp_buckets(blocks, comm, training, 0)
    assert bucket.ready_fraction == 1.0
    assert bucket.comm_ns == comm.time_ns(CollectiveKind.ALL_REDUCE, 100_000_000, ParallelGroup.DP)


def test_overlapped_buckets_fill_in_backward_order_and_are_ready_when_full(comm):
    training = TrainingSpec(global_batch_size=8, grad_reduce="overlap", bucket_size_mb=50)
    blocks = [BlockGradients(2.0, 10_000_000, 1), BlockGradients(1.0, 30_000_000, 3)]  # embedding, 3 x 30 MB layers
    buckets = dp_buckets(blocks, comm, training, 0)
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
    first, second = rank_memory(graph, [schedule.peak_inflight(r) for r in range(2)])
    # fp16 weights and gradients (2 bytes each), fp32 main weights and two Adam moments (12 bytes)
    assert (first.weights_gib, first.gradients_gib, first.optimizer_gib) == (2.0, 2.0, 12.0)
    assert (second.weights_gib, second.gradients_gib, second.optimizer_gib) == (4.0, 4.0, 24.0)
    # 1F1B keeps pp - rank micro-batches: 2 x (2 layers x 3 GiB) and 1 x (2 layers x 1 GiB)
    assert (first.inflight_microbatches, first.activations_gib) == (2, 12.0)
    assert (second.inflight_microbatches, second.activations_gib) == (1, 2.0)
    assert first.total_gib == 28.0


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
