"""What the cost model knows of MoE layers beyond their traced ops.

The MoE layers' own collectives (the token all-to-all over the EP group, the all-gather and
reduce-scatter over expert TP or expert TP x EP, the all-gather of the routed token counts) are
traced with the layer (:mod:`megatron_adapters.moe`) and block the compute stream like TP
collectives; estimates report them apart, as ``ep_comm``. Their groups are placed on nodes by the
expert rank numbering (:mod:`vtrain_plugin.cost.comm.topology`), so an all-to-all over an EP group that
spans nodes pays the network for its share of peers off the node. The gradients of experts split by
expert parallelism are reduced over the expert DP group (:mod:`vtrain_plugin.cost.comm.runtime_collectives`).
"""

from __future__ import annotations

from vtrain_plugin.core.graph import ParallelGroup

MOE_GROUPS = frozenset({ParallelGroup.EP, ParallelGroup.EXPERT_TP, ParallelGroup.EXPERT_TP_EP})
