"""Kernel durations on the target device: measured ones from a profile, modeled ones otherwise.

Every duration says where it came from, so an estimate can report how much of its kernel time was
measured (its provenance).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from profiler.devices import DeviceSpec
from profiler.kernel_model import KernelModel
from profiler.kernel_time import Source
from vtrain_plugin.graph import KernelKey, OpNode


@dataclass(frozen=True, slots=True)
class OpTime:
    effective_ns: float  # time the op adds to its stream (device time, or host time if larger)
    source: Source


class KernelTimer:
    """Times ops for one device; ``measured`` maps kernel keys to measured device time in ns."""

    def __init__(self, device: DeviceSpec, measured: Mapping[KernelKey, float] | None = None) -> None:
        self.device = device
        self.model = KernelModel(device)
        self.measured = measured or {}

    def time(self, op: OpNode) -> OpTime:
        measured = self.measured.get(op.key)
        host = self.model.host_ns(op)
        if measured is not None:
            return OpTime(max(measured, host), Source.MEASURED)
        return OpTime(self.model.effective_ns(op), Source.MODELED)
