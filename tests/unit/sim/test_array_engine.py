"""The array engine (the default compute phase) against the task-by-task reference loop."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtrain_plugin.cost.work import ChunkWork, DpBucket, ParamGather, PipelineWork
from vtrain_plugin.sim import simulate
from vtrain_plugin.sim.engine import BREAKDOWN_FIELDS
from vtrain_plugin.sim.task_graph import task_graph
from vtrain_plugin.specs.training import ScheduleKind

RELATIVE = 1e-9


def _chunk(rnd: random.Random) -> ChunkWork:
    backward = rnd.uniform(2.0, 5.0)
    return ChunkWork(forward_ns=rnd.uniform(1.0, 3.0), backward_ns=backward,
                     recompute_ns=rnd.choice([0.0, rnd.uniform(0.5, 2.0)]),
                     tp_comm_forward_ns=0.2, tp_comm_backward_ns=0.3,
                     p2p_forward_ns=rnd.uniform(0.0, 0.6), p2p_backward_ns=rnd.uniform(0.0, 0.6),
                     dp_buckets=(DpBucket(comm_ns=rnd.uniform(0.5, 4.0), ready_fraction=0.4),
                                 DpBucket(comm_ns=rnd.uniform(0.5, 4.0), ready_fraction=1.0)),
                     param_gathers=(ParamGather(comm_ns=rnd.uniform(0.5, 4.0), need_fraction=0.0),
                                    ParamGather(comm_ns=rnd.uniform(0.5, 4.0), need_fraction=0.7)))


def _work(pp: int, v: int, m: int, *, uneven_ends: bool, dp_overlap: bool, seed: int) -> PipelineWork:
    # with dp_overlap, the parameter all-gathers overlap the first forwards too (distributed optimizer)
    """Stages all different (``uneven_ends`` False) or identical except the first and the last, as
    in a GPT with its embedding and head (the case whose steady state takes longest to repeat)."""
    rnd = random.Random(seed)
    stages = pp * v
    if uneven_ends:
        middle = _chunk(rnd)
        chunks = [_chunk(rnd) if s in (0, stages - 1) else middle for s in range(stages)]
    else:
        chunks = [_chunk(rnd) for _ in range(stages)]
    kind = ScheduleKind.INTERLEAVED_1F1B if v > 1 else ScheduleKind.ONE_F_ONE_B
    return PipelineWork(chunks=chunks, pipeline_parallel=pp, virtual_pipeline=v, num_microbatches=m, schedule=kind,
                        dp_overlap=dp_overlap, param_gather_overlap=dp_overlap,
                        embedding_sync_ns=1.5 if pp > 1 else 0.0,
                        optimizer_ns=[rnd.uniform(1.0, 2.0) for _ in range(pp)])


def assert_same(work: PipelineWork) -> None:
    fast, reference = simulate(work), simulate(work, reference=True)
    assert fast.iteration_ns == pytest.approx(reference.iteration_ns, rel=RELATIVE, abs=0)
    tolerance = RELATIVE * reference.iteration_ns
    for a, b in zip(fast.ranks, reference.ranks):
        for name in BREAKDOWN_FIELDS:
            assert getattr(a, f"{name}_ns") == pytest.approx(getattr(b, f"{name}_ns"), abs=tolerance), name


GRID = [(pp, v, m) for pp in (1, 2, 3, 8, 35, 64) for v in (1, 2, 4) for m in (1, 2, 7, 64, 512)
        if (v == 1 or (pp > 1 and m % pp == 0)) and pp * v * m <= 64 * 512]


@pytest.mark.parametrize("pp, v, m", GRID)
@pytest.mark.parametrize("uneven_ends", [True, False])
@pytest.mark.parametrize("dp_overlap", [True, False])
def test_array_engine_equals_reference_over_a_grid(pp, v, m, uneven_ends, dp_overlap):
    assert_same(_work(pp, v, m, uneven_ends=uneven_ends, dp_overlap=dp_overlap, seed=pp * 1000 + v * 100 + m))


@settings(max_examples=60, deadline=None)
@given(pp=st.integers(1, 12), v=st.integers(1, 4), groups=st.integers(1, 12), seed=st.integers(0, 10**6),
       uneven_ends=st.booleans(), dp_overlap=st.booleans())
def test_array_engine_equals_reference_on_random_plans(pp, v, groups, seed, uneven_ends, dp_overlap):
    v = 1 if pp == 1 else v
    assert_same(_work(pp, v, groups * pp, uneven_ends=uneven_ends, dp_overlap=dp_overlap, seed=seed))


def test_task_graph_levels_hold_one_task_per_rank():
    graph = task_graph(ScheduleKind.ONE_F_ONE_B, 4, 1, 8)
    assert graph.num_tasks == 4 * 2 * 8
    for a, b in zip(graph.level_starts, graph.level_starts[1:]):
        ranks = graph.rank[a:b].tolist()
        assert len(ranks) == len(set(ranks))
    # 1F1B on 4 ranks with 8 micro-batches: the steady phase repeats every two levels (a forward
    # level and a backward level) and no task waits on one more than a level back.
    assert graph.steady.period == 2
    assert graph.steady.lookback == 1


def test_uniform_1f1b_closed_form_holds_on_the_array_path():
    p, m, tf, tb = 35, 160, 3.0, 5.0
    chunks = [ChunkWork(forward_ns=tf, backward_ns=tb)] * p
    work = PipelineWork(chunks=chunks, pipeline_parallel=p, num_microbatches=m, schedule=ScheduleKind.ONE_F_ONE_B,
                        dp_overlap=False, optimizer_ns=[0.0] * p)
    assert simulate(work).iteration_ns == pytest.approx((m + p - 1) * (tf + tb), rel=1e-12)


@pytest.mark.parametrize("pp, v, m, group", [(2, 2, 5, 3), (4, 2, 8, 8), (4, 3, 12, 6), (4, 2, 5, 5)])
def test_microbatch_groups_match_the_reference_and_hide_send_latency(pp, v, m, group):
    def work(group, p2p_ns):
        chunks = [ChunkWork(forward_ns=1.0, backward_ns=2.0, p2p_forward_ns=p2p_ns, p2p_backward_ns=p2p_ns)
                  for _ in range(pp * v)]
        return PipelineWork(chunks=chunks, pipeline_parallel=pp, virtual_pipeline=v, num_microbatches=m,
                            schedule=ScheduleKind.INTERLEAVED_1F1B, microbatch_group_size=group, dp_overlap=False,
                            optimizer_ns=[0.0] * pp)
    assert_same(work(group, 0.5))
    if m % pp == 0:  # the default groups exist: wider groups leave more slack for the sends
        assert simulate(work(group, 0.5)).iteration_ns < simulate(work(None, 0.5)).iteration_ns
        assert simulate(work(group, 0.0)).iteration_ns == simulate(work(None, 0.0)).iteration_ns
