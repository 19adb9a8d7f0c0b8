"""Megatron-LM's training log (the stdout of ``pretrain_gpt.py``), as ``training_log`` and
``report_memory`` in ``megatron/training`` write it::

     [2024-05-01 12:00:00] iteration       20/     500 | consumed samples:        10240 | elapsed time per
       iteration (ms): 12345.6 | throughput per GPU (TFLOP/s/GPU): 180.2 | learning rate: 1.500000E-04 |
       global batch size:   512 | lm loss: 7.123456E+00 | loss scale: 1.0 | grad norm: 1.234 |
       number of skipped iterations:   0 | number of nan iterations:   0 |
    [Rank 0] (after 20 iterations) memory (MB) | allocated: 1024.5 | max allocated: 20480.2 | reserved: ...

(one line each; Megatron-LM's ``training.py`` is not part of megatron-core, so the format is the one
of its releases from 2024 on, read field by field: fields this reader does not use may come and go).
The GPU count comes from the arguments block (``world_size ....... 64``) or the ``using world size:``
line. A restart shows as a new arguments block or as an iteration number that goes back; the first
interval of each start begins after the checkpoint it loaded (``loaded checkpoint ... at iteration
N``), else at iteration 1, or one log interval earlier for a restart that does not say.
"""

from __future__ import annotations

import re

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.measured.logs.records import LogFormat, LoggedInterval, MemoryReport, RunLog

TIME_FIELD = "elapsed time per iteration (ms)"
# Logs that state the interval as tokens per second per GPU instead: the time per iteration is
# global batch size x --seq-length (arguments block) / (that throughput x world size).
TOKEN_THROUGHPUT_FIELD = "throughput (token/sec/GPU)"
_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|")
_MEMORY = re.compile(r"\[Rank (\d+)\].*memory \(MB\)\s*\|(.*)$")
_ARGUMENTS_START = re.compile(r"^-+ arguments -+$")
_ARGUMENT = re.compile(r"^\s+(\w+) \.+ (.*?)\s*$")
_WORLD_SIZE = re.compile(r"using world size: (\d+)")
_CHECKPOINT = re.compile(r"loaded checkpoint .* at iteration (\d+)")
_INT_FIELDS = {"global batch size": "global_batch_size", "number of skipped iterations": "skipped_iterations",
               "number of nan iterations": "nan_iterations"}
_FLOAT_FIELDS = {"throughput per GPU (TFLOP/s/GPU)": "tflops_per_gpu", "tokens per second": "tokens_per_second"}


