"""The cluster simulation's event loop on hand-checkable traces: two jobs on one node, hand-made
curves, every time worked out below."""

import math

import pytest

from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.planning.cluster.cluster_config import ClusterConfig
from vtrain_plugin.planning.cluster.curves import ThroughputCurve
from vtrain_plugin.planning.cluster.events import Arrival, EventKind, Finish, Schedule, run_events
from vtrain_plugin.planning.cluster.jobs import Job
from vtrain_plugin.planning.cluster.policies import Decision, Policy
from vtrain_plugin.planning.cluster.report import summarize
from vtrain_plugin.planning.cluster.simulator import PolicyViolation, Segment, simulate
from vtrain_plugin.planning.model_family import model_preset

NODE = get_cluster_preset("dgx-a100")  # 8 GPUs, $2 per GPU-hour
ONE_NODE = ClusterConfig(spec=NODE, nodes=1)
ONE_NODE_BY_GPU = ClusterConfig(spec=NODE, nodes=1, granularity="gpu")
MODEL = model_preset("gpt3-1.3b")  # 2048 tokens per sequence
HOUR = 3600.0


def job(name, submit_s, iterations, deadline_s, gpus=None):
    """A job of ``iterations`` iterations of one sequence each."""
    return Job(name=name, submit_s=submit_s, model=MODEL, global_batch_size=1, tokens=iterations * 2048,
               deadline_s=deadline_s, requested_gpus=gpus)


def outcome(result, name):
    return next(o for o in result.outcomes if o.name == name)


def test_fifo_two_jobs_on_one_node():
    # a: starts at 0, restart 100 s, 1000 iterations of 1 s: ends at 1100.
    # b: arrives at 500, waits for the node, starts at 1100, ends at 1100 + 100 + 600 = 1800.
    curve = ThroughputCurve.from_seconds({8: 1.0})
    jobs = [job("a", 0, 1000, 10 * HOUR, gpus=8), job("b", 500, 600, 1700)]
    result = simulate(jobs, {"a": curve, "b": curve}, ONE_NODE, "fifo-static", restart_s=100)
    a, b = outcome(result, "a"), outcome(result, "b")
    assert (a.start_s, a.finish_s, b.start_s, b.finish_s) == (0, 1100, 1100, 1800)
    assert a.met_deadline and not b.met_deadline  # b's deadline (1700) passes while it waits
    assert result.segments == (Segment(job="a", start_s=0, end_s=1100, gpus=8),
                               Segment(job="b", start_s=1100, end_s=1800, gpus=8))
    summary = summarize(result)
    assert summary["deadline_satisfaction"] == 0.5 and summary["late"] == 1 and summary["rejected"] == 0
    assert summary["makespan_hours"] == 1800 / HOUR
    assert summary["mean_jct_hours"] == pytest.approx((1100 + 1300) / 2 / HOUR)
    assert summary["utilization"] == 1.0
    assert summary["gpu_hours"] == 8 * 1800 / HOUR
    assert summary["cost_usd"] == pytest.approx(2.0 * 8 * 1800 / HOUR)


@pytest.mark.parametrize("policy", ["edf-vtrain", "edf-linear"])
def test_elastic_two_jobs_on_one_node_by_gpu(policy):
    # Curve: 4 GPUs 2 s per iteration, 8 GPUs 1 s (linear: both policies agree). Restart 100 s.
    # t=0     a alone: share 4, the 4 free GPUs speed it up: 8 GPUs, would end at 100 + 1000 = 1100.
    # t=500   a has done 400 iterations, 600 left. b (2000 iterations... on 4 GPUs: 1000 x 2 s)
    #         needs 4 GPUs now to end by 3000 (600 + 2000 = 2600); a keeps its deadline on 4:
    #         a resized to 4, trains from 600, ends at 600 + 600 x 2 = 1800; b starts, would end at 2600.
    # t=1800  a ends; b has done 600 of 1000, 400 left: 4 more GPUs end it at 1800 + 100 + 400 = 2300
    #         instead of 2600: b resized to 8. The finish of a at 1100 and b at 2600 are stale.
    curve = ThroughputCurve.from_seconds({4: 2.0, 8: 1.0})
    jobs = [job("a", 0, 1000, 10 * HOUR), job("b", 500, 1000, 3000)]
    result = simulate(jobs, {"a": curve, "b": curve}, ONE_NODE_BY_GPU, policy, restart_s=100)
    a, b = outcome(result, "a"), outcome(result, "b")
    assert (a.start_s, a.finish_s, a.resizes) == (0, 1800, 1)
    assert (b.start_s, b.finish_s, b.resizes) == (500, 2300, 1)
    assert result.segments == (Segment(job="a", start_s=0, end_s=500, gpus=8),
                               Segment(job="a", start_s=500, end_s=1800, gpus=4),
                               Segment(job="b", start_s=500, end_s=1800, gpus=4),
                               Segment(job="b", start_s=1800, end_s=2300, gpus=8))
    assert a.gpu_seconds == 8 * 500 + 4 * 1300 and b.gpu_seconds == 4 * 1300 + 8 * 500
    assert summarize(result)["utilization"] == pytest.approx((9200 + 9200) / (8 * 2300))
    assert result.passes == 3  # at 0, 500 and 1800; at 2300 no job is left
    assert result.events == 2 + 4 + 4  # 2 arrivals, 4 finishes (2 stale), a pass after each but the stale


