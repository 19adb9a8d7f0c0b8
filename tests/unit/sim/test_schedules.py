from itertools import accumulate

import pytest

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.sim import TaskKind, build_schedule, register_schedule, schedule_builder, schedule_occupancy
from vtrain_plugin.specs.training import ScheduleKind


def order(schedule, rank):
    return [("F" if t.kind is TaskKind.FORWARD else "B", t.chunk, t.microbatch) for t in schedule.tasks[rank]]


def test_gpipe_order():
    s = build_schedule(ScheduleKind.GPIPE, 2, 1, 3)
    assert order(s, 1) == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("B", 0, 0), ("B", 0, 1), ("B", 0, 2)]


def test_1f1b_order():
    s = build_schedule(ScheduleKind.ONE_F_ONE_B, 3, 1, 4)
    assert order(s, 0) == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("B", 0, 0), ("F", 0, 3), ("B", 0, 1),
                           ("B", 0, 2), ("B", 0, 3)]
    assert order(s, 2) == [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1), ("F", 0, 2), ("B", 0, 2),
                           ("F", 0, 3), ("B", 0, 3)]
    few = build_schedule(ScheduleKind.ONE_F_ONE_B, 4, 1, 2)  # fewer micro-batches than warm-up
    assert order(few, 0) == [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)]


def test_interleaved_order_matches_megatron():
    # pp=2, v=2, m=4: table (mb, chunk) = (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1);
    # rank 1 warms up with (2-1-1)*2 + (2-1)*2 = 2 forwards, backwards mirror the chunk.
    s = build_schedule(ScheduleKind.INTERLEAVED_1F1B, 2, 2, 4)
    assert order(s, 1) == [
        ("F", 0, 0), ("F", 0, 1),
        ("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("F", 0, 2), ("B", 0, 0), ("F", 0, 3), ("B", 0, 1),
        ("F", 1, 2), ("B", 1, 2), ("F", 1, 3), ("B", 1, 3),
        ("B", 0, 2), ("B", 0, 3)]
    assert order(s, 0)[:5] == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1), ("F", 0, 2)]
    assert order(s, 0)[5] == ("B", 1, 0)


def test_peak_inflight():
    p, m = 4, 8
    assert build_schedule(ScheduleKind.GPIPE, p, 1, m).peak_inflight_microbatches == (8, 8, 8, 8)
    assert build_schedule(ScheduleKind.ONE_F_ONE_B, p, 1, m).peak_inflight_microbatches == (4, 3, 2, 1)
    inter = build_schedule(ScheduleKind.INTERLEAVED_1F1B, p, 2, m)
    assert [inter.peak_inflight(r) for r in range(p)] == [(p - r - 1) * 2 + p + 1 for r in range(p)]
    assert inter.peak_inflight_microbatches[0] == p + (p - 1) / 2


def test_interleaved_requires_multiple_of_pp():
    with pytest.raises(ConfigError, match=r"interleaved_1f1b requires num_microbatches \(6\) to be a multiple "
                                          r"of pipeline_parallel \(4\)"):
        build_schedule(ScheduleKind.INTERLEAVED_1F1B, 4, 2, 6)
    with pytest.raises(ConfigError, match="interleaved_1f1b requires virtual_pipeline >= 2, got 1"):
        build_schedule(ScheduleKind.INTERLEAVED_1F1B, 4, 1, 8)
    with pytest.raises(ConfigError, match="1f1b requires virtual_pipeline == 1, got 2"):
        build_schedule(ScheduleKind.ONE_F_ONE_B, 4, 2, 8)


def test_registry():
    with pytest.raises(ConfigError, match="unknown schedule 'zb'; valid schedules are 1f1b, gpipe, interleaved_1f1b"):
        schedule_builder("zb")
    assert schedule_builder("gpipe") is schedule_builder(ScheduleKind.GPIPE)
    with pytest.raises(ConfigError, match="schedule 'gpipe' is already registered"):
        register_schedule(ScheduleKind.GPIPE)(lambda pp, vp, m, r: [])


@pytest.mark.parametrize("pp, vp, m", [(2, 2, 2), (3, 2, 6), (4, 3, 8), (8, 4, 16), (5, 2, 15)])
def test_every_chunk_microbatch_runs_once_forward_then_backward(pp, vp, m):
    s = build_schedule(ScheduleKind.INTERLEAVED_1F1B, pp, vp, m)
    for r in range(pp):
        seen = order(s, r)
        assert sorted(seen) == sorted([(k, c, i) for k in "FB" for c in range(vp) for i in range(m)])
        assert all(seen.index(("F", c, i)) < seen.index(("B", c, i)) for c in range(vp) for i in range(m))


@pytest.mark.parametrize("pp, vp, m, group", [(2, 2, 5, 3), (2, 2, 6, 2), (4, 2, 5, 5), (4, 3, 12, 6), (3, 2, 7, 4)])
def test_interleaved_table_is_megatron_cores(pp, vp, m, group):
    from megatron.core.pipeline_parallel.schedules import get_schedule_table
    s = build_schedule(ScheduleKind.INTERLEAVED_1F1B, pp, vp, m, group)
    assert [(mb, c) for _, c, mb in order(s, pp - 1) if _ == "F"] == get_schedule_table(m, vp, group)


