"""Kernel durations on the target device: measured ones from a profile, modeled ones otherwise.

Every duration says where it came from, so an estimate can report how much of its kernel time was
measured (its provenance). Kernels are timed in batches (:class:`profiler.kernel_model.KernelBatch`);
measured durations are looked up once per node when a graph is prepared, then replace the modeled
device time of those kernels whatever the device constants.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from profiler.devices import DeviceConstants, DeviceSpec
from profiler.kernel_model import KernelBatch, KernelModel
from vtrain_plugin.graph import KernelKey, OpNode


class KernelTimer:
    """Times kernels for one device; ``measured`` maps kernel keys to measured device time in ns.

    ``constants`` overrides the device's fitted constants (calibration).
    """

    def __init__(self, device: DeviceSpec, measured: Mapping[KernelKey, float] | None = None, *,
                 constants: DeviceConstants | None = None) -> None:
        self.device = device
        self.model = KernelModel(device, constants=constants)
        self.measured = measured or {}

    @property
    def constants(self) -> DeviceConstants:
        return self.model.constants

    def measured_ns(self, nodes: Sequence[OpNode | None]) -> np.ndarray:
        """Measured device time of each node's kernel, NaN where unmeasured (or not a kernel)."""
        get = self.measured.get
        return np.array([np.nan if n is None or not n.launches_kernel else get(n.key, np.nan) for n in nodes],
                        float)

    def device_ns(self, kernels: KernelBatch, measured_ns: np.ndarray) -> np.ndarray:
        """Device time of each kernel: measured where known, modeled otherwise."""
        modeled = self.model.device_ns(kernels)
        return np.where(np.isnan(measured_ns), modeled, measured_ns)

    def host_ns(self, kernels: KernelBatch) -> np.ndarray:
        return self.model.host_ns_batch(kernels)
