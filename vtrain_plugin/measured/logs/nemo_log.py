"""NeMo's training log: the progress lines of PyTorch Lightning with NeMo's logged values, one per
logged step, in either of NeMo's forms::

    Epoch 0: :   2%|▏   | 20/1000 [00:40<32:40, reduced_train_loss=9.880, global_step=19.00, consumed_samples=10240.0, train_step_timing in s=1.980]
    Training epoch 0, iteration 19/999 | lr: 1.5e-05 | global_batch_size: 512 | global_step: 19 | reduced_train_loss: 9.880 | train_step_timing in s: 1.98 | consumed_samples: 10240

(NeMo 1.x's tqdm bar, whose updates a terminal overwrites with carriage returns, and NeMo 2.x's
``MegatronProgressBar``). ``global_step`` counts from 0, so a step is iteration ``global_step + 1``
here, as Megatron-LM counts; ``train_step_timing in s`` is the step's time. The global batch is the
logged ``global_batch_size``, else the growth of ``consumed_samples`` per step; the GPU count comes
from Lightning's ``Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/64``. A step that goes back
is a restart; a refresh of the same step replaces the previous one.
"""

from __future__ import annotations

import re

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.measured.logs.records import LogFormat, LoggedInterval, RunLog

TIME_FIELD = "train_step_timing in s"
_FIELD = re.compile(r"([A-Za-z_][\w ]*?)\s*[=:]\s*([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))(?=\s*(?:[,|\]]|$))")
_MEMBER = re.compile(r"MEMBER: \d+/(\d+)")


def read_nemo_log(path: str, lines: list[str], *, complete_last_line: bool) -> RunLog:
    """The logged steps, GPU count and restarts of a NeMo log's ``lines`` (see the module doc)."""
    intervals: list[LoggedInterval] = []
    consumed: list[float | None] = []
    world_size, world_line, restarts, truncated = None, 0, [], None
    for number, line in enumerate(lines, start=1):
        updates = line.split("\r")
        for index, update in enumerate(updates):
            if m := _MEMBER.search(update):
                world_size, world_line = int(m.group(1)), number
                continue
            if TIME_FIELD not in update:
                continue
            if number == len(lines) and index == len(updates) - 1 and not complete_last_line:
                truncated = number
                continue
            fields = {name.strip(): value for name, value in _FIELD.findall(update)}
            step_text = fields.get("global_step")
            if TIME_FIELD not in fields or step_text is None:
                raise ConfigError(f"{path}: line {number}: a {TIME_FIELD!r} update without both "
                                  f"'{TIME_FIELD}' and 'global_step' values")
            seconds, step = float(fields[TIME_FIELD]), float(step_text)
            if not seconds > 0 or step < 0 or step != int(step):
                raise ConfigError(f"{path}: line {number}: {TIME_FIELD} must be positive and global_step a "
                                  f"non-negative integer, got {fields[TIME_FIELD]} and {step_text}")
            iteration = int(step) + 1
            previous = intervals[-1] if intervals else None
            if previous is not None and iteration == previous.iteration:
                intervals.pop()
                consumed.pop()
                previous = intervals[-1] if intervals else None
            if previous is not None and iteration < previous.iteration:
                restarts.append(number)
            segment = len(restarts)
            same_segment = previous is not None and previous.segment == segment
            first = previous.iteration + 1 if same_segment else iteration
            samples = float(fields["consumed_samples"]) if "consumed_samples" in fields else None
            batch = fields.get("global_batch_size")
            if batch is None and same_segment and samples is not None and consumed[-1] is not None:
                batch = str((samples - consumed[-1]) / (iteration - previous.iteration))
            intervals.append(LoggedInterval(
                iteration=iteration, first_iteration=first, iteration_time_ms=seconds * 1000.0, segment=segment,
                line=number, global_batch_size=_batch(batch, path, number)))
            consumed.append(samples)
    return RunLog(path=path, format=LogFormat.NEMO, intervals=tuple(intervals), world_size=world_size,
                  world_size_line=world_line, restart_lines=tuple(restarts), truncated_line=truncated)


def _batch(text: str | None, path: str, number: int) -> int | None:
    if text is None:
        return None
    value = float(text)
    if not value > 0 or value != int(value):
        raise ConfigError(f"{path}: line {number}: global batch size {text} is not a positive integer")
    return int(value)
