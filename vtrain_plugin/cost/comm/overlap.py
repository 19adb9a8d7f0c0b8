"""Which kernel a collective on the compute path can hide behind.

Most collectives inside a model chunk block its compute stream: the next kernel waits for them. Two
kinds run beside it in Megatron-Core with TransformerEngine, each paired with one kernel:

- a context-parallel ring send (:mod:`vtrain_plugin.cost.comm.context_parallel`) runs on its own stream
  while the attention kernel of its ring step computes: the next kernel after it;
- with ``training.tp_comm_overlap`` (TE's userbuffers), the all-gathers and reduce-scatters of
  sequence parallelism inside a transformer layer overlap a GEMM of their linear module: the next
  one in the phase when there is one (the forward all-gather feeds its GEMM; in backward the
  all-gather of the output gradient feeds the data-gradient GEMM, and the reduce-scatter of the input
  gradient runs beside the weight-gradient GEMM), else the previous one (the forward
  reduce-scatter of a row-parallel layer, pipelined with the GEMM that produces its input).

- with ``moe_shared_expert_overlap``, a MoE layer's token all-to-alls of the forward (and its
  recompute) run beside its shared expert, which megatron-core computes on a second stream: the
  dispatch all-to-all beside the shared expert's first GEMM (``linear_fc1``), the combine beside its
  second (``linear_fc2``). Backward is not overlapped (megatron-core 0.16 overlaps the forward).

Such a collective costs ``max(0, comm - kernel)`` on the compute stream, the part its kernel cannot
hide (:mod:`vtrain_plugin.cost.costing`). TP collectives outside the layers (embedding, output layer,
loss) and all-reduces stay blocking, as do CP all-gathers.
"""

from __future__ import annotations

from collections.abc import Sequence

from vtrain_plugin.core.graph import CP_GROUPS, CollectiveKind, CollectiveNode, OpNode, ParallelGroup, Phase
from vtrain_plugin.cost.kernels.op_classes import OpClass, classify

_TP_OVERLAPPED = (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER)


def overlap_partners(nodes: Sequence[OpNode | CollectiveNode], *, in_layer: bool,
                     shared_expert_overlap: bool = False) -> dict[int, int]:
    """For the collectives of one phase of one block (``nodes`` in order) that can hide behind a
    kernel, the index of that kernel (see the module doc); ``in_layer``: the block is a transformer
    layer; ``shared_expert_overlap``: its MoE layer's shared expert runs beside the all-to-alls."""
    partners: dict[int, int] = _shared_expert_partners(nodes) if in_layer and shared_expert_overlap else {}
    for i, node in enumerate(nodes):
        if not isinstance(node, CollectiveNode):
            continue
        if node.group in CP_GROUPS and node.kind is CollectiveKind.SEND:
            following = next((j for j in range(i + 1, len(nodes)) if isinstance(nodes[j], OpNode)), None)
            if following is not None:
                partners[i] = following
        elif in_layer and node.group is ParallelGroup.TP and node.kind in _TP_OVERLAPPED:
            gemms = [j for j, n in enumerate(nodes)
                     if isinstance(n, OpNode) and n.module == node.module and classify(n.op) is OpClass.GEMM]
            after = [j for j in gemms if j > i]
            before = [j for j in gemms if j < i]
            if after or before:
                partners[i] = after[0] if after else before[-1]
    return partners


def exposed_ns(comm_ns: float, kernel_ns: float) -> float:
    """What of a collective of ``comm_ns`` stays on the compute path beside a kernel of ``kernel_ns``."""
    return max(0.0, comm_ns - kernel_ns)


def _shared_expert_partners(nodes: Sequence[OpNode | CollectiveNode]) -> dict[int, int]:
    """The forward token all-to-alls of a MoE layer (its first, the dispatch, and its last, the
    combine), each with the shared expert's GEMM it overlaps (``linear_fc1``, ``linear_fc2``)."""
    if not nodes or nodes[0].phase not in (Phase.FORWARD, Phase.RECOMPUTE):
        return {}
    all_to_alls = [i for i, n in enumerate(nodes) if isinstance(n, CollectiveNode)
                   and n.kind is CollectiveKind.ALL_TO_ALL and n.group is ParallelGroup.EP]
    gemms = [next((j for j, n in enumerate(nodes) if isinstance(n, OpNode) and classify(n.op) is OpClass.GEMM
                   and n.module.endswith(f".mlp.shared_experts.{linear}")), None)
             for linear in ("linear_fc1", "linear_fc2")]
    if len(all_to_alls) < 2:
        return {}
    # the tokens' dispatch (megatron sends the routing probabilities in a small all-to-all of their
    # own after it, which stays blocking) and the combine
    return {i: j for i, j in zip((all_to_alls[0], all_to_alls[-1]), gemms) if j is not None}