def test_microbatch_groups_set_the_warmup_and_the_peak_inflight():
    # pp=2, v=2, m=5, group 3: table (0,0) (1,0) (2,0) (0,1) (1,1) (2,1) (3,0) (4,0) (3,1) (4,1);
    # rank 1 warms up with (2-1-1)*2 + (2-1)*3 = 3 forwards, rank 0 with 5.
    s = build_schedule(ScheduleKind.INTERLEAVED_1F1B, 2, 2, 5, 3)
    assert order(s, 1)[:6] == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("F", 1, 0), ("B", 1, 0), ("F", 1, 1)]
    assert [s.peak_inflight(r) for r in range(2)] == [6, 4]
    default = build_schedule(ScheduleKind.INTERLEAVED_1F1B, 4, 2, 8)
    assert build_schedule(ScheduleKind.INTERLEAVED_1F1B, 4, 2, 8, 4).tasks == default.tasks
    wide = build_schedule(ScheduleKind.INTERLEAVED_1F1B, 4, 2, 8, 8)
    assert [wide.peak_inflight(r) for r in range(4)] == [(4 - r - 1) * 2 + 8 + 1 for r in range(4)]


@pytest.mark.parametrize("m, group, message", [
    (8, 3, r"training.microbatch_group_size \(3\) must lie between pipeline_parallel \(4\) and num_microbatches \(8\)"),
    (8, 9, r"training.microbatch_group_size \(9\) must lie between pipeline_parallel \(4\) and num_microbatches \(8\)"),
    (9, 8, r"training.microbatch_group_size \(8\) must leave a last group of num_microbatches \(9\) % 8 = 1 "
           r"micro-batches that is 0 or at least pipeline_parallel \(4\)"),
])
def test_microbatch_groups_follow_megatron_cores_rules(m, group, message):
    with pytest.raises(ConfigError, match=message):
        build_schedule(ScheduleKind.INTERLEAVED_1F1B, 4, 2, m, group)
    assert build_schedule(ScheduleKind.INTERLEAVED_1F1B, 4, 2, 10, 6).num_microbatches == 10  # last group 4 >= pp


def test_microbatch_groups_need_the_interleaved_schedule():
    with pytest.raises(ConfigError, match=r"training.microbatch_group_size \(4\) needs training.schedule "
                                          r"interleaved_1f1b \(got 1f1b\)"):
        build_schedule(ScheduleKind.ONE_F_ONE_B, 4, 1, 8, 4)


OCCUPANCY_SHAPES = ([(kind, pp, 1, m, None) for kind in (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B)
                     for pp in (1, 2, 5) for m in (1, 3, 8)]
                    + [(ScheduleKind.INTERLEAVED_1F1B, pp, vp, m, None) for pp in (2, 3) for vp in (2, 3)
                       for m in (pp, 2 * pp, 5 * pp)]
                    + [(ScheduleKind.INTERLEAVED_1F1B, pp, vp, m, group)
                       for pp, vp, m, group in [(2, 2, 5, 3), (2, 3, 8, 3), (4, 2, 10, 6), (3, 2, 7, 4), (4, 2, 8, 8)]])


@pytest.mark.parametrize("kind, pp, vp, m, group", OCCUPANCY_SHAPES)
def test_occupancy_from_the_shape_is_the_tasks_count(kind, pp, vp, m, group):
    """schedule_occupancy derives the peaks and walks from the shape; counted here from the tasks."""
    occupancy = schedule_occupancy(kind, pp, vp, m, group)
    tasks = build_schedule(kind, pp, vp, m, group).tasks
    for r in range(pp):
        sign = [1 if t.kind is TaskKind.FORWARD else -1 for t in tasks[r]]
        assert occupancy.peak_inflight(r) == max(accumulate(sign, initial=0))
        if vp > 1:
            chunks, walked = occupancy.task_walks[r]
            assert chunks.tolist() == [t.chunk for t in tasks[r]] and walked.tolist() == sign
    assert occupancy.task_walks == () if vp == 1 else len(occupancy.task_walks) == pp
    sizes, rises = [5 + 3 * c for c in range(vp)], [7 * (vp - c) for c in range(vp)]
    walked = [occupancy.peak_live(r, sizes, rises) for r in range(pp)]
    assert walked == [build_schedule(kind, pp, vp, m, group).peak_live(r, sizes, rises) for r in range(pp)]


def test_occupancy_refuses_what_the_builder_refuses():
    with pytest.raises(ConfigError, match=r"interleaved_1f1b requires num_microbatches \(6\) to be a multiple"):
        schedule_occupancy(ScheduleKind.INTERLEAVED_1F1B, 4, 2, 6)
    with pytest.raises(ConfigError, match="unknown schedule 'zb'"):
        schedule_occupancy("zb", 4, 1, 8)
