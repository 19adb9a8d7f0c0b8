"""What the cost model knows of MoE layers beyond their traced ops, and the time of the flex
dispatcher's fused dispatch and combine (DeepEP, HybridEP).

The MoE layers' own collectives (the token all-to-all over the EP group, the all-gather and
reduce-scatter over expert TP or expert TP x EP, the all-gather of the routed token counts) are
traced with the layer (:mod:`megatron_adapters.moe`) and block the compute stream like TP
collectives; estimates report them apart, as ``ep_comm``. Their groups are placed on nodes by the
expert rank numbering (:mod:`vtrain_plugin.cost.comm.topology`), so an all-to-all over an EP group that
spans nodes pays the network for its share of peers off the node. The gradients of experts split by
expert parallelism are reduced over the expert DP group (:mod:`vtrain_plugin.cost.comm.runtime_collectives`).

The flex dispatcher's kernels are not NCCL's: DeepEP sends each token once to every node that holds
one of its experts (RDMA, to the GPU of the same local rank), which forwards it over NVLink once to
every GPU of its node that holds one of them; combine runs the same path back, summing on the way.
Its traced all-to-all (one over expert TP x EP per dispatch or combine) carries the tokens a rank
receives, each once per destination rank; :func:`flex_time_ns` splits that volume into the NVLink
and the RDMA share under the routing assumption (:func:`megatron_adapters.flex_routing.expected_units_hit`) and times the two
concurrently, at the fractions of the nominal link rates DeepEP measured.
"""

from __future__ import annotations

from megatron_adapters.flex_routing import FlexDispatch
from vtrain_plugin.core.graph import ParallelGroup
from vtrain_plugin.cost.comm.topology import GroupPlacement

MOE_GROUPS = frozenset({ParallelGroup.EP, ParallelGroup.EXPERT_TP, ParallelGroup.EXPERT_TP_EP})

# Achieved bandwidth of DeepEP's normal (prefill / training) kernels over the nominal per-GPU link
# rate, from the DeepEP README (github.com/deepseek-ai/DeepEP, "Normal kernels with NVLink and RDMA
# forwarding", H800 with NVLink 400 GB/s bidirectional = 200 GB/s per direction and one ConnectX-7
# 400 Gb/s = 50 GB/s InfiniBand NIC per GPU):
# - intranode EP8: dispatch 153 GB/s, combine 158 GB/s over NVLink: 0.765 to 0.79 of 200 GB/s;
# - internode EP16 / EP32 / EP64: 43 to 58 GB/s over RDMA: 0.86 of 50 GB/s and up (58 GB/s exceeds
#   the nominal NIC rate, DeepEP counting bytes its NVLink forwarding delivers; capped at 1).
# Validated on H800 only: on other GPUs the same fractions of their links are assumed.
FLEX_NVLINK_EFFICIENCY = 0.78  # range [0.765, 0.79]
FLEX_RDMA_EFFICIENCY = 0.93  # range [0.86, 1.0]


def flex_time_ns(nbytes: int, placement: GroupPlacement, flex: FlexDispatch, *, nvlink_bytes_per_ns: float,
                 nic_bytes_per_ns: float, intra_latency_ns: float, inter_latency_ns: float) -> float:
    """One fused dispatch or combine of the flex dispatcher whose traced all-to-all carries
    ``nbytes`` (the tokens a rank receives, once per destination rank) over ``placement``.

    With ``t`` the bytes of the rank's tokens, each sent once (``nbytes / ranks_hit``), ``g`` the
    group's GPUs per node and ``N`` its nodes: NVLink carries ``t * ranks_hit * (1 - 1/g)`` (each
    delivery but the one to the sending GPU itself), the NIC ``t * nodes_hit * (1 - 1/N)`` (once per
    other node); the two overlap, plus one latency per tier."""
    if nbytes == 0 or placement.size == 1:
        return 0.0
    token_nbytes = nbytes / flex.ranks_hit()
    local = placement.gpus_per_node
    nvlink_ns = (token_nbytes * flex.ranks_hit() * (1.0 - 1.0 / local)
                 / (FLEX_NVLINK_EFFICIENCY * nvlink_bytes_per_ns)) if local > 1 else 0.0
    if not placement.spans_nodes:
        return nvlink_ns + intra_latency_ns
    nodes = placement.num_nodes
    rdma_ns = token_nbytes * flex.units_hit(nodes) * (1.0 - 1.0 / nodes) / (FLEX_RDMA_EFFICIENCY * nic_bytes_per_ns)
    return max(nvlink_ns, rdma_ns) + intra_latency_ns + inter_latency_ns
