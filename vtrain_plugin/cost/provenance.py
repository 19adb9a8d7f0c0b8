"""Where an estimate's kernel time came from: how much was measured, and the largest modeled kernels."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vtrain_plugin.core.graph import KernelKey, OpNode, Phase
from vtrain_plugin.cost.host_device import segment_sums
from vtrain_plugin.cost.prepare import PreparedStage


@dataclass(slots=True)
class Provenance:
    """Accumulates, over the stages of one costing, kernel time per iteration on the representative
    ranks (all stages), the measured part of it, and with ``track_modeled`` each modeled kernel's total."""

    track_modeled: bool = False
    kernel_ns: float = 0.0
    measured_kernel_ns: float = 0.0
    _modeled: dict[KernelKey, tuple[float, OpNode]] = field(default_factory=dict)

    @property
    def measured_fraction(self) -> float:
        return self.measured_kernel_ns / self.kernel_ns if self.kernel_ns else 0.0

    def largest_modeled(self, count: int) -> tuple[tuple[float, OpNode], ...]:
        """The ``count`` modeled kernels with the most time per iteration: (ns, an op of that key)."""
        return tuple(sorted(self._modeled.values(), key=lambda x: -x[0])[:count])

    def add_stage(self, prepared: PreparedStage, device_ns: np.ndarray, is_comm: np.ndarray,
                  num_microbatches: int) -> None:
        segments = prepared.segments
        measured_rows = ~np.isnan(prepared.measured_ns)
        kernel = segment_sums(np.where(is_comm, 0.0, device_ns), segments)
        measured = segment_sums(np.where(measured_rows, device_ns, 0.0), segments)
        for i, s in enumerate(segments):
            runs = s.count * (1 if s.phase is Phase.OPTIMIZER else num_microbatches)
            self.kernel_ns += runs * kernel[i]
            self.measured_kernel_ns += runs * measured[i]
            if self.track_modeled:
                for row in range(s.start, s.stop):
                    node = prepared.nodes[row]
                    if node is not None and not measured_rows[row]:
                        previous = self._modeled.get(node.key)
                        self._modeled[node.key] = ((previous[0] if previous else 0.0) + runs * device_ns[row], node)
