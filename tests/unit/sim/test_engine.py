import json

import pytest

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.cost.work import ChunkWork, DpBucket, ParamGather, PipelineWork
from vtrain_plugin.sim import IntervalKind, Stream, build_schedule, simulate, to_chrome_trace, write_chrome_trace
from vtrain_plugin.specs.training import ScheduleKind


def uniform(p, m, tf, tb, *, v=1, schedule=ScheduleKind.ONE_F_ONE_B, dp_overlap=False, optimizer=0.0,
            embedding_sync_ns=0.0, **chunk):
    chunks = tuple(ChunkWork(forward_ns=tf / v, backward_ns=tb / v, **chunk) for _ in range(p * v))
    return PipelineWork(chunks=chunks, pipeline_parallel=p, virtual_pipeline=v, num_microbatches=m,
                        schedule=schedule, dp_overlap=dp_overlap, embedding_sync_ns=embedding_sync_ns,
                        optimizer_ns=(optimizer,) * p)


def assert_partition(result):
    for rank in result.ranks:
        assert rank.total_ns == pytest.approx(result.iteration_ns)


@pytest.mark.parametrize("p, m", [(1, 3), (4, 8), (4, 2), (8, 16), (35, 160)])
def test_1f1b_and_gpipe_uniform_stages(p, m):
    tf, tb = 3.0, 5.0
    one_f_one_b = simulate(uniform(p, m, tf, tb))
    assert one_f_one_b.iteration_ns == (m + p - 1) * (tf + tb)
    assert all(r.bubble_ns == (p - 1) * (tf + tb) for r in one_f_one_b.ranks)
    assert_partition(one_f_one_b)
    gpipe = simulate(uniform(p, m, tf, tb, schedule=ScheduleKind.GPIPE))
    assert gpipe.iteration_ns == one_f_one_b.iteration_ns
    assert build_schedule(ScheduleKind.GPIPE, p, 1, m).peak_inflight_microbatches[0] == m
    assert build_schedule(ScheduleKind.ONE_F_ONE_B, p, 1, m).peak_inflight_microbatches[0] == min(p, m)


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (4, 2, 8), (4, 4, 16), (8, 2, 8)])
def test_interleaved_bubble_shrinks_by_v(p, v, m):
    tf, tb = 4.0, 8.0
    result = simulate(uniform(p, m, tf, tb, v=v, schedule=ScheduleKind.INTERLEAVED_1F1B))
    assert result.iteration_ns == m * (tf + tb) + (p - 1) * (tf + tb) / v
    assert all(r.bubble_ns == (p - 1) * (tf + tb) / v for r in result.ranks)
    assert all(r.forward_ns == m * tf and r.backward_ns == m * tb for r in result.ranks)


def single_rank(buckets, *, overlap):
    # one rank, two micro-batches: F 0-1, B 1-11, F 11-12, last B 12-22
    chunk = ChunkWork(forward_ns=1.0, backward_ns=10.0, dp_buckets=tuple(buckets))
    return PipelineWork(chunks=(chunk,), pipeline_parallel=1, num_microbatches=2,
                        schedule=ScheduleKind.ONE_F_ONE_B, dp_overlap=overlap, optimizer_ns=(0.0,))


def test_overlapped_dp_hidden_when_backward_is_longer():
    result = simulate(single_rank([DpBucket(comm_ns=4.0, ready_fraction=0.5)], overlap=True))
    assert result.iteration_ns == 22.0  # bucket 17-21 inside the last backward
    assert result.ranks[0].dp_comm_ns == 0.0


def test_overlapped_dp_exposed_when_comm_is_longer():
    result = simulate(single_rank([DpBucket(comm_ns=8.0, ready_fraction=0.5)], overlap=True))
    assert result.iteration_ns == 25.0  # bucket 17-25
    assert result.ranks[0].dp_comm_ns == 3.0
    two = simulate(single_rank([DpBucket(comm_ns=4.0, ready_fraction=0.5),
                                DpBucket(comm_ns=4.0, ready_fraction=0.25)], overlap=True))
    assert two.iteration_ns == 22.5  # 14.5-18.5, then FIFO 18.5-22.5
    assert_partition(two)


