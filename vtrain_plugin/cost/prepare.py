"""``prepare()``: a traced graph laid out as kernel batches, once per graph, software stack and profile.

Each block's ops are lowered onto the kernels of the software stack (:mod:`vtrain_plugin.cost.lowering`)
and every block's phases are laid out as segments of one :class:`KernelBatch` per stage, with the
measured durations looked up; tensor-parallel collectives are rows of the batch (they block the
compute stream). Megatron's runtime collectives (DP gradients, pipeline transfers, tied embeddings)
are derived per stage (:mod:`vtrain_plugin.cost.runtime_collectives`). This walks every node once and
depends on the graph, the stack and the profile, not on the device constants or the cluster:
calibration prepares each run once and re-costs it (:func:`vtrain_plugin.cost.costing.cost`) per
candidate set of constants.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from vtrain_plugin.core.graph import CollectiveNode, KernelKey, OpGraph, OpNode, ParallelGroup, Phase, StageGraph
from vtrain_plugin.cost.host_device import Segment
from vtrain_plugin.cost.kernel_model import KernelBatch
from vtrain_plugin.cost.kernel_timer import measured_ns
from vtrain_plugin.cost.lowering import map_nodes
from vtrain_plugin.cost.runtime_collectives import RuntimeCollectives, runtime_collectives
from vtrain_plugin.specs.training import SoftwareStack

PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE, Phase.OPTIMIZER)
_NO_KERNEL = OpNode(key=KernelKey(op="aten.empty.memory_format", input_shapes=(), dtypes=()), phase=Phase.FORWARD,
                    module="", launches_kernel=False)  # the batch row of a collective


@dataclass(frozen=True, slots=True)
class PreparedStage:
    stage: StageGraph
    kernels: KernelBatch  # every segment's kernels in order; collectives are rows of kind NONE
    measured_ns: np.ndarray  # per row, NaN where unmeasured
    nodes: tuple[OpNode | None, ...]  # per row (None for a collective)
    tp_rows: tuple[tuple[int, CollectiveNode], ...]  # rows holding blocking TP collectives
    segments: tuple[Segment, ...]  # blocks in stage order, phases in PHASES order
    runtime: RuntimeCollectives


@dataclass(frozen=True, slots=True)
class PreparedGraph:
    graph: OpGraph
    stack: SoftwareStack
    stages: tuple[PreparedStage, ...]  # in virtual-stage order (chunk * pp + pipeline_rank)
    flops: dict[Phase, int]  # of one micro-batch through every chunk, on one tensor-parallel rank


def prepare(graph: OpGraph, stack: SoftwareStack | str,
            measured: Mapping[KernelKey, float] | None = None) -> PreparedGraph:
    """Lay ``graph`` out for costing under ``stack``, with ``measured`` kernel durations (ns)."""
    stack = SoftwareStack(stack)
    pp = graph.parallel.pipeline_parallel
    ordered = sorted(graph.stages, key=lambda s: s.chunk * pp + s.pipeline_rank)
    flops = {phase: sum(stage.flops(phase) for stage in ordered) for phase in PHASES}
    tied = graph.model is not None and graph.model.tied
    stages = tuple(_prepare_stage(stage, stack, measured or {},
                                  runtime_collectives(stage, graph.parallel, dtype=graph.dtype, tied_embeddings=tied))
                   for stage in ordered)
    return PreparedGraph(graph=graph, stack=stack, stages=stages, flops=flops)


def _prepare_stage(stage: StageGraph, stack: SoftwareStack, measured: Mapping[KernelKey, float],
                   runtime: RuntimeCollectives) -> PreparedStage:
    rows: list[OpNode | None] = []
    phases: list[Phase] = []
    tp_rows: list[tuple[int, CollectiveNode]] = []
    segments: list[Segment] = []
    for b, block in enumerate(stage.blocks):
        by_phase: dict[Phase, list[OpNode | CollectiveNode]] = {p: [] for p in PHASES}
        for node in map_nodes(block.nodes, stack):
            if isinstance(node, OpNode):
                if node.launches_kernel:
                    by_phase[node.phase].append(node)
            elif node.group is ParallelGroup.TP:
                by_phase[node.phase].append(node)
        for phase in PHASES:
            start = len(rows)
            for node in by_phase[phase]:
                if isinstance(node, CollectiveNode):
                    tp_rows.append((len(rows), node))
                    rows.append(None)
                else:
                    rows.append(node)
                phases.append(phase)
            segments.append(Segment(block=b, phase=phase, start=start, stop=len(rows), count=block.count))
    kernels = KernelBatch.of([n if n is not None else _NO_KERNEL for n in rows])
    kernels = replace(kernels, backward=np.array([p is Phase.BACKWARD for p in phases], bool))
    return PreparedStage(stage=stage, kernels=kernels, measured_ns=measured_ns(rows, measured), nodes=tuple(rows),
                         tp_rows=tuple(tp_rows), segments=tuple(segments), runtime=runtime)
