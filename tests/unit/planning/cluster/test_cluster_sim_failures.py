"""Failures in the cluster simulation: seeded and reproducible, work lost back to the last
checkpoint, restarts in place, and the lost GPU-hours reported; the one-job mean against the goodput
model's expectation."""

import math

import numpy as np
import pytest

from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.planning.cluster.cluster_config import ClusterConfig
from vtrain_plugin.planning.cluster.curves import ThroughputCurve
from vtrain_plugin.planning.cluster.failures import FailureModel
from vtrain_plugin.planning.cluster.jobs import Job
from vtrain_plugin.planning.cluster.report import summarize
from vtrain_plugin.planning.cluster.simulator import simulate
from vtrain_plugin.planning.model_family import model_preset
from vtrain_plugin.sim.goodput import expected_run
from vtrain_plugin.specs.reliability import ReliabilitySpec

NODE = get_cluster_preset("dgx-a100")
ONE_NODE = ClusterConfig(spec=NODE, nodes=1)
MODEL = model_preset("gpt3-1.3b")
HOUR = 3600.0
# 0.01 failures per GPU-hour on 8 GPUs: one every 12.5 hours
FAILING = FailureModel(reliability=ReliabilitySpec(failure_rate_per_gpu_hour=0.01), seed=7)


def job(iterations):
    return Job(name="a", submit_s=0, model=MODEL, global_batch_size=1, tokens=iterations * 2048,
               deadline_s=1000 * HOUR, requested_gpus=8)


def run(failures, iterations=100 * 3600, seed=None):
    if seed is not None:
        failures = FailureModel(reliability=failures.reliability, seed=seed)
    curve = ThroughputCurve.from_seconds({8: 1.0})
    return simulate([job(iterations)], {"a": curve}, ONE_NODE, "fifo-static", restart_s=600, failures=failures)


def test_failures_are_seeded_reproducible_and_cost_lost_gpu_hours():
    first, again = run(FAILING), run(FAILING)
    assert first.outcomes == again.outcomes and first.segments == again.segments
    outcome = first.outcomes[0]
    assert outcome.failures > 0 and outcome.lost_gpu_seconds > 0
    assert outcome.resizes == 0  # restarts in place are not resizes
    assert len(first.segments) == outcome.failures + 1
    clean = run(None).outcomes[0]
    assert clean.failures == 0 and clean.finish_s == 600 + 100 * 3600
    # what failures add to the GPU-hours is their lost work and restarts, plus the checkpoint stalls
    checkpointing = FAILING.checkpointing(MODEL, gpus=8, gpus_per_node=8, gpu=NODE.gpu)
    stalls = 8 * (checkpointing.stretch - 1) * 100 * 3600
    assert outcome.gpu_seconds == pytest.approx(clean.gpu_seconds + outcome.lost_gpu_seconds + stalls, rel=1e-9)
    summary = summarize(first)
    assert summary["failures"] == outcome.failures
    assert summary["lost_gpu_hours"] == outcome.lost_gpu_seconds / HOUR
    assert "failures" not in summarize(run(None))


def test_one_job_s_mean_time_is_the_goodput_model_s():
    checkpointing = FAILING.checkpointing(MODEL, gpus=8, gpus_per_node=8, gpu=NODE.gpu)
    compute_s = 100 * 3600.0
    expected = expected_run(compute_s=compute_s, interval_s=checkpointing.interval_s, stall_s=checkpointing.stall_s,
                            restart_s=600.0, mtbf_s=checkpointing.mtbf_s)
    walls = np.array([run(FAILING, seed=seed).outcomes[0].finish_s - 600 for seed in range(300)])
    # the simulation's first restart (600 s at the start) is not a failure's; Daly's model has none
    assert abs(walls.mean() - expected.wall_s) < 4 * walls.std() / math.sqrt(len(walls))
