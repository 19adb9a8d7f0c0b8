"""Where the ranks of a 3D-parallel job sit, and how many nodes each communication group spans.

Ranks are numbered and placed on nodes as :mod:`megatron_adapters.conventions` records megatron-core
does it (tensor parallelism fastest, then context, then data, then pipeline parallelism; with
``tp_pp_dp_mapping`` pipeline before data, in both numberings, and the strides below follow)::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)),    node = rank // gpus_per_node

A "node" here is an NVLink domain (:attr:`ClusterSpec.gpus_per_nvlink_domain`): the node of a DGX,
the rack of an NVL72 whose trays NVLink switches join; the communication model passes its size.
Every group is then an arithmetic progression of ranks (TP: stride 1, CP: stride tp, PP: stride
tp*cp*dp, tied-embedding group: the first and the last pipeline rank), which is what the placement
below works on. The DP group is the one gradients are reduced over, Megatron-Core's data-parallel group
with context parallelism: its CP x DP ranks are consecutive in the order, so stride tp, size cp*dp.
A CP group lies inside a node when tp*cp divides the GPUs per node. The groups of MoE layers number
the same ranks a second way (megatron-core's expert rank generator, which has no CP: the expert ranks
of a pipeline stage are its TP x CP x DP ranks)::

    rank = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank)),    edp = tp * cp * dp / (etp * ep)

so expert TP has stride 1, EP stride etp, expert TP x EP stride 1 (etp * ep ranks), expert DP stride
etp * ep. Groups are those of the representative rank of a pipeline stage (tp_rank = cp_rank =
dp_rank = 0, hence etp_rank = ep_rank = edp_rank = 0).

With the distributed optimizer in ``N`` instances (megatron-core's ``initialize_model_parallel``,
``num_distributed_optimizer_instances``) the DP group (and the expert DP group) is cut into ``N``
intra-instance groups of consecutive members, ``size / N`` each, and the inter-instance group joins the
members ``size / N`` apart (DP_INTRA / DP_INTER, EXPERT_DP_INTRA / EXPERT_DP_INTER).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.graph import ParallelGroup
from megatron_adapters.conventions import (EXPERT_RANK_ORDER, RANK_ORDER, TP_PP_DP_EXPERT_RANK_ORDER,
                                           TP_PP_DP_RANK_ORDER, global_rank, node_of, rank_strides)


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupPlacement:
    """One group's footprint: its size, the nodes it touches and its GPUs on each of them."""

    size: int
    num_nodes: int
    gpus_per_node: int  # fewest GPUs of the group on one of its nodes (the network bottleneck)
    max_gpus_per_node: int

    @property
    def spans_nodes(self) -> bool:
        return self.num_nodes > 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    gpus_per_node: int
    context_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int = 1
    tp_pp_dp_mapping: bool = False  # Megatron-LM's --use-tp-pp-dp-mapping (conventions.TP_PP_DP_RANK_ORDER)
    cp_a2a: int = 1  # the first level of hierarchical CP (ParallelGroup.CP_A2A), consecutive CP ranks
    optimizer_instances: int = 1  # ParallelPlan.distributed_optimizer_instances

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "data_parallel", "gpus_per_node", "context_parallel",
                     "expert_parallel", "expert_tensor_parallel", "cp_a2a", "optimizer_instances"):
            v.positive_int(f"layout.{name}", getattr(self, name))
        v.divides("layout.cp_a2a", self.cp_a2a, "context_parallel", self.context_parallel)
        v.divides("layout.optimizer_instances", self.optimizer_instances, "context_parallel * data_parallel",
                  self.context_parallel * self.data_parallel)
        v.divides("layout.expert_parallel * expert_tensor_parallel", self.expert_parallel * self.expert_tensor_parallel,
                  "tensor_parallel * context_parallel * data_parallel",
                  self.tensor_parallel * self.context_parallel * self.data_parallel)
        v.divides("layout.optimizer_instances", self.optimizer_instances, "expert data-parallel size",
                  self.expert_sizes[ParallelGroup.EXPERT_DP])

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.context_parallel * self.pipeline_parallel * self.data_parallel

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.gpus_per_node)

    @property
    def sizes(self) -> dict[ParallelGroup, int]:
        return {ParallelGroup.TP: self.tensor_parallel, ParallelGroup.CP: self.context_parallel,
                ParallelGroup.DP: self.data_parallel, ParallelGroup.PP: self.pipeline_parallel}

    @property
    def expert_sizes(self) -> dict[ParallelGroup, int]:
        etp, ep = self.expert_tensor_parallel, self.expert_parallel
        return {ParallelGroup.EXPERT_TP: etp, ParallelGroup.EP: ep,
                ParallelGroup.EXPERT_DP: self.tensor_parallel * self.context_parallel * self.data_parallel // (etp * ep),
                ParallelGroup.PP: self.pipeline_parallel}

    @property
    def order(self) -> tuple[ParallelGroup, ...]:
        return TP_PP_DP_RANK_ORDER if self.tp_pp_dp_mapping else RANK_ORDER

    @property
    def expert_order(self) -> tuple[ParallelGroup, ...]:
        return TP_PP_DP_EXPERT_RANK_ORDER if self.tp_pp_dp_mapping else EXPERT_RANK_ORDER

    def rank(self, *, tp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0, cp_rank: int = 0) -> int:
        return global_rank({ParallelGroup.TP: tp_rank, ParallelGroup.CP: cp_rank, ParallelGroup.DP: dp_rank,
                            ParallelGroup.PP: pp_rank}, self.sizes, self.order)

    def node_of(self, rank: int) -> int:
        return node_of(rank, self.gpus_per_node)

    def placement(self, group: ParallelGroup, *, pipeline_rank: int = 0) -> GroupPlacement:
        """Placement of ``group`` of the representative rank of pipeline stage ``pipeline_rank``."""
        base = self.rank(pp_rank=pipeline_rank)
        sizes = self.sizes
        stride = rank_strides(sizes, self.order)
        pp = sizes[ParallelGroup.PP]
        match ParallelGroup(group):
            case ParallelGroup.DP_INTRA | ParallelGroup.DP_INTER | ParallelGroup.EXPERT_DP_INTRA | \
                    ParallelGroup.EXPERT_DP_INTER:
                return self._instance_placement(ParallelGroup(group), base)
            case ParallelGroup.TP | ParallelGroup.CP as dim:
                offset, step, size = base, stride[dim], sizes[dim]
            case ParallelGroup.CP_A2A:
                offset, step, size = base, stride[ParallelGroup.CP], self.cp_a2a
            case ParallelGroup.CP_P2P:
                offset, step, size = base, stride[ParallelGroup.CP] * self.cp_a2a, sizes[ParallelGroup.CP] // self.cp_a2a
            case ParallelGroup.DP if stride[ParallelGroup.DP] != stride[ParallelGroup.CP] * sizes[ParallelGroup.CP]:
                # pipeline ranks between CP and DP (tp_pp_dp_mapping): two progressions
                return _grid_placement(base, stride[ParallelGroup.CP], sizes[ParallelGroup.CP],
                                       stride[ParallelGroup.DP], sizes[ParallelGroup.DP], self.gpus_per_node)
            case ParallelGroup.DP:
                offset, step, size = base, stride[ParallelGroup.CP], sizes[ParallelGroup.CP] * sizes[ParallelGroup.DP]
            case ParallelGroup.PP:
                offset, step, size = 0, stride[ParallelGroup.PP], pp
            case ParallelGroup.EMBEDDING:
                offset, step, size = 0, stride[ParallelGroup.PP] * max(pp - 1, 1), min(pp, 2)
            case ParallelGroup.EXPERT_TP | ParallelGroup.EP | ParallelGroup.EXPERT_DP as dim:
                expert = self.expert_sizes
                offset, step, size = base, rank_strides(expert, self.expert_order)[dim], expert[dim]
            case ParallelGroup.EXPERT_TP_EP:
                offset, step, size = base, 1, self.expert_tensor_parallel * self.expert_parallel
            case ParallelGroup.TP_DP_CP:  # TP x CP consecutive, then DP (pipeline ranks between them or not)
                inner = sizes[ParallelGroup.TP] * sizes[ParallelGroup.CP]
                return _grid_placement(base, 1, inner, stride[ParallelGroup.DP], sizes[ParallelGroup.DP],
                                       self.gpus_per_node)
        return _progression_placement(offset, step, size, self.gpus_per_node)

    def _instance_placement(self, group: ParallelGroup, base: int) -> GroupPlacement:
        """An intra- or inter-instance group of the distributed optimizer (see the module doc)."""
        instances = self.optimizer_instances
        intra_group = group in (ParallelGroup.DP_INTRA, ParallelGroup.EXPERT_DP_INTRA)
        if group in (ParallelGroup.DP_INTRA, ParallelGroup.DP_INTER):
            sizes, order, whole = self.sizes, self.order, ParallelGroup.DP
            stride = rank_strides(sizes, order)
            cp_stride, dp_stride = stride[ParallelGroup.CP], stride[ParallelGroup.DP]
            cp, dp = sizes[ParallelGroup.CP], sizes[ParallelGroup.DP]
            if dp_stride != cp_stride * cp:  # tp_pp_dp_mapping: list the members, CP fastest
                members = tuple(base + cp_stride * i + dp_stride * j for j in range(dp) for i in range(cp))
                intra = len(members) // instances
                return _listed_placement(members[:intra] if intra_group else members[::intra], self.gpus_per_node)
            offset, step, size = base, cp_stride, cp * dp
        else:
            expert = self.expert_sizes
            whole = ParallelGroup.EXPERT_DP
            offset, step, size = base, rank_strides(expert, self.expert_order)[whole], expert[whole]
        intra = size // instances
        if intra_group:
            return _progression_placement(offset, step, intra, self.gpus_per_node)
        return _progression_placement(offset, step * intra, instances, self.gpus_per_node)

    def p2p_crosses_nodes(self, src_pipeline_rank: int) -> bool:
        """Whether stage ``src`` sends to stage ``(src + 1) % pp`` over the network.

        The wrap-around (last rank to rank 0) is the chunk hand-over of interleaved schedules.
        """
        dst = (src_pipeline_rank + 1) % self.pipeline_parallel
        return self.node_of(self.rank(pp_rank=src_pipeline_rank)) != self.node_of(self.rank(pp_rank=dst))