def test_non_overlapped_dp_adds_its_full_time():
    result = simulate(single_rank([DpBucket(comm_ns=4.0, ready_fraction=0.5),
                                   DpBucket(comm_ns=4.0, ready_fraction=1.0)], overlap=False))
    assert result.iteration_ns == 30.0
    assert result.ranks[0].dp_comm_ns == 8.0
    assert result.ranks[0].bubble_ns == 0.0


def gathered_rank(*, overlap):
    # one rank, two micro-batches as in single_rank, and two parameter all-gathers: 3 ns needed at
    # the start of the forward, 2 ns needed half-way through it
    chunk = ChunkWork(forward_ns=1.0, backward_ns=10.0,
                      param_gathers=(ParamGather(comm_ns=3.0, need_fraction=0.0),
                                     ParamGather(comm_ns=2.0, need_fraction=0.5)))
    return PipelineWork(chunks=(chunk,), pipeline_parallel=1, num_microbatches=2, schedule=ScheduleKind.ONE_F_ONE_B,
                        dp_overlap=True, param_gather_overlap=overlap, optimizer_ns=(1.0,))


@pytest.mark.parametrize("reference", [False, True])
def test_parameter_gathers_follow_the_optimizer_step_without_overlap(reference):
    result = simulate(gathered_rank(overlap=False), reference=reference)
    assert result.iteration_ns == 22.0 + 1.0 + 5.0  # compute, optimizer, both gathers
    assert result.ranks[0].dp_comm_ns == 5.0 and result.ranks[0].bubble_ns == 0.0


@pytest.mark.parametrize("reference", [False, True])
def test_overlapped_parameter_gathers_hold_the_first_forward_where_it_needs_them(reference):
    # gathers 0-3 and 3-5; the first forward waits for the first, runs half-way (4-4.5), waits for
    # the second (5) and ends at 5.5: F 0-5.5, B 5.5-15.5, F 15.5-16.5, B 16.5-26.5, optimizer 27.5
    result = simulate(gathered_rank(overlap=True), reference=reference)
    assert result.iteration_ns == 27.5
    assert result.ranks[0].dp_comm_ns == 4.5 and result.ranks[0].bubble_ns == 0.0
    assert_partition(result)


def test_pipeline_sends_delay_the_receiver():
    # pp=2, one micro-batch: F r0 0-1, send 0.5, F r1 1.5-2.5, B r1 2.5-3.5, send 0.25, B r0 3.75-4.75
    chunks = (ChunkWork(forward_ns=1.0, backward_ns=1.0, p2p_forward_ns=0.5),
              ChunkWork(forward_ns=1.0, backward_ns=1.0, p2p_backward_ns=0.25))
    work = PipelineWork(chunks=chunks, pipeline_parallel=2, num_microbatches=1,
                        schedule=ScheduleKind.ONE_F_ONE_B, dp_overlap=False, optimizer_ns=(0.0, 0.0))
    result = simulate(work)
    assert result.iteration_ns == 4.75
    assert result.ranks[0].pp_comm_ns == 0.25 and result.ranks[1].pp_comm_ns == 0.5
    assert result.ranks[0].bubble_ns == 2.5 and result.ranks[1].bubble_ns == 2.25
    assert_partition(result)


def test_recompute_tp_shares_embedding_sync_and_optimizer():
    chunks = (ChunkWork(forward_ns=2.0, backward_ns=4.0, recompute_ns=2.0, tp_comm_forward_ns=1.0,
                        tp_comm_backward_ns=3.0),
              ChunkWork(forward_ns=2.0, backward_ns=4.0, recompute_ns=2.0))
    work = PipelineWork(chunks=chunks, pipeline_parallel=2, num_microbatches=1, schedule=ScheduleKind.ONE_F_ONE_B,
                        dp_overlap=False, embedding_sync_ns=2.0, optimizer_ns=(1.0, 3.0))
    result = simulate(work)
    # F 0-2, F 2-4, R+B 4-10, R+B 10-16; embedding sync 16-18 on both; optimizer from 18, longest 3
    assert result.iteration_ns == 21.0
    first = result.ranks[0]
    assert (first.forward_ns, first.tp_comm_ns) == (1.0, 4.0)
    assert (first.backward_ns, first.recompute_ns) == (2.0, 1.0)  # 3 of 6 are TP, split 4:2
    assert (first.embedding_sync_ns, first.optimizer_ns) == (2.0, 1.0)
    assert result.ranks[1].recompute_ns == 2.0
    assert_partition(result)


