"""Measured training runs: the logs of Megatron-LM and NeMo, and Megatron-LM's TensorBoard events."""

from vtrain_plugin.measured.logs.reading import read_run_log
from vtrain_plugin.measured.logs.records import LogFormat, LoggedInterval, MemoryReport, RunLog

__all__ = ["LogFormat", "LoggedInterval", "MemoryReport", "RunLog", "read_run_log"]
