"""Communication: the collective model and where groups sit on nodes, what overlaps compute, the
data-parallel buckets and distributed-optimizer buffers, Megatron's runtime collectives, context
parallelism and MoE dispatch.
"""

from vtrain_plugin.cost.comm.collectives import CommModel
from vtrain_plugin.cost.comm.topology import GroupPlacement, Layout

__all__ = ["CommModel", "GroupPlacement", "Layout"]