def test_timeline_and_chrome_trace(tmp_path):
    work = uniform(4, 8, 2.0, 4.0, dp_overlap=True, recompute_ns=1.0, p2p_forward_ns=0.5, p2p_backward_ns=0.5,
                   dp_buckets=(DpBucket(comm_ns=3.0, ready_fraction=1.0),), optimizer=1.0)
    assert simulate(work).timeline is None
    result = simulate(work, record_timeline=True)
    assert result.iteration_ns == simulate(work).iteration_ns
    rank0 = result.timeline.ranks[0]
    kinds = [iv.kind for iv in rank0]
    assert kinds.count(IntervalKind.FORWARD) == 8 and kinds.count(IntervalKind.RECOMPUTE) == 8
    assert kinds.count(IntervalKind.DP_COMM) == 1 and kinds.count(IntervalKind.OPTIMIZER) == 1
    assert kinds.count(IntervalKind.PP_COMM) == 8  # activations out; rank 0 sends no gradient
    compute = sorted((iv.start_ns, iv.end_ns) for iv in rank0 if iv.stream is Stream.COMPUTE)
    assert all(a[1] <= b[0] for a, b in zip(compute, compute[1:]))

    trace = to_chrome_trace(result.timeline, max_ranks=2, max_microbatches=2)
    events = trace["traceEvents"]
    assert {e["pid"] for e in events} == {0, 3}
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] in ("process_name", "thread_name")}
    assert {"pipeline rank 0", "pipeline rank 3", "compute", "dp", "pp_send"} <= names
    forwards = [e for e in events if e["ph"] == "X" and e["cat"] == "forward" and e["pid"] == 0]
    assert [e["args"]["microbatch"] for e in forwards] == [0, 1]
    assert (forwards[0]["ts"], forwards[0]["dur"]) == (0.0, 0.002)  # microseconds
    path = tmp_path / "trace.json"
    write_chrome_trace(result.timeline, path)
    assert len(json.loads(path.read_text())["traceEvents"]) > len(events)
    with pytest.raises(ConfigError, match="max_ranks must be positive, got 0"):
        to_chrome_trace(result.timeline, max_ranks=0)


def test_work_validation_messages():
    chunk = ChunkWork(forward_ns=1.0, backward_ns=1.0)
    with pytest.raises(ConfigError, match=r"pipeline_work.chunks has 1 entries; pipeline_parallel \(2\) \* "
                                          r"virtual_pipeline \(1\) = 2 needed"):
        PipelineWork(chunks=(chunk,), pipeline_parallel=2, num_microbatches=1, schedule="1f1b",
                     dp_overlap=False, optimizer_ns=(0.0, 0.0))
    with pytest.raises(ConfigError, match="pipeline_work.optimizer_ns has 1 entries; one per pipeline rank"):
        PipelineWork(chunks=(chunk, chunk), pipeline_parallel=2, num_microbatches=1, schedule="1f1b",
                     dp_overlap=False, optimizer_ns=(0.0,))
    with pytest.raises(ConfigError, match="pipeline_work.schedule must be one of gpipe, 1f1b, interleaved_1f1b"):
        PipelineWork(chunks=(chunk,), pipeline_parallel=1, num_microbatches=1, schedule="zb",
                     dp_overlap=False, optimizer_ns=(0.0,))
    with pytest.raises(ConfigError, match="chunk_work.forward_ns must be a non-negative number, got -1"):
        ChunkWork(forward_ns=-1, backward_ns=1.0)
    with pytest.raises(ConfigError, match=r"chunk_work.tp_comm_forward_ns \(2.0\) must not exceed forward_ns"):
        ChunkWork(forward_ns=1.0, backward_ns=1.0, tp_comm_forward_ns=2.0)
    with pytest.raises(ConfigError, match=r"dp_bucket.ready_fraction must be in \[0, 1\], got 1.5"):
        DpBucket(comm_ns=1.0, ready_fraction=1.5)
    with pytest.raises(ConfigError, match=r"interleaved_1f1b requires num_microbatches \(6\)"):
        simulate(uniform(4, 6, 1.0, 1.0, v=2, schedule=ScheduleKind.INTERLEAVED_1F1B))
