"""Predicted against measured on logs the tests write: vtrain_plugin.compare_run and vtrain compare."""

import json
from pathlib import Path

import numpy as np
import pytest

import vtrain_plugin as vtrain
from tests.support.megatron_examples import SMALL_GPT
from tests.support.training_logs import Logged, iteration_line, megatron_log, nemo2_line, tensorboard_dir, write_lines
from vtrain_plugin.core.errors import ConfigError

TIMES_MS = [64.0, 40.1, 39.8, 40.3, 39.9, 40.0, 48.5, 40.2, 39.7, 40.4, 40.1, 39.9]  # the 1st is warm-up


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "train.sh"
    path.write_text(SMALL_GPT)
    return path


@pytest.fixture(scope="module")
def small_estimate(plan):
    return vtrain.estimate(vtrain.load_megatron_script(plan))


def _log(tmp_path, name="train.log", times=TIMES_MS, **kwargs):
    entries = [Logged(10 * (i + 1), ms) for i, ms in enumerate(times)]
    return write_lines(tmp_path / name, megatron_log(entries, world_size=8, **kwargs))


def test_compare_run_states_the_logged_figures(tmp_path, small_estimate):
    log = _log(tmp_path, memory=((0, 2048.5, 3072.0), (2, 3000.0, 3500.0)))
    c = vtrain.compare_run(small_estimate, log)
    used = TIMES_MS[1:]
    assert c.measured_iteration_time_ms == float(np.median(used)) and c.intervals_used == 11
    assert c.iterations_used == 110 and c.warmup_iterations == 10
    assert (c.measured_p10_ms, c.measured_p90_ms) == (float(np.percentile(used, 10)), float(np.percentile(used, 90)))
    assert [(s.first_iteration, s.iteration, s.iteration_time_ms) for s in c.slow] == [(61, 70, 48.5)]
    assert c.measured_peak_allocated_gib == 3000.0 / 1024 and c.logged_tflops_per_gpu == 150.0
    assert c.measured_peak_reserved_gib == 3500.0 / 1024
    ratio = small_estimate.iteration_time_ms / c.measured_iteration_time_ms
    assert c.measured_mfu == small_estimate.mfu * ratio
    assert c.iteration_time_error_pct == pytest.approx(100 * (ratio - 1))
    assert c.drift_pct == pytest.approx(100 * (np.median(used[-3:]) / np.median(used[:3]) - 1))
    frame = c.to_frame()
    assert list(frame["quantity"]) == ["iteration_time_ms", "tokens_per_second", "tflops_per_gpu", "mfu",
                                       "peak_allocated_gib"]
    assert frame["measured"].iloc[0] == c.measured_iteration_time_ms


def test_restarts_and_truncation_pool_with_tensorboard(tmp_path, small_estimate):
    restarted = megatron_log([Logged(i, 41.0) for i in (10, 20, 30)]) + megatron_log(
        [Logged(i, ms) for i, ms in ((30, 70.0), (40, 39.0), (50, 39.5))], resumed_at=20)
    text_log = write_lines(tmp_path / "train.log", restarted + [iteration_line(Logged(60, 1.0))[:70]],
                           final_newline=False)
    events = tensorboard_dir(tmp_path / "tb", [(10, 0.09), (20, 0.0405), (30, 0.0395)])
    c = vtrain.compare_run(small_estimate, [text_log, events])
    # Warm-up: the first interval of each start (iterations 1-10, 21-30 after the restart, and 1-10 in TensorBoard).
    used = [41.0, 41.0, 39.0, 39.5, float(np.float32(0.0405)) * 1000, float(np.float32(0.0395)) * 1000]
    assert c.measured_iteration_time_ms == float(np.median(used)) and c.intervals_used == 6
    assert c.restarts == 1 and c.truncated == (f"{text_log}:{len(restarted) + 1}",)


def test_a_log_of_another_plan_is_refused(tmp_path, small_estimate):
    other_batch = write_lines(tmp_path / "batch.log", megatron_log([Logged(10, 40.0, batch=64)]))
    with pytest.raises(ConfigError) as batch:
        vtrain.compare_run(small_estimate, other_batch)
    line = 1 + megatron_log([Logged(10, 40.0, batch=64)]).index(iteration_line(Logged(10, 40.0, batch=64)))
    assert str(batch.value) == f"{other_batch}: line {line}: log says global batch size 64, plan has 32"
    other_gpus = write_lines(tmp_path / "gpus.log", megatron_log([Logged(10, 40.0)], world_size=16))
    with pytest.raises(ConfigError, match=rf"^{other_gpus}: line 1: log says 16 GPUs, plan has 8$"):
        vtrain.compare_run(small_estimate, other_gpus)
    nemo = tmp_path / "nemo.log"
    nemo.write_text("\n".join(nemo2_line(step, 0.04, 128) for step in range(3)) + "\n")
    with pytest.raises(ConfigError, match=r"line 1: log says global batch size 128, plan has 32$"):
        vtrain.compare_run(small_estimate, nemo)


