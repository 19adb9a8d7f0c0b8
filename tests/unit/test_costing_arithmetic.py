"""Exact arithmetic of costing: host/device segment pipelines, DP gradient buckets, memory per rank."""

import numpy as np
import pytest

from vtrain_plugin.cluster import get_cluster_preset
from vtrain_plugin.comm.model import CommModel
from vtrain_plugin.costing import _dp_buckets, _segment_times, _sequence, _Segment
from vtrain_plugin.graph import Block, BlockKind, CollectiveKind, OpGraph, ParallelGroup, Phase, StageGraph
from vtrain_plugin.memory import rank_memory
from vtrain_plugin.plan import ParallelPlan
from vtrain_plugin.sim.schedules import build_schedule
from vtrain_plugin.training import TrainingSpec

GIB = 2**30


def _segments(*bounds):
    return [_Segment(block=i, phase=Phase.FORWARD, start=a, stop=b, count=1) for i, (a, b) in enumerate(bounds)]


def test_segment_host_device_and_pipelined_times_are_exact():
    host = np.array([1.0, 2.0, 3.0, 4.0])
    device = np.array([5.0, 1.0, 1.0, 5.0])
    h, d, p = _segment_times(host, device, _segments((0, 2), (2, 4), (4, 4)))
    # P = max_k (host up to k + device from k): [1+6, 3+1] -> 7 and [3+6, 7+5] -> 12
    assert h.tolist() == [3.0, 7.0, 0.0]
    assert d.tolist() == [6.0, 6.0, 0.0]
    assert p.tolist() == [7.0, 12.0, 0.0]


def test_repeated_segments_in_sequence_are_exact():
    # two repetitions of (H 3, D 6, P 7): P + (n-1) max(H, D) = 13, then (H 7, D 6, P 12) once:
    # max(13 + 6, 6 + 12) = 19; empty segments add nothing
    assert _sequence([(3.0, 6.0, 7.0, 2), (0.0, 0.0, 0.0, 5), (7.0, 6.0, 12.0, 1)]) == 19.0
    assert _sequence([]) == 0.0


@pytest.fixture
def comm():
    plan = ParallelPlan(tensor_parallel=1, pipeline_parallel=1, data_parallel=8)
    return CommModel.for_plan(get_cluster_preset("dgx-h100"), plan)


def test_gradients_reduce_in_one_message_after_backward(comm):
    training = TrainingSpec(global_batch_size=8)
    blocks = [(2.0, 10_000_000, 1), (1.0, 30_000_000, 3)]
    (bucket,) = _dp_buckets(blocks, comm, training, 0)
    assert bucket.ready_fraction == 1.0
    assert bucket.comm_ns == comm.time_ns(CollectiveKind.ALL_REDUCE, 100_000_000, ParallelGroup.DP)


def test_overlapped_buckets_fill_in_backward_order_and_are_ready_when_full(comm):
    training = TrainingSpec(global_batch_size=8, grad_reduce="overlap", bucket_size_mb=50)
    blocks = [(2.0, 10_000_000, 1), (1.0, 30_000_000, 3)]  # embedding, then 3 layers of 30 MB each
    buckets = _dp_buckets(blocks, comm, training, 0)
    # backward: layer (30 MB, t=1), layer (60 MB >= 50: bucket at 2/5), layer (30 MB), embedding
    # (40 MB at t=5): the rest goes at the end
    assert [b.ready_fraction for b in buckets] == [0.4, 1.0]
    assert [b.comm_ns for b in buckets] == [comm.time_ns(CollectiveKind.ALL_REDUCE, n, ParallelGroup.DP)
                                           for n in (60_000_000, 40_000_000)]


def test_memory_per_rank_is_model_states_plus_activations_in_flight():
    def stage(rank, params, activation):
        block = Block(kind=BlockKind.LAYER, name="decoder.layers.0", count=2, activation_nbytes=activation)
        return StageGraph(pipeline_rank=rank, blocks=(block,), num_parameters=params)

    graph = OpGraph(model={"dtype": "fp16"}, parallel=ParallelPlan(pipeline_parallel=2).to_dict(),
                    micro_batch_size=1, seq_length=8, stages=(stage(0, GIB, 3 * GIB), stage(1, 2 * GIB, GIB)))
    first, second = rank_memory(graph, build_schedule("1f1b", 2, 1, 4))
    # fp16 weights and gradients (2 bytes each), fp32 main weights and two Adam moments (12 bytes)
    assert (first.weights_gib, first.gradients_gib, first.optimizer_gib) == (2.0, 2.0, 12.0)
    assert (second.weights_gib, second.gradients_gib, second.optimizer_gib) == (4.0, 4.0, 24.0)
    # 1F1B keeps pp - rank micro-batches: 2 x (2 layers x 3 GiB) and 1 x (2 layers x 1 GiB)
    assert (first.inflight_microbatches, first.activations_gib) == (2, 12.0)
    assert (second.inflight_microbatches, second.activations_gib) == (1, 2.0)
    assert first.total_gib == 28.0
