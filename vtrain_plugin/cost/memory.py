"""Memory each GPU needs: model states from the traced parameters, activations from the trace.

Per pipeline rank (the representative one; TP and DP replicas hold the same):
- weights and gradients in the model dtype, plus fp32 main weights (when the model dtype is
  narrower) and Adam's two fp32 moments, as in Megatron's mixed precision without a distributed
  optimizer: 16 bytes per parameter in fp16/bf16, 16 in fp32 (no separate main copy);
- activations: what the forward of one micro-batch keeps for backward (measured while tracing the
  real model, per block), times the most micro-batches the schedule keeps in flight on that rank.
Not counted: the transient activations of the layer being recomputed or back-propagated, the
allocator's fragmentation and the CUDA context; the result is a lower bound on what
``torch.cuda.max_memory_allocated`` reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.graph import OpGraph
from vtrain_plugin.core.units import GIB
from vtrain_plugin.specs.training import optimizer_bytes_per_parameter

@dataclass(frozen=True, slots=True, kw_only=True)
class RankMemory:
    weights_gib: float
    gradients_gib: float
    optimizer_gib: float
    activations_gib: float
    inflight_microbatches: int  # (chunk, micro-batch) pairs held at the peak

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.gradients_gib + self.optimizer_gib + self.activations_gib

    def to_dict(self) -> dict[str, float]:
        return {"weights": self.weights_gib, "gradients": self.gradients_gib, "optimizer": self.optimizer_gib,
                "activations": self.activations_gib, "total": self.total_gib}


def rank_memory(graph: OpGraph, inflight: Sequence[int]) -> tuple[RankMemory, ...]:
    """Memory of each pipeline rank; ``inflight[r]`` is the most (chunk, micro-batch) pairs whose
    activations rank ``r`` holds at once under the schedule (``Schedule.peak_inflight``)."""
    dtype = graph.dtype
    per_param = dtype.nbytes
    optimizer_per_param = optimizer_bytes_per_parameter(dtype)
    pp = graph.parallel.pipeline_parallel
    params = [0] * pp
    activations = [0] * pp
    chunks = [0] * pp
    for stage in graph.stages:
        params[stage.pipeline_rank] += stage.num_parameters
        activations[stage.pipeline_rank] += stage.activation_nbytes
        chunks[stage.pipeline_rank] += 1
    out = []
    for rank in range(pp):
        out.append(RankMemory(
            weights_gib=params[rank] * per_param / GIB,
            gradients_gib=params[rank] * per_param / GIB,
            optimizer_gib=params[rank] * optimizer_per_param / GIB,
            activations_gib=activations[rank] / chunks[rank] * inflight[rank] / GIB,
            inflight_microbatches=inflight[rank],
        ))
    return tuple(out)
