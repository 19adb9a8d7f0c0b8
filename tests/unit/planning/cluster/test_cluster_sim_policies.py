"""Each policy's decision on a tiny case, worked out by hand (hand-made curves)."""

import numpy as np
import pytest

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.planning.cluster.curves import ThroughputCurve
from vtrain_plugin.planning.cluster.jobs import Job
from vtrain_plugin.planning.cluster.policies import POLICIES, ClusterView, JobView
from vtrain_plugin.planning.cluster.policies.capacity import CapacityProfile, Reservation
from vtrain_plugin.planning.model_family import model_preset

MODEL = model_preset("gpt3-1.3b")
NOW = 1000.0


def view(*jobs, total=32, restart_s=0.0, unit=8):
    return ClusterView(now_s=NOW, total_gpus=total, gpus_per_node=8, unit_gpus=unit, restart_s=restart_s,
                       jobs=tuple(jobs))


def job_view(index, curve, *, remaining=100.0, deadline_s=1e9, submit_s=0.0, gpus=0, admitted=False,
             requested=None, priority=0):
    job = Job(name=f"j{index}", submit_s=submit_s, model=MODEL, global_batch_size=1, tokens=2048 * 100,
              deadline_s=deadline_s, requested_gpus=requested, priority=priority)
    return JobView(index=index, job=job, curve=curve, gpus=gpus, remaining_iterations=remaining, admitted=admitted,
                   started=gpus > 0, restart_left_s=0.0)


def decide(policy, *jobs, **kwargs):
    return POLICIES.get(policy)().decide(view(*jobs, **kwargs))


def test_the_registry_names_the_three_policies_and_refuses_unknown_ones():
    assert POLICIES.names() == ("edf-linear", "edf-vtrain", "fifo-static")
    with pytest.raises(ConfigError, match="unknown policy 'lifo'; valid policies are edf-linear, edf-vtrain, "
                                          "fifo-static"):
        POLICIES.get("lifo")


FLAT = ThroughputCurve.from_seconds({8: 10.0, 16: 6.0, 24: 6.5, 32: 4.0})


def test_fifo_static_gives_what_was_asked_in_order_and_never_overtakes():
    running = job_view(0, FLAT, gpus=16, admitted=True, requested=16)
    first = job_view(1, FLAT, submit_s=10, requested=24)  # 24 > the 16 free: waits
    second = job_view(2, FLAT, submit_s=20, requested=8)  # would fit, but may not overtake
    decision = decide("fifo-static", running, first, second)
    assert decision.allocations == {0: 16} and decision.rejections == {}
    urgent = job_view(3, FLAT, submit_s=30, requested=16, priority=1)  # a higher priority goes first
    decision = decide("fifo-static", running, first, urgent)
    assert decision.allocations == {0: 16, 3: 16}


def test_fifo_static_rejects_requests_without_a_plan_or_beyond_the_cluster():
    no_plan = job_view(0, FLAT, requested=12, submit_s=1)
    too_big = job_view(1, ThroughputCurve.from_seconds({8: 1.0, 64: 0.1}), requested=64, submit_s=2)
    default = job_view(2, FLAT, submit_s=3)  # asks for nothing: its smallest count
    decision = decide("fifo-static", no_plan, too_big, default)
    assert decision.rejections == {0: "no plan fits on the 12 GPUs it asks for (counts with one: 8, 16, 24, 32)",
                                   1: "asks for 64 GPUs, the cluster has 32"}
    assert decision.allocations == {2: 8}


def test_edf_vtrain_gives_the_minimum_share_then_leftovers_by_marginal_gain():
    # Job 0: 100 iterations by 1000 + 800 s: 8 GPUs take 1000 s, 16 take 600 s: share 16.
    # Job 1: 100 iterations by 1000 + 2000 s: share 8 (1000 s). 8 GPUs are left: job 1 gains
    # 400 s from 8 more (50 s per GPU); job 0's next faster count is 32 (24 is slower than 16),
    # 16 more GPUs, more than the 8 left. So job 1 gets them.
    tight = job_view(0, FLAT, deadline_s=NOW + 800)
    loose = job_view(1, FLAT, deadline_s=NOW + 2000)
    decision = decide("edf-vtrain", tight, loose)
    assert decision.rejections == {}
    assert decision.allocations == {0: 16, 1: 16}


