"""The goodput model: Daly's expected run against a Monte-Carlo draw of the same failure process,
Young/Daly intervals for known inputs, the interval in whole iterations, checkpoint times, and the
reliability section's one-line errors."""

import math

import numpy as np
import pytest

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.cost.checkpoint import CheckpointSize, CheckpointTimes, checkpoint_times
from vtrain_plugin.sim.goodput import daly_interval_s, expected_run, simulate_run, young_interval_s
from vtrain_plugin.sim.run_totals import choose_interval, train_totals
from vtrain_plugin.specs.plan_file import parse_plan
from vtrain_plugin.specs.reliability import (FAILURE_RATES_PER_GPU_HOUR, CheckpointMode, FailurePreset,
                                             ReliabilitySpec)


@pytest.mark.parametrize("interval_s,stall_s,restart_s,mtbf_s", [
    (3600.0, 60.0, 900.0, 3 * 3600.0),  # 16k GPUs: a failure every 3 hours
    (1800.0, 5.0, 600.0, 20 * 3600.0),
    (7200.0, 300.0, 1800.0, 2 * 3600.0),  # segments as long as the MTBF: many retries
])
def test_expected_run_is_the_monte_carlo_mean_of_the_same_process(interval_s, stall_s, restart_s, mtbf_s):
    segments = 2_000
    expected = expected_run(compute_s=segments * interval_s, interval_s=interval_s, stall_s=stall_s,
                            restart_s=restart_s, mtbf_s=mtbf_s)
    rng = np.random.default_rng(2024)
    draws = [simulate_run(rng, segments=segments, interval_s=interval_s, stall_s=stall_s, restart_s=restart_s,
                          mtbf_s=mtbf_s) for _ in range(40)]
    wall = np.mean([d.wall_s for d in draws])
    failures = np.array([d.failures for d in draws])
    assert abs(wall / expected.wall_s - 1) < 0.01
    assert abs(failures.mean() - expected.failures) < 4 * failures.std() / math.sqrt(len(draws))
    assert expected.wall_s == pytest.approx(  # Daly's closed form
        mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + stall_s) / mtbf_s) * segments)


def test_the_parts_of_the_wall_time_add_up():
    run = expected_run(compute_s=1e6, interval_s=3600.0, stall_s=60.0, restart_s=900.0, mtbf_s=3 * 3600.0)
    assert run.compute_s == 1e6
    assert run.checkpoint_s == pytest.approx(1e6 / 3600.0 * 60.0)
    assert run.wall_s == run.compute_s + run.checkpoint_s + run.lost_s + run.restart_s
    assert run.goodput == run.compute_s / run.wall_s
    assert 0 < run.lost_s and 0 < run.restart_s


def test_young_and_daly_intervals_for_known_inputs():
    assert young_interval_s(50.0, 10_000.0) == 1000.0
    # Daly: sqrt(2 d M) [1 + sqrt(d/2M)/3 + (d/2M)/9] - d, with d/2M = 1/400
    assert daly_interval_s(50.0, 10_000.0) == pytest.approx(1000.0 * (1 + 0.05 / 3 + 0.0025 / 9) - 50.0)
    assert daly_interval_s(30_000.0, 10_000.0) == 10_000.0  # delta >= 2M: M
    # Daly's is the minimum of the expected wall time (to the fourth digit)
    best = daly_interval_s(50.0, 10_000.0)
    wall = [expected_run(compute_s=1e6, interval_s=t, stall_s=50.0, restart_s=600.0, mtbf_s=10_000.0).wall_s
            for t in (0.9 * best, best, 1.1 * best)]
    assert wall[1] < wall[0] and wall[1] < wall[2]


def test_the_interval_is_daly_s_in_whole_iterations_and_async_no_shorter_than_the_write():
    times = CheckpointTimes(write_s=50.0, load_s=50.0, host_copy_s=0.5)
    assert choose_interval(times, CheckpointMode.SYNC, mtbf_s=10_000.0, iteration_s=10.0, iterations=10**6) == \
        round(daly_interval_s(50.0, 10_000.0) / 10.0)
    # async: Daly's for the 0.5 s copy is 99.5 s, shorter than the 50 s write? no: 99.5 s > 50 s
    assert choose_interval(times, CheckpointMode.ASYNC, mtbf_s=10_000.0, iteration_s=10.0, iterations=10**6) == 10
    slow_write = CheckpointTimes(write_s=500.0, load_s=500.0, host_copy_s=0.5)
    assert choose_interval(slow_write, CheckpointMode.ASYNC, mtbf_s=10_000.0, iteration_s=10.0,
                           iterations=10**6) == 50
    assert choose_interval(times, CheckpointMode.SYNC, mtbf_s=10_000.0, iteration_s=10.0, iterations=7) == 7
    # an async save waits for the previous one's write when the interval is shorter than it
    assert slow_write.stall_at_interval_s(CheckpointMode.ASYNC, 100.0) == 0.5 + 400.0
    assert slow_write.stall_at_interval_s(CheckpointMode.ASYNC, 600.0) == 0.5
    assert slow_write.stall_at_interval_s(CheckpointMode.SYNC, 600.0) == 500.0


