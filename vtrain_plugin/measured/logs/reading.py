"""``read_run_log(path)``: a Megatron-LM or NeMo training log, or a Megatron-LM TensorBoard folder.

A file is read as text (UTF-8, undecodable bytes refused), and its format is told by the lines it
holds: Megatron-LM's ``elapsed time per iteration (ms)`` (or ``throughput (token/sec/GPU)``) or
NeMo's ``train_step_timing in s``.
Anything else (empty, binary, another program's output, a log without one timed iteration) is one
:class:`ConfigError` naming the file and the rule.
"""

from __future__ import annotations

from pathlib import Path

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.measured.logs import megatron_log, nemo_log
from vtrain_plugin.measured.logs.records import RunLog
from vtrain_plugin.measured.logs.tensorboard_dir import read_tensorboard_dir

MAX_LOG_BYTES = 2 * 1024 ** 3


def read_run_log(path: str | Path) -> RunLog:
    """The parsed log at ``path`` (see the module doc)."""
    path = Path(path)
    if path.is_dir():
        log = read_tensorboard_dir(str(path))
    else:
        log = _read_text_log(path)
    if not log.intervals:
        raise ConfigError(f"{path}: a {log.format.value} log without one complete timed iteration")
    return log


def _read_text_log(path: Path) -> RunLog:
    try:
        size = path.stat().st_size
        if size > MAX_LOG_BYTES:
            raise ConfigError(f"{path}: {size:,} bytes, more than the {MAX_LOG_BYTES:,} a training log may hold")
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the training log: {exc.strerror}") from None
    if not data.strip():
        raise ConfigError(f"{path}: empty: not a training log")
    if b"\0" in data:
        raise ConfigError(f"{path}: binary data (NUL bytes): not a training log")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start}") from None
    lines = text.split("\n")
    complete = text.endswith("\n")
    if complete:
        lines.pop()
    if megatron_log.TIME_FIELD in text or megatron_log.TOKEN_THROUGHPUT_FIELD in text:
        return megatron_log.read_megatron_log(str(path), lines, complete_last_line=complete)
    if nemo_log.TIME_FIELD in text:
        return nemo_log.read_nemo_log(str(path), lines, complete_last_line=complete)
    raise ConfigError(f"{path}: not a Megatron-LM or NeMo training log: no line holds "
                      f"{megatron_log.TIME_FIELD!r} or {nemo_log.TIME_FIELD!r}")
