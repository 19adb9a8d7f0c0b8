"""The cost model: from a traced graph to per-chunk durations on a device and cluster.

``prepare()`` (:mod:`.prepare`) once per graph, software stack and profile; ``cost()``
(:mod:`.costing`) per device constants and cluster.
"""

from vtrain_plugin.cost.comm.collectives import CommModel
from vtrain_plugin.cost.costing import Costing, cost
from vtrain_plugin.cost.kernels.timer import KernelTimer
from vtrain_plugin.cost.memory import RankMemory, rank_memory
from vtrain_plugin.cost.prepare import PreparedGraph, prepare
from vtrain_plugin.cost.comm.topology import GroupPlacement, Layout
from vtrain_plugin.cost.work import ChunkWork, DpBucket, PipelineWork

__all__ = ["ChunkWork", "CommModel", "Costing", "DpBucket", "GroupPlacement", "KernelTimer", "Layout",
           "PipelineWork", "PreparedGraph", "RankMemory", "cost", "prepare", "rank_memory"]