def test_a_finish_and_an_arrival_at_one_instant_make_one_pass():
    curve = ThroughputCurve.from_seconds({8: 1.0})
    jobs = [job("a", 0, 900, HOUR), job("b", 1000, 100, HOUR)]  # b arrives as a ends
    result = simulate(jobs, {"a": curve, "b": curve}, ONE_NODE, "fifo-static", restart_s=100)
    assert outcome(result, "b").start_s == 1000 and outcome(result, "b").finish_s == 1200
    assert result.passes == 2  # at 0, and one at 1000 for both


def test_a_job_that_fits_nowhere_is_rejected_on_arrival_with_the_curves_reason():
    fits = ThroughputCurve.from_seconds({8: 1.0})
    nowhere = ThroughputCurve(reason="no plan fits on 8 to 8 GPUs (TP 1: none of its 3 plans fits in GPU memory)")
    jobs = [job("a", 0, 10, HOUR), job("big", 5, 10, HOUR)]
    for policy in ("fifo-static", "edf-linear", "edf-vtrain"):
        result = simulate(jobs, {"a": fits, "big": nowhere}, ONE_NODE, policy, restart_s=0)
        big = outcome(result, "big")
        assert big.rejected == nowhere.reason and big.start_s is None and not big.met_deadline
        assert outcome(result, "a").finish_s == 10


def test_events_are_ordered_by_time_then_finish_arrival_schedule():
    seen = []

    class Recorder:
        def arrive(self, job, time_s):
            seen.append(("arrive", job, time_s))
            return [Schedule(time_s)] if job == 0 else []

        def finish(self, job, epoch, time_s):
            seen.append(("finish", job, time_s))
            return []

        def schedule(self, time_s):
            seen.append(("schedule", time_s))
            return [Finish(time_s + 1, 0, 1)]

    handled = run_events([Arrival(2.0, 1), Arrival(1.0, 0), Finish(1.0, 3, 0)], Recorder())
    assert seen == [("finish", 3, 1.0), ("arrive", 0, 1.0), ("schedule", 1.0), ("finish", 0, 2.0),
                    ("arrive", 1, 2.0)]
    assert handled == 5
    assert EventKind.FINISH < EventKind.ARRIVAL < EventKind.SCHEDULE


class Greedy(Policy):
    """Gives every job the whole cluster: overcommits as soon as two jobs are active."""

    name = "greedy"
    summary = "test"

    def decide(self, view):
        return Decision(allocations={j.index: view.total_gpus for j in view.jobs})


class Idle(Policy):
    name = "idle"
    summary = "test"

    def decide(self, view):
        return Decision()


def test_the_simulator_refuses_an_overcommit_and_jobs_left_waiting():
    curve = ThroughputCurve.from_seconds({8: 1.0})
    jobs = [job("a", 0, 100, HOUR), job("b", 1, 100, HOUR)]
    with pytest.raises(PolicyViolation, match="policy greedy allocated 16 GPUs of 8"):
        simulate(jobs, {"a": curve, "b": curve}, ONE_NODE, Greedy())
    with pytest.raises(PolicyViolation, match="policy idle left 2 job.s. unfinished"):
        simulate(jobs, {"a": curve, "b": curve}, ONE_NODE, Idle())


def test_a_job_that_never_finishes_has_no_completion_time():
    curve = ThroughputCurve(reason="nowhere")
    result = simulate([job("a", 0, 1, HOUR)], {"a": curve}, ONE_NODE, "edf-vtrain")
    assert math.isnan(outcome(result, "a").jct_s)
    assert math.isnan(summarize(result)["mean_jct_hours"])
