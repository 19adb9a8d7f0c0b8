"""Where an estimate's kernel time came from: how much was measured, and the largest modeled kernels."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from vtrain_plugin.core.graph import KernelKey, OpNode, Phase
from vtrain_plugin.cost.kernels.host_device import Segment, segment_sums
from vtrain_plugin.cost.prepare import PreparedRole


ModeledUse = tuple[KernelKey, Phase, str]  # (kernel key, phase, module name)


@dataclass(frozen=True, slots=True)
class StageProvenance:
    """One stage's share, per iteration: kernel time, its measured part, and the total of each modeled
    kernel per (kernel key, phase, module): the same GEMM shape serves a forward, its recompute and a
    backward, and each is listed apart."""

    kernel_ns: float
    measured_kernel_ns: float
    modeled: tuple[tuple[ModeledUse, float, OpNode], ...] = ()


def stage_provenance(role: PreparedRole, device_ns: np.ndarray, is_comm: np.ndarray, num_microbatches: int, *,
                     track_modeled: bool) -> StageProvenance:
    segments = role.segments
    measured_rows = ~np.isnan(role.measured_ns)
    kernel = segment_sums(np.where(is_comm, 0.0, device_ns), segments)
    measured = segment_sums(np.where(measured_rows, device_ns, 0.0), segments)
    totals = counted_provenance(segments, kernel, measured, num_microbatches)
    if not track_modeled:
        return totals
    modeled: dict[ModeledUse, tuple[float, OpNode]] = {}
    for s in segments:
        runs = _runs(s, num_microbatches)
        for row in range(s.start, s.stop):
            node = role.nodes[row]
            if node is not None and not measured_rows[row]:
                use = (node.key, node.phase, node.module)
                previous = modeled.get(use)
                modeled[use] = ((previous[0] if previous else 0.0) + runs * device_ns[row], node)
    return StageProvenance(kernel_ns=totals.kernel_ns, measured_kernel_ns=totals.measured_kernel_ns,
                           modeled=tuple((key, ns, node) for key, (ns, node) in modeled.items()))


def counted_provenance(segments: Sequence[Segment], kernel: np.ndarray, measured: np.ndarray,
                       num_microbatches: int) -> StageProvenance:
    """A stage's kernel time and its measured part per iteration, from the per-segment sums of one
    instance (``kernel``, ``measured``): the modeled kernels not listed."""
    kernel_ns = measured_ns = 0.0
    for i, s in enumerate(segments):
        runs = _runs(s, num_microbatches)
        kernel_ns += runs * kernel[i]
        measured_ns += runs * measured[i]
    return StageProvenance(kernel_ns=kernel_ns, measured_kernel_ns=measured_ns)


def _runs(segment: Segment, num_microbatches: int) -> int:
    return segment.count * (1 if segment.phase is Phase.OPTIMIZER else num_microbatches)


@dataclass(slots=True)
class Provenance:
    """Accumulates, over the stages of one costing, kernel time per iteration on the representative
    ranks (all stages), the measured part of it, and each modeled kernel use's time per iteration on
    the stage that spends the most on it (a figure comparable with the iteration time: summing over
    stages would count work that runs in parallel on different GPUs)."""

    kernel_ns: float = 0.0
    measured_kernel_ns: float = 0.0
    _modeled: dict[ModeledUse, tuple[float, OpNode]] = field(default_factory=dict)

    @property
    def measured_fraction(self) -> float:
        return self.measured_kernel_ns / self.kernel_ns if self.kernel_ns else 0.0

    def largest_modeled(self, count: int) -> tuple[tuple[float, OpNode], ...]:
        """The ``count`` modeled kernel uses with the most time per iteration on one stage: (ns, an op
        of that use)."""
        return tuple(sorted(self._modeled.values(), key=lambda x: -x[0])[:count])

    def add(self, stage: StageProvenance) -> None:
        self.kernel_ns += stage.kernel_ns
        self.measured_kernel_ns += stage.measured_kernel_ns
        for use, ns, node in stage.modeled:
            previous = self._modeled.get(use)
            if previous is None or ns > previous[0]:
                self._modeled[use] = (ns, node)
