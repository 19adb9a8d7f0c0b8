"""Reading training logs: every figure a fixture line states comes back, restarts and truncated
last lines are handled, and anything else is one ConfigError naming the file."""

import numpy as np
import pytest

from tests.support.training_logs import (Logged, iteration_line, megatron_log, nemo1_update, nemo2_line, tensorboard_dir,
                                 write_lines)
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.measured.logs import LogFormat, read_run_log

ENTRIES = [Logged(10, 1500.4, tflops=120.5), Logged(20, 1210.7, tflops=149.9),
           Logged(30, 1208.2, tflops=150.2, skipped=1), Logged(40, 1800.0, tflops=100.8, nan=2)]


def test_megatron_log_figures_equal_the_lines(tmp_path):
    lines = megatron_log(ENTRIES, world_size=8, memory=((0, 2048.5, 3072.0), (2, 4096.25, 5120.0)))
    log = read_run_log(write_lines(tmp_path / "train.log", lines))
    assert log.format is LogFormat.MEGATRON_LM and log.world_size == 8
    assert log.restart_lines == () and log.truncated_line is None
    rows = [(i.line, i.first_iteration, i.iteration, i.iteration_time_ms, i.tflops_per_gpu, i.global_batch_size,
             i.skipped_iterations, i.nan_iterations) for i in log.intervals]
    numbers = {line: n for n, line in enumerate(lines, start=1)}
    assert rows == [(numbers[iteration_line(e)], e.iteration - 9, e.iteration, e.ms, e.tflops, e.batch, e.skipped,
                     e.nan) for e in ENTRIES]
    assert [(m.rank, m.max_allocated_mib, m.max_reserved_mib) for m in log.memory] == [(0, 2048.5, 3072.0),
                                                                                        (2, 4096.25, 5120.0)]
    assert log.peak_memory_mib == 4096.25
    assert list(log.to_frame()["iteration_time_ms"]) == [e.ms for e in ENTRIES]


def test_a_restart_starts_a_segment_after_the_checkpoint_it_loaded(tmp_path):
    first = megatron_log([Logged(i, 1000.0 + i) for i in (10, 20, 30, 40)])
    second = megatron_log([Logged(i, 900.0 + i) for i in (30, 40, 50)], resumed_at=20)
    log = read_run_log(write_lines(tmp_path / "train.log", first + second))
    assert log.restart_lines == (len(first) + 2,)  # the arguments block of the second start
    assert [(i.segment, i.first_iteration, i.iteration, i.iteration_time_ms) for i in log.intervals] == [
        (0, 1, 10, 1010.0), (0, 11, 20, 1020.0), (0, 21, 30, 1030.0), (0, 31, 40, 1040.0),
        (1, 21, 30, 930.0), (1, 31, 40, 940.0), (1, 41, 50, 950.0)]


def test_an_iteration_going_back_without_a_new_start_is_a_restart(tmp_path):
    lines = megatron_log([Logged(10, 1000.0), Logged(20, 1001.0)]) + [iteration_line(Logged(10, 1100.0))]
    log = read_run_log(write_lines(tmp_path / "train.log", lines))
    assert log.restart_lines == (len(lines),)
    assert [(i.segment, i.first_iteration) for i in log.intervals] == [(0, 1), (0, 11), (1, 1)]


def test_a_truncated_last_line_is_left_out_and_reported(tmp_path):
    lines = megatron_log(ENTRIES) + [iteration_line(Logged(50, 1234.5))[:90]]
    log = read_run_log(write_lines(tmp_path / "train.log", lines, final_newline=False))
    assert log.truncated_line == len(lines)
    assert [i.iteration for i in log.intervals] == [10, 20, 30, 40]


def test_a_cut_line_inside_the_log_is_an_error(tmp_path):
    lines = megatron_log(ENTRIES)
    lines.insert(-1, iteration_line(Logged(35, 1.0))[:90])
    with pytest.raises(ConfigError, match=rf"train.log: line {len(lines) - 1}: iteration line does not end with"):
        read_run_log(write_lines(tmp_path / "train.log", lines))


