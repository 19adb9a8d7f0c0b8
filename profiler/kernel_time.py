"""The duration of one kernel and where it came from (measured on a device, or modeled)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Source(StrEnum):
    MEASURED = "measured"  # replayed on the target device (ProfileDB)
    MODELED = "modeled"  # analytical kernel model


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelTime:
    duration_ns: float
    source: Source
