"""A TensorBoard event folder written by Megatron-LM (``--tensorboard-dir``), read with
TensorBoard's own ``EventAccumulator``.

Megatron-LM writes, every log interval, ``iteration-time`` (seconds per iteration, the mean over the
interval; with ``--log-timers-to-tensorboard``), ``throughput`` (TFLOP/s per GPU, with
``--log-throughput``), ``batch-size``, ``world-size`` and ``mem-max-allocated-bytes`` (with
``--log-batch-size-to-tensorboard``, ``--log-world-size-to-tensorboard`` and
``--log-memory-to-tensorboard``), each at the step of its iteration. Each events file is one start of
the job: a second file is a restart. Values are stored as 32-bit floats.
"""

from __future__ import annotations

from pathlib import Path

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.units import MS_PER_S
from vtrain_plugin.measured.logs.records import LogFormat, LoggedInterval, MemoryReport, RunLog

TIME_TAG = "iteration-time"
_MIB = 1024 * 1024


def read_tensorboard_dir(path: str) -> RunLog:
    """The logged intervals, peak memory, GPU count and restarts of the event files in ``path``."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator
    except ImportError:
        raise ConfigError(f"{path}: reading TensorBoard events needs the tensorboard package "
                          f"(pip install 'vtrain[tensorboard]')") from None
    files = sorted(Path(path).glob("events.out.tfevents.*"))
    if not files:
        raise ConfigError(f"{path}: a folder without TensorBoard event files (events.out.tfevents.*)")
    intervals: list[LoggedInterval] = []
    memory: list[MemoryReport] = []
    world_sizes: set[int] = set()
    for segment, file in enumerate(files):
        accumulator = EventAccumulator(str(file), size_guidance={SCALARS: 0})
        accumulator.Reload()
        tags = set(accumulator.Tags()["scalars"])
        scalars = {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in tags}
        times = scalars.get(TIME_TAG, {})
        if not times and len(files) == 1:
            raise ConfigError(f"{path}: no {TIME_TAG!r} scalar: Megatron-LM writes it with "
                              f"--log-timers-to-tensorboard")
        steps = sorted(times)
        # The first interval of a start is as long as the next one (Megatron logs at a fixed interval).
        previous = None if len(steps) < 2 else max(0, 2 * steps[0] - steps[1])
        for step in steps:
            if not times[step] > 0:
                raise ConfigError(f"{file}: {TIME_TAG} at step {step} must be positive, got {times[step]}")
            batch = scalars.get("batch-size", {}).get(step)
            intervals.append(LoggedInterval(
                iteration=step, first_iteration=step if previous is None else previous + 1,
                iteration_time_ms=times[step] * MS_PER_S, segment=segment, line=0,
                global_batch_size=None if batch is None else round(batch),
                tflops_per_gpu=scalars.get("throughput", {}).get(step)))
            previous = step
        peak = scalars.get("mem-max-allocated-bytes")
        if peak:
            memory.append(MemoryReport(rank=None, max_allocated_mib=max(peak.values()) / _MIB))
        world_sizes.update(round(v) for v in scalars.get("world-size", {}).values())
    if len(world_sizes) > 1:
        raise ConfigError(f"{path}: world-size takes several values ({sorted(world_sizes)}): one folder per job")
    return RunLog(path=path, format=LogFormat.TENSORBOARD, intervals=tuple(intervals), memory=tuple(memory),
                  world_size=next(iter(world_sizes), None), restart_lines=tuple(0 for _ in files[1:]))