def test_edf_vtrain_never_uses_a_count_that_is_slower_than_a_smaller_one():
    decision = decide("edf-vtrain", job_view(0, FLAT, deadline_s=NOW + 800), total=24)
    assert decision.allocations == {0: 16}  # 24 GPUs would be slower (6.5 s per iteration)


def test_edf_vtrain_admission_control_with_the_arithmetic():
    admitted = job_view(0, FLAT, deadline_s=NOW + 700, gpus=16, admitted=True)  # 600 s on its 16: keeps them
    alone_too_slow = job_view(1, FLAT, deadline_s=NOW + 300)  # 400 s on 32 GPUs at best
    crowded_out = job_view(2, FLAT, deadline_s=NOW + 500)  # needs 32 now, 16 are held
    later = job_view(3, FLAT, deadline_s=NOW + 2000)  # 1000 s on 8 GPUs: share 8
    decision = decide("edf-vtrain", admitted, alone_too_slow, crowded_out, later)
    assert decision.rejections == {
        1: "cannot finish by its deadline (0.36 h): on 32 GPUs, the fastest it expects, it would finish at 0.39 h",
        2: "cannot finish by its deadline (0.42 h) in the GPUs the jobs admitted before leave; "
           "alone it would need 32 GPUs from now"}
    assert decision.allocations == {0: 16, 3: 16}  # job 3: share 8, then the 8 left


def test_edf_linear_believes_one_node_times_the_gpus_and_admits_what_vtrain_rejects():
    # On 8 GPUs 10 s per iteration; really 8 s on 16, but linear believes 5 s: 100 iterations in
    # 500 s, within a 600 s deadline, where vtrain knows it takes 800 s.
    sublinear = ThroughputCurve.from_seconds({8: 10.0, 16: 8.0})
    job = job_view(0, sublinear, deadline_s=NOW + 600)
    assert decide("edf-linear", job).allocations == {0: 16}
    assert 0 in decide("edf-vtrain", job).rejections
    linear = POLICIES.get("edf-linear")()
    assert list(linear.believed_iteration_s(job, view(job))) == [10.0, 5.0]
    big = job_view(1, ThroughputCurve.from_seconds({16: 6.0, 32: 4.0}))  # no plan on one node: its smallest
    assert list(linear.believed_iteration_s(big, view(big))) == [6.0, 3.0]


def test_a_late_admitted_job_keeps_its_gpus_and_a_waiting_one_gets_leftovers():
    late = job_view(0, FLAT, deadline_s=NOW + 10, gpus=8, admitted=True)
    decision = decide("edf-vtrain", late, total=8)
    assert decision.allocations == {0: 8} and decision.rejections == {}


def test_capacity_profile_finds_the_smallest_count_at_its_earliest_start():
    profile = CapacityProfile(0.0, 16)
    profile.reserve(Reservation(gpus=8, start_s=0.0, end_s=100.0))
    counts = np.array([8, 16])
    # 16 GPUs for 50 s: from 100 (ends 150); 8 GPUs for 120 s: now (ends 120)
    assert profile.earliest(counts, np.array([120.0, 50.0]), np.array([120.0, 50.0]), 1e9) == \
        Reservation(gpus=8, start_s=0.0, end_s=120.0)
    assert profile.earliest(counts, np.array([200.0, 50.0]), np.array([200.0, 50.0]), 160) == \
        Reservation(gpus=16, start_s=100.0, end_s=150.0)
    assert profile.earliest(counts, np.array([200.0, 70.0]), np.array([200.0, 70.0]), 160) is None
    profile.reserve(Reservation(gpus=16, start_s=100.0, end_s=150.0))
    assert list(profile.times) == [0.0, 100.0, 150.0] and list(profile.free) == [8, 0, 16]
