"""A calibration whose host costs are the least their ranges allow, for tests of device-side mechanisms.

The eager stack's host costs (the ``default`` files: megatron-core's layer costs) make a test-sized
layer host-bound, and a host-bound layer hides what the device does (a collective issued before a
GEMM waits behind the host anyway). Tests of a device mechanism write this file into a user
calibration folder (``VTRAIN_CALIBRATION_DIR``) so the device sets the pace.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from vtrain_plugin.hardware.calibration import (CONSTANT_RANGES, OPTIONAL_CONSTANTS, SOFTWARE_CONSTANTS,
                                                calibration_for, write_calibration)


def write_quiet_host_calibration(gpu: str = "h100-sxm", stack: str = "default") -> Path:
    """``gpu``'s ``stack`` file with its device constants and the least host costs, written into the
    user calibration folder the caller set; its path."""
    shipped = calibration_for(gpu, stack)
    least = {name: OPTIONAL_CONSTANTS[name] for name in SOFTWARE_CONSTANTS if name in OPTIONAL_CONSTANTS}
    constants = replace(shipped.constants, host_overhead_ns=CONSTANT_RANGES["host_overhead_ns"][0], **least)
    return write_calibration(replace(shipped, source="a test: the least host cost", command="pytest",
                                     constants=constants))