def test_checkpoint_times_are_bound_by_the_nodes_and_the_file_system():
    size = CheckpointSize(parameters=10**9, model_nbytes=2 * 10**9, optimizer_nbytes=12 * 10**9)
    spec = ReliabilitySpec(storage_write_gbytes_per_s_per_node=2.0, storage_write_gbytes_per_s_total=10.0,
                           storage_read_gbytes_per_s_per_node=4.0, storage_read_gbytes_per_s_total=100.0)
    two_nodes = checkpoint_times(size, spec, num_gpus=16, gpus_per_node=8, host_link_gbytes_per_s=28.0)
    assert two_nodes.write_s == 14.0 / 4.0  # 2 nodes x 2 GB/s
    assert two_nodes.load_s == 14.0 / 8.0
    assert two_nodes.host_copy_s == 14.0 / 16 / 28.0
    many = checkpoint_times(size, spec, num_gpus=800, gpus_per_node=8, host_link_gbytes_per_s=28.0)
    assert many.write_s == 14.0 / 10.0  # the file system's 10 GB/s
    assert many.load_s == 14.0 / 100.0


def test_failures_off_gives_the_failure_free_totals_exactly():
    common = dict(tokens=1e12, iterations=1000, iteration_s=12.5, num_gpus=1024, gpus_per_node=8,
                  price_per_gpu_hour_usd=2.0, host_link_gbytes_per_s=64.0,
                  checkpoint_size=CheckpointSize(parameters=10**9, model_nbytes=2 * 10**9, optimizer_nbytes=12 * 10**9))
    off = train_totals(**common, reliability=None)
    assert (off.days, off.gpu_hours, off.cost_usd, off.goodput) == (
        1000 * 12.5 / 86400, 1000 * 12.5 * 1024 / 3600, 1000 * 12.5 * 1024 / 3600 * 2.0, 1.0)
    on = train_totals(**common, reliability=ReliabilitySpec())
    assert (on.ideal_days, on.ideal_gpu_hours, on.ideal_cost_usd) == (off.days, off.gpu_hours, off.cost_usd)
    assert on.days > off.days and on.goodput < 1
    assert on.failures.mtbf_hours == pytest.approx(1 / (FAILURE_RATES_PER_GPU_HOUR[FailurePreset.LARGE_SCALE] * 1024))


def test_presets_are_the_published_rates():
    assert FAILURE_RATES_PER_GPU_HOUR[FailurePreset.LARGE_SCALE] == 419 / (16_384 * 54 * 24)
    assert ReliabilitySpec().mean_hours_between_failures(16_384) == pytest.approx(54 * 24 / 419)
    assert ReliabilitySpec(failures="typical").rate_per_gpu_hour == 1.5 / (384 * 168)
    assert ReliabilitySpec(failure_rate_per_gpu_hour=1e-4).rate_per_gpu_hour == 1e-4


@pytest.mark.parametrize("fields,message", [
    ({"failure_rate_per_gpu_hour": -1e-5}, "reliability.failure_rate_per_gpu_hour must be positive, got -1e-05"),
    ({"failure_rate_per_gpu_hour": 0}, "reliability.failure_rate_per_gpu_hour must be positive, got 0"),
    ({"storage_write_gbytes_per_s_total": 0}, "reliability.storage_write_gbytes_per_s_total must be positive, got 0"),
    ({"restart_minutes": -5}, "reliability.restart_minutes must be a non-negative number, got -5"),
    ({"checkpoint": "lazy"}, "reliability.checkpoint must be one of sync, async; got 'lazy'"),
    ({"failures": "never"}, "reliability.failures must be one of reliable, typical, large-scale; got 'never'"),
    ({"checkpoint_interval_iterations": 1.5},
     "reliability.checkpoint_interval_iterations must be a positive integer, got 1.5"),
])
def test_bad_reliability_is_one_line_naming_the_field(fields, message):
    with pytest.raises(ConfigError) as exc:
        ReliabilitySpec(**fields)
    assert str(exc.value) == message


def test_an_interval_longer_than_the_run_is_clamped_to_it_and_says_so():
    common = dict(tokens=1e12, iterations=1000, iteration_s=12.5, num_gpus=1024, gpus_per_node=8,
                  price_per_gpu_hour_usd=2.0, host_link_gbytes_per_s=64.0,
                  checkpoint_size=CheckpointSize(parameters=10**9, model_nbytes=2 * 10**9, optimizer_nbytes=12 * 10**9))
    long = train_totals(**common, reliability=ReliabilitySpec(checkpoint_interval_iterations=5000))
    run_length = train_totals(**common, reliability=ReliabilitySpec(checkpoint_interval_iterations=1000))
    assert (long.failures.interval_iterations, long.failures.interval_clamped_from) == (1000, 5000)
    assert long.failures.to_dict()["checkpoint_interval_clamped_from"] == 5000
    assert run_length.failures.interval_clamped_from is None
    assert long.days == run_length.days


PLAN = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 128},
        "parallel": {"micro_batch_size": 1}, "training": {"global_batch_size": 8}}


def test_plan_files_read_a_reliability_section_or_turn_failures_off():
    assert parse_plan(PLAN).training.reliability == ReliabilitySpec()
    spec = parse_plan({**PLAN, "reliability": {"failures": "reliable", "checkpoint": "async"}}).training.reliability
    assert (spec.failures, spec.checkpoint) == (FailurePreset.RELIABLE, CheckpointMode.ASYNC)
    assert parse_plan({**PLAN, "reliability": "off"}).training.reliability is None
    assert parse_plan({**PLAN, "reliability": None}).training.reliability is None
    with pytest.raises(ConfigError, match="reliability: unknown key 'mtbf'"):
        parse_plan({**PLAN, "reliability": {"mtbf": 3}})
    with pytest.raises(ConfigError, match="top-level reliability section"):
        parse_plan({**PLAN, "training": {"global_batch_size": 8, "reliability": {}}})