def test_compare_cli_formats_plot_and_errors(tmp_path, plan, run_cli, small_estimate):
    log = _log(tmp_path)
    table = run_cli("compare", str(plan), str(log), "--plot", str(tmp_path / "c.png"), check=True,
                    fresh=True)  # vtrain compare in a plain subprocess
    assert f"{plan} against 1 run ({log})" in table.stdout
    assert "slow intervals (> 1.2 x median): iterations 61-70 48.5 ms (1.21 x" in table.stdout
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    document = json.loads(run_cli("compare", str(plan), str(log), "--format", "json", check=True).stdout)
    assert document["plan"] == str(plan) and document["measured_iteration_time_ms"] == float(np.median(TIMES_MS[1:]))
    assert document["predicted_iteration_time_ms"] == pytest.approx(small_estimate.iteration_time_ms)
    two = run_cli("compare", str(plan), str(log), str(plan), str(log), "--format", "csv", check=True)
    assert two.stdout.splitlines()[0] == "plan,quantity,predicted,measured,error_pct" and len(two.stdout.splitlines()) == 11
    binary = tmp_path / "core.log"
    binary.write_bytes(b"\x00\x01\x02")
    for args, message in (
            ((str(plan), str(binary)), f"{binary}: binary data (NUL bytes): not a training log"),
            ((str(log),), f"{log}: a run log before any plan: give the plan first"),
            ((str(plan), str(write_lines(tmp_path / "b.log", megatron_log([Logged(10, 4.0, batch=64)])))),
             "log says global batch size 64, plan has 32")):
        proc = run_cli("compare", *args)
        errors = [line for line in proc.stderr.splitlines() if not line.startswith(("vtrain: warning: ", "vtrain: note: "))]
        assert proc.returncode == 2 and len(errors) == 1  # the plan's own warning and default-GPU note aside
        assert errors[0].startswith("vtrain: error: ") and message in errors[0]


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


# A NeMo log does not say where its first interval began, so its job starts at the first logged
# iteration (10): the interval 11-20 falls in the warm-up too, where Megatron-LM's job starts at 1.
@pytest.mark.parametrize("log, intervals_used", [("small_gpt_megatron.log", 11), ("small_gpt_nemo2.log", 10)])
def test_compare_cli_on_the_fixture_logs(run_cli, log, intervals_used):
    """The files a user can point the CLI at by hand (tests/fixtures/logs/README.md) read as written."""
    proc = run_cli("compare", str(FIXTURES / "launch_scripts" / "small_gpt.sh"), str(FIXTURES / "logs" / log),
                   "--format", "json", check=True)
    row = json.loads(proc.stdout)
    used = TIMES_MS[len(TIMES_MS) - intervals_used:]
    assert row["measured_iteration_time_ms"] == pytest.approx(float(np.median(used)))
    assert row["intervals_used"] == intervals_used


def test_compare_sets_peak_allocated_against_max_allocated(run_cli):
    """Like for like: the fixture log's ``max allocated`` (2048.5 MiB) against the predicted tensors
    alone; the allowance and the total it makes are printed beside, with the log's max reserved."""
    script = FIXTURES / "launch_scripts" / "small_gpt.sh"
    log = FIXTURES / "logs" / "small_gpt_megatron.log"
    est = vtrain.estimate(vtrain.load_megatron_script(script))
    row = json.loads(run_cli("compare", str(script), str(log), "--format", "json", check=True).stdout)
    assert row["measured_peak_allocated_gib"] == 2048.5 / 1024 and row["measured_peak_reserved_gib"] == 3072.0 / 1024
    assert row["predicted_peak_allocated_gib"] == pytest.approx(max(m.tensors_gib for m in est.memory_gib))
    assert row["predicted_peak_allocated_gib"] < row["predicted_peak_memory_gib"]
    assert row["peak_allocated_gib_error_pct"] == pytest.approx(
        100 * (row["predicted_peak_allocated_gib"] / (2048.5 / 1024) - 1))
    neediest = max(est.memory_gib, key=lambda m: m.total_gib)
    assert row["predicted_allowance_gib"] == pytest.approx(neediest.allowance_gib)
    assert row["predicted_peak_memory_gib"] == pytest.approx(est.peak_memory_gib)
    table = run_cli("compare", str(script), str(log), check=True).stdout
    allocated = next(line for line in table.splitlines() if line.startswith("peak allocated GiB"))
    assert allocated.split()[3:5] == [f"{row['predicted_peak_allocated_gib']:,.2f}", "2.00"]
    assert (f"with the predicted allowance {neediest.allowance_gib:,.2f} GiB (context, NCCL buffers, cuDNN and "
            f"scratch buffers, fragmentation; the cuBLAS workspaces count in allocated) the GPU needs "
            f"{est.peak_memory_gib:,.2f} GiB; the logs' max reserved 3.00 GiB") in table
