"""Costing one hand-built transformer layer on one DGX H100 rank: the setting of the unit tests
that check how a collective's time combines with the kernels around it (context-parallel ring
steps, tensor-parallel communication overlap)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vtrain_plugin.core.graph import Block, BlockKind, KernelKey, Node, OpGraph, StageGraph
from vtrain_plugin.cost.comm.collectives import CommModel
from vtrain_plugin.cost.costing import cost
from vtrain_plugin.cost.kernels.timer import KernelTimer
from vtrain_plugin.cost.prepare import prepare
from vtrain_plugin.cost.work import ChunkWork
from vtrain_plugin.hardware.calibration import calibration_for
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

LAYER = "decoder.layers.0"


def cost_one_layer(nodes: Sequence[Node], plan: ParallelPlan, stack: str, measured: Mapping[KernelKey, float], *,
                   seq_length: int, training: TrainingSpec = TrainingSpec(global_batch_size=1)
                   ) -> tuple[ChunkWork, CommModel]:
    """The chunk work of a one-layer graph of ``nodes`` under ``plan`` as ``stack`` runs it, with the
    kernels' durations from ``measured``, and the comm model it was costed with."""
    block = Block(kind=BlockKind.LAYER, name=LAYER, nodes=tuple(nodes))
    graph = OpGraph(model=None, parallel=plan, micro_batch_size=1, seq_length=seq_length,
                    stages=(StageGraph(pipeline_rank=0, blocks=(block,)),))
    cluster = get_cluster_preset("dgx-h100")
    device = get_device(cluster.gpu)
    timer = KernelTimer(device, calibration_for(device.name, stack).constants)
    comm = CommModel.for_plan(cluster, plan)
    costing = cost(prepare(graph, stack, measured), timer=timer, comm=comm, training=training, num_microbatches=1)
    return costing.work.chunks[0], comm
