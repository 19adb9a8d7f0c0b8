"""Invariants of every policy on generated job mixes (synthetic curves, so each example is fast):
no overcommit at any instant, whole allocation units on counts with a plan, every job finished or
rejected, and progress accounted exactly (every GPU-second after each restart trains)."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.planning.cluster.cluster_config import ClusterConfig
from vtrain_plugin.planning.cluster.curves import ThroughputCurve
from vtrain_plugin.planning.cluster.generator import MixSpec, generate_jobs
from vtrain_plugin.planning.cluster.jobs import job_from_entry
from vtrain_plugin.planning.cluster.policies import POLICIES
from vtrain_plugin.planning.cluster.simulator import simulate

NODE = get_cluster_preset("dgx-a100")


def synthetic_curves(cluster):
    """Compute-bound speed with a growing overhead, a slow point at every multiple of 3 GPUs (so
    some counts are worse than smaller ones), and a memory floor of 18 bytes per parameter."""
    def curve_for(model, batch):
        floor = model.num_parameters * 18 / 80e9
        counts = [n for n in cluster.allocatable_counts if n >= floor]
        if not counts:
            return ThroughputCurve(reason=f"needs {floor:.0f} GPUs")
        work_s = 6 * model.num_parameters * batch * model.seq_length / 150e12
        return ThroughputCurve.from_seconds({n: work_s / n * (1 + 0.05 * math.log2(n)) + (0.3 if n % 3 == 0 else 0)
                                             for n in counts})
    return curve_for


def check(result, jobs, curves, cluster):
    by_name = {job.name: job for job in jobs}
    changes = {}
    for segment in result.segments:
        assert segment.gpus % cluster.unit_gpus == 0 and segment.gpus in curves[segment.job].counts
        assert segment.end_s > segment.start_s >= by_name[segment.job].submit_s
        changes[segment.start_s] = changes.get(segment.start_s, 0) + segment.gpus
        changes[segment.end_s] = changes.get(segment.end_s, 0) - segment.gpus
    held = 0
    for time in sorted(changes):
        held += changes[time]
        assert 0 <= held <= cluster.total_gpus, f"{held} GPUs held at {time} s"
    for outcome in result.outcomes:
        segments = sorted((s for s in result.segments if s.job == outcome.name), key=lambda s: s.start_s)
        assert all(a.end_s <= b.start_s for a, b in zip(segments, segments[1:]))
        assert bool(outcome.rejected) != (outcome.finish_s is not None)
        if outcome.rejected:
            assert not segments and outcome.start_s is None
            continue
        assert segments[-1].end_s == outcome.finish_s and segments[0].start_s == outcome.start_s
        done = sum(max(0.0, s.end_s - s.start_s - result.restart_s) / curves[outcome.name].iteration_s(s.gpus)
                   for s in segments)
        assert math.isclose(done, by_name[outcome.name].iterations, rel_tol=1e-9)
        assert outcome.resizes == len(segments) - 1 + sum(a.end_s < b.start_s for a, b in zip(segments, segments[1:]))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), nodes=st.integers(1, 12), by_gpu=st.booleans(), jobs=st.integers(2, 25),
       slack=st.floats(1.0, 2.5), load=st.floats(0.3, 4.0), restart_s=st.sampled_from([0.0, 60.0, 600.0]))
def test_no_policy_overcommits_and_every_job_ends(seed, nodes, by_gpu, jobs, slack, load, restart_s):
    cluster = ClusterConfig(spec=NODE, nodes=nodes, granularity="gpu" if by_gpu else "node")
    curve_for = synthetic_curves(cluster)
    mix = MixSpec(jobs=jobs, seed=seed, slack=(slack, slack * 1.5), load=load, restart_s=restart_s,
                  hours=(0.05, 5.0))
    rows = generate_jobs(mix, cluster, curve_for)
    job_list = [job_from_entry(row, number=i) for i, row in enumerate(rows, start=1)]
    curves = {job.name: curve_for(job.model, job.global_batch_size) for job in job_list}
    for policy in POLICIES.names():
        result = simulate(job_list, curves, cluster, policy, restart_s=restart_s)
        check(result, job_list, curves, cluster)