def test_nemo1_progress_bar_refreshes(tmp_path):
    text = ("Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/16\n"
            + "".join(nemo1_update(step, 1.5 + step / 100, (step + 1) * 64) for step in range(6))
            + nemo1_update(5, 1.56, 6 * 64) + "\n")
    path = tmp_path / "nemo.log"
    path.write_text(text)
    log = read_run_log(path)
    assert log.format is LogFormat.NEMO and log.world_size == 16
    assert [(i.iteration, i.iteration_time_ms, i.global_batch_size) for i in log.intervals] == [
        (1, 1500.0, None), (2, 1510.0, 64), (3, 1520.0, 64), (4, 1530.0, 64), (5, 1540.0, 64), (6, 1560.0, 64)]


def test_nemo2_lines_and_a_truncated_bar(tmp_path):
    path = tmp_path / "nemo2.log"
    path.write_text("\n".join(nemo2_line(step, 2.25 + step, 128) for step in range(4)))
    log = read_run_log(path)
    assert [(i.iteration, i.iteration_time_ms, i.global_batch_size) for i in log.intervals] == [
        (1, 2250.0, 128), (2, 3250.0, 128), (3, 4250.0, 128)]
    assert log.truncated_line == 4


def test_tensorboard_scalars_written_by_a_real_writer(tmp_path):
    steps = [(10, 1.5), (20, 1.25), (30, 1.2), (40, 1.3)]
    tensorboard_dir(tmp_path / "tb", steps, world_size=16, batch=64, max_allocated_bytes=3.5 * 1024 ** 3)
    log = read_run_log(tmp_path / "tb")
    assert log.format is LogFormat.TENSORBOARD and log.world_size == 16
    assert [(i.first_iteration, i.iteration, i.global_batch_size) for i in log.intervals] == [
        (1, 10, 64), (11, 20, 64), (21, 30, 64), (31, 40, 64)]
    assert [i.iteration_time_ms for i in log.intervals] == [float(np.float32(s)) * 1000 for _, s in steps]
    assert log.peak_memory_mib == 3.5 * 1024


@pytest.mark.parametrize("content, rule", [
    (b"", "empty: not a training log"),
    (b"\x7fELF\x00\x01binary", r"binary data \(NUL bytes\): not a training log"),
    (b"\xff\xfe log", "not UTF-8 text: byte 0xff at offset 0"),
    (b"epoch 1 loss 0.3\n", "not a Megatron-LM or NeMo training log: no line holds 'elapsed time per iteration"),
    (b"elapsed time per iteration (ms) in the docs\n", "a megatron-lm log without one complete timed iteration"),
])
def test_what_is_not_a_training_log(tmp_path, content, rule):
    path = tmp_path / "bad.log"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=f"^{path}: {rule}"):
        read_run_log(path)


def test_a_folder_without_event_files(tmp_path):
    with pytest.raises(ConfigError, match="a folder without TensorBoard event files"):
        read_run_log(tmp_path)


def test_megatron_line_with_token_throughput_per_gpu_keeps_its_interval():
    # 512 sequences x 4,096 tokens / (4,096 tokens/s/GPU x 64 GPUs) = 8 s per iteration
    log = read_run_log("tests/fixtures/logs/token_throughput_megatron.log")
    first, second = log.intervals
    assert (first.first_iteration, first.iteration, first.iteration_time_ms) == (1, 10, 8000.0)
    assert first.tokens_per_second == 4096.0 * 64
    assert (second.first_iteration, second.iteration_time_ms) == (11, 7900.0)  # a logged time wins


def test_token_throughput_without_the_sizes_it_needs_is_one_line(tmp_path):
    path = tmp_path / "train.log"
    path.write_text(" iteration 10/ 100 | throughput (token/sec/GPU): 4096.0 | global batch size: 8 |\n")
    with pytest.raises(ConfigError, match=r"line 1: throughput \(token/sec/GPU\) \(4096.0\) without 'elapsed time "
                                          r"per iteration \(ms\)' gives the iteration time only with a positive "
                                          r"throughput and seq_length in the arguments block, the world size$"):
        read_run_log(path)
