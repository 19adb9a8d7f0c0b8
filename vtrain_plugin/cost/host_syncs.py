"""Where megatron-core's MoE token dispatch makes the host wait for the device: the rows of a stage's
kernel batch before which the host reads token counts back, one per MoE layer forward (and recompute).

megatron-core 0.16 (``transformer/moe/token_dispatcher.py``) needs the tokens per expert on the host
to size the dispatch and the grouped GEMM's splits. Dropless, the all-to-all dispatcher copies them
on a side stream and waits for that copy (``_maybe_dtoh_and_synchronize``: ``d2h_event.synchronize()``)
before the EP all-to-all when EP or expert TP is above 1 (``before_ep_alltoall``), else before the
experts (``before_finish`` / ``before_permutation_2``); padded to capacity it needs no wait. The
all-gather dispatcher reads them with ``.cpu()`` after its all-gathers, the flex dispatcher with
``.item()`` after its dispatch: both before the experts. The backward keeps the host values and waits
for nothing; a recompute waits only where it runs the router again (the whole layer or MoE block
recomputed, not ``moe_act`` alone). Why it matters: the host otherwise runs ahead of the GPU and its per-kernel cost hides
behind the queue (:mod:`vtrain_plugin.cost.kernels.host_device`); after a wait the queue is empty and
the host cost of the dispatch, the permutation and the experts' launches is exposed until it gets
ahead again, once per MoE layer and micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from vtrain_plugin.core.graph import CollectiveKind, Phase
from vtrain_plugin.cost.comm.moe_dispatch import MOE_GROUPS
from vtrain_plugin.cost.kernels.host_device import Segment
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan, TokenDispatcher

_EXPERTS = ".mlp.experts"
_ROUTER = ".mlp.router"


def dispatch_waits(modules: Sequence[str], all_to_all_rows: frozenset[int], segments: Sequence[Segment],
                   model: ModelSpec, parallel: ParallelPlan) -> dict[int, tuple[int, ...]]:
    """Per segment index, the rows before which the host waits (see the module doc): ``modules``
    is each row's module, ``all_to_all_rows`` the rows of MoE-group all-to-alls."""
    if not model.num_experts:
        return {}
    alltoall = parallel.moe_token_dispatcher is TokenDispatcher.ALLTOALL
    if alltoall and model.moe_expert_capacity_factor is not None and model.moe_pad_expert_input_to_capacity:
        return {}
    etp = parallel.expert_tensor_parallel or parallel.tensor_parallel
    before_all_to_all = alltoall and (parallel.expert_parallel > 1 or etp > 1)
    waits: dict[int, tuple[int, ...]] = {}
    for i, s in enumerate(segments):
        if s.phase not in (Phase.FORWARD, Phase.RECOMPUTE):
            continue
        rows = [r for r in range(s.start, s.stop) if _EXPERTS in modules[r]]
        if not rows or (s.phase is Phase.RECOMPUTE
                        and not any(modules[r].endswith(_ROUTER) for r in range(s.start, rows[0]))):
            continue
        if before_all_to_all:
            a2a = [r for r in range(s.start, rows[0]) if r in all_to_all_rows]
            rows = a2a or rows
        waits[i] = (rows[0],)
    return waits


def all_to_all_rows(comm_rows) -> frozenset[int]:
    """The rows of ``comm_rows`` (a role's :class:`~vtrain_plugin.cost.prepare.CommRow`) that are
    MoE-group all-to-alls."""
    return frozenset(c.row for c in comm_rows
                     if c.node.kind is CollectiveKind.ALL_TO_ALL and c.node.group in MOE_GROUPS)


_HOST_COPY = "aten._to_copy.default"


def host_copy_rows(nodes) -> frozenset[int]:
    """The rows of ``nodes`` (a role's, ``None`` for a collective) that are a MoE dispatcher's copies of
    its token counts to the host (int64 copies of the MoE block's own module:
    :func:`megatron_adapters.moe.host_copy`)."""
    return frozenset(i for i, n in enumerate(nodes) if n is not None and n.op == _HOST_COPY
                     and n.module.endswith(".mlp") and n.key.dtypes[:1] == ("int64",))