class _Reader:
    def __init__(self, path: str) -> None:
        self.path = path
        self.intervals: list[LoggedInterval] = []
        self.memory: list[MemoryReport] = []
        self.world_size: int | None = None
        self.world_size_line = 0
        self.restart_lines: list[int] = []
        self.log_interval: int | None = None
        self.seq_length: int | None = None
        self.resumed_at: int | None = None  # the checkpoint iteration the current start loaded
        self.segment_start_pending = False

    def error(self, number: int, rule: str) -> ConfigError:
        return ConfigError(f"{self.path}: line {number}: {rule}")

    def restart(self, number: int) -> None:
        """A new start of the job begins at line ``number`` (before its first iteration line)."""
        if self.intervals and not self.segment_start_pending:
            self.restart_lines.append(number)
            self.segment_start_pending = True

    def argument(self, name: str, value: str, number: int) -> None:
        if name == "world_size":
            self.set_world_size(value, number)
        elif name == "log_interval" and value.isdigit():
            self.log_interval = int(value)
        elif name == "seq_length" and value.isdigit():
            self.seq_length = int(value)

    def set_world_size(self, value: str, number: int) -> None:
        size = int(value) if value.isdigit() else 0
        if size <= 0:
            raise self.error(number, f"world size {value!r} is not a positive integer")
        if self.world_size is not None and size != self.world_size:
            raise self.error(number, f"world size {size} differs from the {self.world_size} GPUs of line "
                                     f"{self.world_size_line}: one log per job")
        if self.world_size is None:
            self.world_size, self.world_size_line = size, number

    def iteration(self, match: re.Match[str], line: str, number: int) -> None:
        iteration = int(match.group(1))
        fields = self.fields(line[match.end():], number)
        if TIME_FIELD not in fields and TOKEN_THROUGHPUT_FIELD not in fields:
            raise self.error(number, f"iteration line without {TIME_FIELD!r} or {TOKEN_THROUGHPUT_FIELD!r}")
        previous = self.intervals[-1] if self.intervals else None
        if previous is not None and iteration <= previous.iteration and not self.segment_start_pending:
            self.restart(number)
        if previous is None or self.segment_start_pending:
            first = self.first_of_segment(iteration, restarted=previous is not None)
            self.resumed_at = None
        else:
            first = previous.iteration + 1
        values = {"iteration_time_ms": self.time_ms(fields, number)}
        if TOKEN_THROUGHPUT_FIELD in fields and self.world_size is not None:
            values["tokens_per_second"] = (self.number(fields[TOKEN_THROUGHPUT_FIELD], TOKEN_THROUGHPUT_FIELD, number)
                                           * self.world_size)
        for name, key in _FLOAT_FIELDS.items():
            if name in fields:
                values[key] = self.number(fields[name], name, number)
        for name, key in _INT_FIELDS.items():
            if name in fields:
                values[key] = self.integer(fields[name], name, number)
        self.intervals.append(LoggedInterval(iteration=iteration, first_iteration=first,
                                             segment=len(self.restart_lines), line=number, **values))
        self.segment_start_pending = False

    def time_ms(self, fields: dict[str, str], number: int) -> float:
        """The mean iteration time of the interval: logged, or from the tokens per second per GPU."""
        if TIME_FIELD in fields:
            return self.number(fields[TIME_FIELD], TIME_FIELD, number)
        per_gpu = self.number(fields[TOKEN_THROUGHPUT_FIELD], TOKEN_THROUGHPUT_FIELD, number)
        missing = [what for what, known in (("'global batch size' on the line", "global batch size" in fields),
                                            ("seq_length in the arguments block", self.seq_length),
                                            ("the world size", self.world_size)) if not known]
        if missing or not per_gpu > 0:
            raise self.error(number, f"{TOKEN_THROUGHPUT_FIELD} ({fields[TOKEN_THROUGHPUT_FIELD]}) without "
                                     f"{TIME_FIELD!r} gives the iteration time only with a positive throughput and "
                                     + ", ".join(missing or ["the fields above"]))
        tokens = self.integer(fields["global batch size"], "global batch size", number) * self.seq_length
        return 1000.0 * tokens / (per_gpu * self.world_size)

    def first_of_segment(self, iteration: int, *, restarted: bool) -> int:
        if self.resumed_at is not None and self.resumed_at < iteration:
            return self.resumed_at + 1
        if restarted and self.log_interval is not None:
            return max(1, iteration - self.log_interval + 1)
        return 1 if not restarted else iteration

    def fields(self, rest: str, number: int) -> dict[str, str]:
        fields = {}
        for part in rest.split("|"):
            name, sep, value = part.partition(":")
            if sep:
                fields[name.strip()] = value.strip()
            elif part.strip():
                raise self.error(number, f"field {part.strip()!r} has no 'name: value' form")
        return fields

    def number(self, text: str, name: str, number: int) -> float:
        try:
            value = float(text)
        except ValueError:
            raise self.error(number, f"{name} {text!r} is not a number") from None
        if not value > 0 and name == TIME_FIELD:
            raise self.error(number, f"{name} must be positive, got {text}")
        return value

    def integer(self, text: str, name: str, number: int) -> int:
        if not text.isdigit():
            raise self.error(number, f"{name} {text!r} is not a non-negative integer")
        return int(text)

    def memory_report(self, match: re.Match[str], number: int) -> None:
        fields = self.fields(match.group(2), number)
        if "max allocated" not in fields:
            raise self.error(number, "memory report without 'max allocated'")
        reserved = fields.get("max reserved")
        self.memory.append(MemoryReport(
            rank=int(match.group(1)), line=number,
            max_allocated_mib=self.number(fields["max allocated"], "max allocated", number),
            max_reserved_mib=None if reserved is None else self.number(reserved, "max reserved", number)))


def read_megatron_log(path: str, lines: list[str], *, complete_last_line: bool) -> RunLog:
    """The intervals, memory reports, GPU count and restarts of a Megatron-LM log's ``lines``; an
    iteration line cut short at the end of the file (no closing ``|``, and no newline after it) is
    left out and reported, anywhere else it is an error."""
    reader = _Reader(path)
    in_arguments = False
    truncated = None
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if _ARGUMENTS_START.match(stripped):
            in_arguments = True
            reader.restart(number)
            reader.resumed_at = None
            continue
        if in_arguments:
            if stripped.startswith("-") and "end of arguments" in stripped:
                in_arguments = False
            elif m := _ARGUMENT.match(line):
                reader.argument(m.group(1), m.group(2), number)
            continue
        if m := _WORLD_SIZE.search(line):
            reader.set_world_size(m.group(1), number)
        elif m := _CHECKPOINT.search(line):
            reader.resumed_at = int(m.group(1))
        elif m := _MEMORY.search(line):
            reader.memory_report(m, number)
        elif m := _ITERATION.search(line):
            if not stripped.endswith("|"):
                if number == len(lines) and not complete_last_line:
                    truncated = number
                    continue
                raise reader.error(number, "iteration line does not end with '|': cut short or interleaved")
            reader.iteration(m, line, number)
    return RunLog(path=path, format=LogFormat.MEGATRON_LM, intervals=tuple(reader.intervals),
                  memory=tuple(reader.memory), world_size=reader.world_size,
                  world_size_line=reader.world_size_line, restart_lines=tuple(reader.restart_lines),
                  truncated_line=truncated)