@lru_cache(maxsize=256)
def _grid_placement(offset: int, inner_stride: int, inner: int, outer_stride: int, outer: int,
                    gpus_per_node: int) -> GroupPlacement:
    """Placement of ranks ``offset + inner_stride * i + outer_stride * j`` (``i < inner``, ``j < outer``):
    the data-parallel group with context parallelism when pipeline ranks lie between CP and DP
    (``--use-tp-pp-dp-mapping``); counted rank by rank, once per layout."""
    if inner == 1 or outer == 1:
        return _progression_placement(offset, outer_stride if inner == 1 else inner_stride, inner * outer,
                                      gpus_per_node)
    counts: dict[int, int] = {}
    for j in range(outer):
        for i in range(inner):
            node = (offset + inner_stride * i + outer_stride * j) // gpus_per_node
            counts[node] = counts.get(node, 0) + 1
    return GroupPlacement(size=inner * outer, num_nodes=len(counts), gpus_per_node=min(counts.values()),
                          max_gpus_per_node=max(counts.values()))


@lru_cache(maxsize=256)
def _listed_placement(ranks: tuple[int, ...], gpus_per_node: int) -> GroupPlacement:
    """Placement of the ranks listed, counted rank by rank."""
    counts: dict[int, int] = {}
    for rank in ranks:
        counts[rank // gpus_per_node] = counts.get(rank // gpus_per_node, 0) + 1
    return GroupPlacement(size=len(ranks), num_nodes=len(counts), gpus_per_node=min(counts.values()),
                          max_gpus_per_node=max(counts.values()))


@lru_cache(maxsize=4096)
def _progression_placement(offset: int, stride: int, size: int, gpus_per_node: int) -> GroupPlacement:
    """Placement of ranks ``offset + stride * i`` for ``i < size``, in O(gpus_per_node).

    With ``stride >= gpus_per_node`` every member has a node of its own. Otherwise consecutive
    members never skip a node, and a node's member count depends only on where the node boundary
    falls modulo ``stride``, which repeats within ``stride < gpus_per_node`` nodes; so the first
    ``gpus_per_node + 1`` nodes and the last one cover every count that occurs.
    """
    if size == 1 or stride >= gpus_per_node:
        return GroupPlacement(size=size, num_nodes=size, gpus_per_node=1, max_gpus_per_node=1)
    first = offset // gpus_per_node
    last = (offset + stride * (size - 1)) // gpus_per_node
    nodes = [*range(first, min(last, first + gpus_per_node + 1) + 1), last]
    counts = [_members_on_node(node, offset, stride, size, gpus_per_node) for node in nodes]
    return GroupPlacement(size=size, num_nodes=last - first + 1,
                          gpus_per_node=min(counts), max_gpus_per_node=max(counts))


def _members_on_node(node: int, offset: int, stride: int, size: int, gpus_per_node: int) -> int:
    def first_member_at_or_after(rank: int) -> int:
        return min(max(-(-(rank - offset) // stride), 0), size)

    return (first_member_at_or_after((node + 1) * gpus_per_node)
            - first_member_at_or_after(node * gpus_per_node))
