"""Time of one NCCL collective or point-to-point transfer on a placed group.

Alpha-beta per link tier, with NCCL's algorithms:

* ring all-reduce (reduce-scatter + all-gather): ``2(n-1)/n * S / B`` plus ``2(n-1)`` latency steps,
  of which ``2(k-1)`` cross the network (k = nodes spanned); all-gather and reduce-scatter take half
  of both (``(n-1)/n``, ``n-1`` steps); ``S`` is the full buffer (nccl-tests' "size": the all-reduce
  tensor, the gathered output, the reduce-scatter input);
* tree all-reduce across nodes (NCCL's double binary tree): ``S / (0.5 * 0.92 * B)`` plus
  ``2((g-1) alpha_intra + log2(k) alpha_inter)``, the ratios of NCCL's ``tuning.cc``; the faster of
  ring and tree is used, as NCCL's tuner does, unless ``ring_only`` (``NCCL_ALGO=Ring``);
* broadcast (pipelined ring): ``S / B`` plus ``n-1`` steps; all-to-all: the share sent inside the
  node over NVLink and the share sent out over the node's NICs move concurrently, plus one latency
  of the slowest tier per peer.

Bandwidth ``B`` of a group that spans nodes. In 3D parallelism every group of one kind runs the same
collective at the same time (all TP ranks' DP all-reduces, ...), so each GPU can count on its own
share of the node's network, ``efficiency * node_bw / gpus_per_node`` (DGX: one NIC per GPU;
``network_efficiency`` is the fraction of the nominal NIC rate NCCL reaches, a calibrated constant of
the device platform, 1 by default). NCCL builds one
ring per channel and routes each channel's node crossing through a different NIC, so a ring whose
group has ``g`` GPUs on each node crosses nodes on ``g`` NIC shares in parallel:
``B = min(B_nvlink, g * efficiency * node_bw / gpus_per_node)``. For DGX A100 (8 x 200 Gb/s) that is 25 GB/s for a
DP group with tp = 8 (g = 1) and 200 GB/s for a group filling whole nodes (g = 8), as nccl-tests
shows on such machines. Point-to-point and all-to-all traffic leaves through the sending GPU's own
share.

NVLink domains of several nodes (GB200 / GB300 NVL72: ``cluster.nvlink_domain_gpus`` 72, nodes of
4): groups are placed on NVLink domains rather than nodes, so a group inside one rack runs at the
NVLink rate even across its trays, and a group spanning racks crosses the network, each of its GPUs
on its own NIC share (node bandwidth / GPUs per node), as above with ``g`` its GPUs per rack.

Measured tables. ``measured_comm`` (from the profile database, see
:func:`profiler.lookup.measured_comm_tables`) maps ``(kind, group size)`` to a table of
that collective measured on the target device; a group inside one node with such a table (a
point-to-point transfer inside a node: ``(SEND, 2)``) takes its time from it, interpolated in size
(:meth:`NcclTable.time_ns`), before anything else. Otherwise, when the cluster names a table set
and the group lies inside one node, the measured all-reduce time replaces alpha-beta; all-gather
and reduce-scatter take half of it: at the same bus bandwidth they move ``(n-1)/n`` instead of
``2(n-1)/n`` of the buffer per GPU, and run half of the ring steps.
A group that spans nodes keeps alpha-beta, but its latency is the one the set measures
(:func:`measured_latency`: the tables' zero-byte times against their ring steps give a fixed cost
per collective, 30.9 us on A100, and a latency per intra-node ring step, 4.1 us) instead of the
cluster's nominal per-step NVLink latency (1 us): NCCL launches, sets up and steps through the node
alike whether or not the ring then leaves it. Network steps keep ``inter_node_latency``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from vtrain_plugin.core import checks as v
from vtrain_plugin.hardware.nccl import NcclTable, load_table_set
from megatron_adapters.flex_routing import FlexDispatch, flex_dispatch
from vtrain_plugin.cost.comm.moe_dispatch import flex_time_ns
from vtrain_plugin.cost.comm.topology import GroupPlacement, Layout
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import CollectiveKind, ParallelGroup

if TYPE_CHECKING:
    from vtrain_plugin.specs.cluster import ClusterSpec
    from vtrain_plugin.specs.model import ModelSpec
    from vtrain_plugin.specs.parallel import ParallelPlan

# NCCL tuning.cc: tree all-reduce reaches 92% of the ring's bus bandwidth and its algorithm
# bandwidth is half its bus bandwidth.
_TREE_BUS_EFFICIENCY = 0.92
_TREE_ALGORITHM_RATIO = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class CommModel:
    cluster: ClusterSpec
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    expert_parallel: int = 1
    expert_tensor_parallel: int = 1
    measured_comm: Mapping[tuple[CollectiveKind, int], NcclTable] | None = None  # (kind, group size) -> table
    network_efficiency: float = 1.0  # fraction of the nominal inter-node bandwidth reached, (0, 1]
    context_parallel: int = 1
    # NCCL pinned to the ring algorithm (NCCL_ALGO=Ring, as Megatron-LM's --deterministic-mode runs):
    # no tree all-reduce across nodes.
    ring_only: bool = False
    tp_pp_dp_mapping: bool = False  # the plan's rank order (Layout.tp_pp_dp_mapping)
    cp_a2a: int = 1  # the hierarchical CP all-to-all level (Layout.cp_a2a)
    optimizer_instances: int = 1  # the distributed optimizer's instances (Layout.optimizer_instances)
    # The flex token dispatcher's routing: its all-to-alls over expert TP x EP are DeepEP's / HybridEP's
    # (vtrain_plugin.cost.comm.moe_dispatch), not NCCL's. None: no flex dispatcher.
    flex: FlexDispatch | None = None
    layout: Layout = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "data_parallel", "context_parallel", "expert_parallel",
                     "expert_tensor_parallel"):
            v.positive_int(f"parallel.{name}", getattr(self, name))
        if not 0.0 < v.positive_number("network_efficiency", self.network_efficiency) <= 1.0:
            raise ConfigError(f"network_efficiency must lie in (0, 1], got {self.network_efficiency:g}")
        object.__setattr__(self, "layout", Layout(
            tensor_parallel=self.tensor_parallel, pipeline_parallel=self.pipeline_parallel,
            data_parallel=self.data_parallel, gpus_per_node=self.cluster.gpus_per_nvlink_domain,
            context_parallel=self.context_parallel, expert_parallel=self.expert_parallel,
            expert_tensor_parallel=self.expert_tensor_parallel, tp_pp_dp_mapping=self.tp_pp_dp_mapping,
            cp_a2a=self.cp_a2a, optimizer_instances=self.optimizer_instances))

    @classmethod
    def for_plan(cls, cluster: ClusterSpec, plan: ParallelPlan, *,
                 measured_comm: Mapping[tuple[CollectiveKind, int], NcclTable] | None = None,
                 network_efficiency: float = 1.0, ring_only: bool = False,
                 model: ModelSpec | None = None) -> CommModel:
        """The comm model of ``plan`` on ``cluster``; ``model`` gives the routing a flex dispatcher's
        time depends on (needed with ``plan.moe_token_dispatcher`` flex)."""
        return cls(flex=None if model is None else flex_dispatch(model, plan), cluster=cluster,
                   tensor_parallel=plan.tensor_parallel, pipeline_parallel=plan.pipeline_parallel,
                   data_parallel=plan.data_parallel, expert_parallel=plan.expert_parallel,
                   expert_tensor_parallel=plan.expert_tp, measured_comm=measured_comm,
                   network_efficiency=network_efficiency, context_parallel=plan.context_parallel, ring_only=ring_only,
                   tp_pp_dp_mapping=plan.tp_pp_dp_mapping, cp_a2a=plan.cp_a2a_size,
                   optimizer_instances=plan.distributed_optimizer_instances)

    def rank_classes(self) -> tuple[int, ...]:
        """Per pipeline rank, the class of everything :meth:`time_ns` depends on besides the message
        (every group's placement and whether its pipeline send crosses nodes), numbered from 0 in
        order of first appearance. Ranks of one class time every collective alike (the costing
        shares their stage costs); small integers, so a stage's key hashes cheaply."""
        return _rank_classes(self.layout)

    def placement(self, group: ParallelGroup, *, pipeline_rank: int = 0) -> GroupPlacement:
        return _placement(self.layout, group, pipeline_rank)

    def time_ns(self, kind: CollectiveKind, nbytes: int, group: ParallelGroup, *,
                pipeline_rank: int = 0) -> float:
        """Duration of collective ``kind`` over ``group`` of stage ``pipeline_rank``'s representative rank.

        SEND/RECV on the PP group is the transfer from ``pipeline_rank`` to the next stage; on another
        group, a ring step of that group (every member sends to the next at once), which crosses the
        network when the group spans nodes: its slowest hop paces every step.
        """
        v.non_negative_int("nbytes", nbytes)
        kind = CollectiveKind(kind)
        if kind in (CollectiveKind.SEND, CollectiveKind.RECV):
            if ParallelGroup(group) is ParallelGroup.PP:
                return self.send_recv_ns(nbytes, across_nodes=self.layout.p2p_crosses_nodes(pipeline_rank))
            placement = self.placement(group, pipeline_rank=pipeline_rank)
            return 0.0 if placement.size == 1 else self.send_recv_ns(nbytes, across_nodes=placement.spans_nodes)
        placement = self.placement(group, pipeline_rank=pipeline_rank)
        n = placement.size
        if n == 1 or nbytes == 0:
            return 0.0
        flex_kernel = kind is CollectiveKind.ALL_TO_ALL and ParallelGroup(group) is ParallelGroup.EXPERT_TP_EP
        if self.flex is not None and flex_kernel:
            c = self.cluster
            return flex_time_ns(nbytes, placement, self.flex, nvlink_bytes_per_ns=c.intra_node_bytes_per_ns,
                                nic_bytes_per_ns=c.inter_node_bytes_per_ns / c.gpus_per_node,
                                intra_latency_ns=c.intra_node_latency_ns, inter_latency_ns=c.inter_node_latency_ns)
        measured = self._measured_ns(kind, nbytes, placement)
        if measured is not None:
            return measured
        bw = self._ring_bytes_per_ns(placement)
        match kind:
            case CollectiveKind.ALL_REDUCE:
                ring = 2 * (n - 1) / n * nbytes / bw + self._latency_ns(2 * (n - 1), placement)
                if not placement.spans_nodes or self.ring_only:
                    return ring
                return min(ring, self._tree_all_reduce_ns(nbytes, placement))
            case CollectiveKind.ALL_GATHER | CollectiveKind.REDUCE_SCATTER:
                return (n - 1) / n * nbytes / bw + self._latency_ns(n - 1, placement)
            case CollectiveKind.BROADCAST:
                return nbytes / bw + self._latency_ns(n - 1, placement)
            case CollectiveKind.ALL_TO_ALL:
                return self._all_to_all_ns(nbytes, placement)
        raise AssertionError(f"unhandled collective kind {kind}")

    def ring_bytes_per_ns(self, group: ParallelGroup, *, pipeline_rank: int = 0) -> float:
        """The rate ``B`` of stage ``pipeline_rank``'s ``group`` that every collective's size term
        above divides by (its ring; a tree runs at a fraction of it)."""
        return self._ring_bytes_per_ns(self.placement(group, pipeline_rank=pipeline_rank))

    def send_recv_ns(self, nbytes: int, *, across_nodes: bool) -> float:
        """One point-to-point transfer of ``nbytes`` (a pipeline activation or gradient)."""
        v.non_negative_int("nbytes", nbytes)
        if nbytes == 0:
            return 0.0
        c = self.cluster
        table = None if across_nodes or not self.measured_comm else self.measured_comm.get((CollectiveKind.SEND, 2))
        if table is not None:
            return table.time_ns(nbytes, latency_floor_ns=c.intra_node_latency_ns)
        if across_nodes:
            return nbytes / self._nic_share_bytes_per_ns() + c.inter_node_latency_ns
        return nbytes / c.intra_node_bytes_per_ns + c.intra_node_latency_ns

    def _nic_share_bytes_per_ns(self) -> float:
        return self.network_efficiency * self.cluster.inter_node_bytes_per_ns / self.cluster.gpus_per_node

    def _ring_bytes_per_ns(self, placement: GroupPlacement) -> float:
        intra = self.cluster.intra_node_bytes_per_ns
        if not placement.spans_nodes:
            return intra
        network = placement.gpus_per_node * self._nic_share_bytes_per_ns()
        return network if placement.gpus_per_node == 1 else min(intra, network)

    def _latency_ns(self, steps: int, placement: GroupPlacement) -> float:
        """``steps`` ring steps, one per node crossing of the ring paying the network latency.

        A ring over k nodes crosses k node boundaries per round, so ``steps * (k-1)/(n-1)`` of them
        are network steps (NCCL: ``2(k-1)`` of the ``2(n-1)`` all-reduce steps).
        """
        c = self.cluster
        inter_steps = steps * (placement.num_nodes - 1) // (placement.size - 1)
        measured = self._measured_latency(placement)
        if measured is not None:
            fixed, per_step = measured
            return fixed + (steps - inter_steps) * per_step + inter_steps * c.inter_node_latency_ns
        return (steps - inter_steps) * c.intra_node_latency_ns + inter_steps * c.inter_node_latency_ns

    def _measured_latency(self, placement: GroupPlacement) -> tuple[float, float] | None:
        """For a group spanning nodes, when the cluster names a table set: the per-collective fixed
        cost and the per-intra-node-step latency that set measures (:func:`measured_latency`), which
        replace the nominal per-step NVLink latency. NCCL launches the same kernel, sets up the same
        channels and runs its intra-node ring steps alike whether or not the ring then leaves the
        node, so what the tables measure inside a node is paid too."""
        name = self.cluster.nccl_tables
        if name is None or not placement.spans_nodes:
            return None
        return measured_latency(name)

    def _tree_all_reduce_ns(self, nbytes: int, placement: GroupPlacement) -> float:
        c = self.cluster
        bw = _TREE_ALGORITHM_RATIO * _TREE_BUS_EFFICIENCY * self._ring_bytes_per_ns(placement)
        measured = self._measured_latency(placement)
        fixed, per_step = (0.0, c.intra_node_latency_ns) if measured is None else measured
        latency = fixed + 2 * ((placement.gpus_per_node - 1) * per_step
                               + math.ceil(math.log2(placement.num_nodes)) * c.inter_node_latency_ns)
        return nbytes / bw + latency

    def _all_to_all_ns(self, nbytes: int, placement: GroupPlacement) -> float:
        c = self.cluster
        n, local = placement.size, placement.gpus_per_node
        intra_ns = (local - 1) / n * nbytes / c.intra_node_bytes_per_ns
        if not placement.spans_nodes:
            return intra_ns + (n - 1) * c.intra_node_latency_ns
        inter_ns = (n - local) / n * nbytes / self._nic_share_bytes_per_ns()
        return max(intra_ns, inter_ns) + (n - 1) * c.inter_node_latency_ns

    def _measured_ns(self, kind: CollectiveKind, nbytes: int, placement: GroupPlacement) -> float | None:
        if placement.spans_nodes:
            return None
        table = self.measured_comm.get((kind, placement.size)) if self.measured_comm else None
        if table is not None:
            return table.time_ns(nbytes, latency_floor_ns=self.cluster.intra_node_latency_ns)
        name = self.cluster.nccl_tables
        if name is None:
            return None
        if kind not in (CollectiveKind.ALL_REDUCE, CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER):
            return None
        table = load_table_set(name).get(placement.size)
        if table is None:
            return None
        n = placement.size
        all_reduce_ns = table.time_ns(nbytes, latency_floor_ns=self._latency_ns(2 * (n - 1), placement))
        return all_reduce_ns if kind is CollectiveKind.ALL_REDUCE else all_reduce_ns / 2


@lru_cache(maxsize=None)
def measured_latency(name: str) -> tuple[float, float]:
    """``(fixed_ns, per_step_ns)``: the least-squares line of table set ``name``'s zero-byte
    all-reduce times (:attr:`NcclTable.zero_byte_ns`) against their ring steps ``2(g-1)``. The
    A100 set gives 30.9 us per collective (launch, channel setup) and 4.10 us per NVLink ring step,
    where the cluster's nominal step latency is 1 us. Derived from the tables, not fitted to
    iteration times; a set with one table has no per-step slope (its zero-byte time is all fixed)."""
    tables = load_table_set(name)
    steps = [2 * (g - 1) for g in sorted(tables)]
    zero = [tables[g].zero_byte_ns for g in sorted(tables)]
    if len(steps) == 1:
        return zero[0], 0.0
    slope, _ = np.polyfit(steps, zero, 1)
    slope = max(float(slope), 0.0)
    return max(float(np.mean(zero)) - slope * float(np.mean(steps)), 0.0), slope


@lru_cache(maxsize=4096)
def _placement(layout: Layout, group: ParallelGroup, pipeline_rank: int) -> GroupPlacement:
    """A group's placement depends on the layout alone: looked up, as every collective of every
    estimate asks for it."""
    return layout.placement(group, pipeline_rank=pipeline_rank)


@lru_cache(maxsize=1024)
def _rank_classes(layout: Layout) -> tuple[int, ...]:
    classes: dict[tuple, int] = {}
    return tuple(classes.setdefault((*(layout.placement(group, pipeline_rank=r) for group in ParallelGroup),
                                     layout.p2p_crosses_nodes(r)), len(classes))
                 for r in range(layout.pipeline_parallel))
