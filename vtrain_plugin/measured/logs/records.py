"""What a training run's log states: its logged intervals of iterations, memory reports and GPU count.

Megatron-LM logs one line every ``--log-interval`` iterations with the mean time of the iterations
since the previous line, so a :class:`LoggedInterval` stands for ``iterations`` iterations; NeMo
and TensorBoard give one value per logged step in the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd


class LogFormat(StrEnum):
    MEGATRON_LM = "megatron-lm"
    NEMO = "nemo"
    TENSORBOARD = "tensorboard"


@dataclass(frozen=True, slots=True, kw_only=True)
class LoggedInterval:
    """One logged line: iterations ``first_iteration`` to ``iteration`` and their mean time."""

    iteration: int  # the last iteration of the interval, as logged
    first_iteration: int
    iteration_time_ms: float  # per iteration, the mean over the interval
    segment: int  # which start of the job logged it: 0, then one more after each restart
    line: int  # of the log file, from 1 (0 for TensorBoard events)
    global_batch_size: int | None = None
    tflops_per_gpu: float | None = None  # as the log computes it (Megatron's own FLOP count)
    tokens_per_second: float | None = None  # as the log states it
    skipped_iterations: int = 0
    nan_iterations: int = 0

    @property
    def iterations(self) -> int:
        return self.iteration - self.first_iteration + 1


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryReport:
    """The peak memory one rank reported (Megatron-LM's ``memory (MB)`` line; MB there are MiB)."""

    rank: int | None  # None when the source does not say (TensorBoard: the logging rank)
    max_allocated_mib: float
    max_reserved_mib: float | None = None
    line: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RunLog:
    """A parsed training log (or TensorBoard event folder) of one job."""

    path: str
    format: LogFormat
    intervals: tuple[LoggedInterval, ...]
    memory: tuple[MemoryReport, ...] = ()
    world_size: int | None = None  # GPUs of the job, when the log states them
    world_size_line: int = 0
    restart_lines: tuple[int, ...] = ()  # where each restart begins (the file of it, for TensorBoard: 0)
    truncated_line: int | None = None  # an incomplete last line, left out

    @property
    def peak_memory_mib(self) -> float | None:
        return max((m.max_allocated_mib for m in self.memory), default=None)

    def to_frame(self) -> pd.DataFrame:
        """One row per logged interval."""
        import pandas as pd  # here: reading a log needs none of it

        return pd.DataFrame([{
            "path": self.path, "segment": i.segment, "line": i.line, "first_iteration": i.first_iteration,
            "iteration": i.iteration, "iteration_time_ms": i.iteration_time_ms,
            "global_batch_size": i.global_batch_size, "tflops_per_gpu": i.tflops_per_gpu,
            "tokens_per_second": i.tokens_per_second, "skipped_iterations": i.skipped_iterations,
            "nan_iterations": i.nan_iterations} for i in self.intervals])
