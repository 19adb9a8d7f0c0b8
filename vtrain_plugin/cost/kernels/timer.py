"""Kernel durations on the target device: measured ones from a profile, modeled ones otherwise.

Measured durations are looked up once per node when a graph is prepared (:func:`measured_ns`), then
replace the modeled device time of those kernels whatever the device constants, so an estimate can
report how much of its kernel time was measured (its provenance).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np

from vtrain_plugin.core.graph import KernelKey, OpNode
from vtrain_plugin.cost.kernels.model import KernelBatch, KernelModel
from vtrain_plugin.hardware.calibration import DeviceConstants
from vtrain_plugin.hardware.devices import DeviceSpec


def measured_ns(nodes: Sequence[OpNode | None], measured: Mapping[KernelKey, float]) -> np.ndarray:
    """Measured device time of each node's kernel, NaN where unmeasured (or not a kernel)."""
    if not measured:
        return np.full(len(nodes), np.nan)
    get = measured.get
    return np.array([np.nan if n is None or not n.launches_kernel else get(n.key, np.nan) for n in nodes], float)


_TIMED_CACHE_SIZE = 512
_timed: OrderedDict[tuple, tuple[KernelBatch, np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()


class KernelTimer:
    """Times batches of kernels on one device with one set of calibrated constants."""

    def __init__(self, device: DeviceSpec, constants: DeviceConstants, *, slowdown: float = 1.0) -> None:
        """``slowdown`` stretches every device time, measured or modeled: the job's slowest GPU
        (:func:`vtrain_plugin.cost.kernels.stragglers.slowest_gpu_factor`) against the one a kernel was
        measured or modeled on."""
        self.device = device
        self.model = KernelModel(device, constants)
        self.slowdown = slowdown

    @property
    def constants(self) -> DeviceConstants:
        return self.model.constants

    def times_ns(self, kernels: KernelBatch, measured: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Device and host time of every kernel of the batch, as fresh arrays the caller may change.

        A plan search times the same prepared batches (one per chunk role) with the same device
        and constants over and over; those are looked up. The entry holds the batch and the
        measured array, so their ids cannot be reused while it lives.
        """
        key = (id(kernels), id(measured), self.device, self.constants, self.model.allow_tf32, self.slowdown)
        hit = _timed.get(key)
        if hit is None or hit[0] is not kernels or hit[1] is not measured:
            hit = _timed[key] = (kernels, measured, self.device_ns(kernels, measured), self.host_ns(kernels))
            if len(_timed) > _TIMED_CACHE_SIZE:
                _timed.popitem(last=False)
        else:
            _timed.move_to_end(key)
        return hit[2].copy(), hit[3].copy()

    def device_ns(self, kernels: KernelBatch, measured: np.ndarray) -> np.ndarray:
        """Device time of each kernel: measured where known (not NaN), modeled otherwise."""
        return self.slowdown * np.where(np.isnan(measured), self.model.device_ns(kernels), measured)

    def host_ns(self, kernels: KernelBatch) -> np.ndarray:
        return self.model.host_ns_batch(kernels)
