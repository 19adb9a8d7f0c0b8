"""TransformerEngine's fused MoE kernels (``--moe-permute-fusion``, ``--moe-router-fusion``) as lowerings
of the unfused ops megatron-core's MoE layer is traced with.

The trace runs megatron-core 0.16's unfused permutation (:mod:`megatron_adapters.moe`): a ``nonzero``
and gathers per ``permute``, a ``scatter_add_`` per ``unpermute``, a ``cat`` of the chunks per
``sort_chunks_by_idxs``, and the autograd backwards of each (``index_add``, ``gather``, ``cat``).
With ``moe_permute_fusion`` megatron-core calls TE's ``moe_permute`` / ``moe_unpermute`` /
``moe_sort_chunks_by_index`` instead; each group becomes one kernel each way, memory-bound, its bytes
(``t`` tokens, ``r`` routed rows, ``h`` hidden, ``E`` local experts, ``e`` and ``p`` the bytes of a
token element and a probability):

=================================  ==========================================  ========================
traced ops (the MoE layer's         kernel                                      bytes
``.mlp`` module)
=================================  ==========================================  ========================
permute fwd: clone of the map,      ``te.moe_permute`` (with probs when the     2 r h e + t E (1 + 4)
arange, nonzero, index_select       dispatcher permutes them: + 2 r p)          (map read, row-id map)
unpermute fwd: zeros, scatter_add_  ``te.moe_unpermute``                        (r + t) h e + 4 t E
unpermute bwd: gather               ``te.moe_unpermute_backward``               (r + t) h e + 4 t E
permute bwd: new_zeros, index_add   ``te.moe_permute_backward`` (probs:         (r + t) h e + 4 t E
(twice with probs)                  + r p + t E p)
sort chunks: cat of the rows (and   ``te.moe_sort_chunks_by_index`` (and        2 r h e + 8 r (+ 2 r p)
of the probs), fwd or bwd           ``_backward``)
=================================  ==========================================  ========================

The fused path drops one host copy: megatron-core copies the per-local-expert counts of every rank
(``num_global_tokens_per_local_expert``, the dispatcher's one 2-D count tensor) to the host only to
split the chunks unfused. The wait for the copies stays where it was: before the experts
(``before_finish`` instead of ``before_permutation_2``, both ahead of the first expert kernel;
:mod:`vtrain_plugin.cost.host_syncs`). The all-gather dispatcher's own ``masked_select`` of the
probabilities is outside ``permute`` and stays as traced.

With ``moe_router_fusion`` megatron-core's router calls TE's ``fused_topk_with_score_function``,
``fused_compute_score_for_moe_aux_loss`` and ``fused_moe_aux_loss`` (:func:`fuse_router`; ``l`` the
bytes of a logit): forward, the ops between the gating GEMM and the count of tokens per expert are
the fused top-k (logits in, probabilities, map and fp32 scores out: ``t E (2 l + 1 + 4)``) and, with
an auxiliary loss, the scores for the loss (``t E (l + 1 + 8)``); the loss's reductions are one
kernel (``4 t E + 8 E``). Backward, the ops before the gating GEMM's are the three backwards (the
loss ``4 t E``, its scores ``t E (8 + l)``, the top-k ``t E (2 l + 5)``); autograd's sum of the two
gradients of the logits stays. Sinkhorn routing has no fused path and stays as traced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vtrain_plugin.core.dtypes import element_nbytes
from vtrain_plugin.core.graph import Node, OpNode, Phase
from vtrain_plugin.cost.lowering.fusion import FORWARD_PHASES, fused, op_name, splice

PERMUTE = "te.moe_permute.default"
PERMUTE_BACKWARD = "te.moe_permute_backward.default"
UNPERMUTE = "te.moe_unpermute.default"
UNPERMUTE_BACKWARD = "te.moe_unpermute_backward.default"
SORT_CHUNKS = "te.moe_sort_chunks_by_index.default"
SORT_CHUNKS_BACKWARD = "te.moe_sort_chunks_by_index_backward.default"
ROW_ID = 4  # bytes of a row-id map entry (int32)
MAP = 1  # bytes of a routing-map entry (bool)
_MLP = ".mlp"
_ROUTER = ".mlp.router"


@dataclass(frozen=True, slots=True)
class _Permutation:
    """One layer's forward permute: ``tokens`` rows of ``hidden`` in, ``experts`` experts in its map,
    probabilities permuted alongside (their element bytes) or not (0)."""

    tokens: int
    hidden: int
    experts: int
    probs_nbytes: int

    def rows(self, node: OpNode, index: int = 0) -> bool:
        """Whether ``node``'s ``index``-th input is this permute's tokens (``t x h``)."""
        return tuple(node.key.input_shapes[index]) == (self.tokens, self.hidden)


def fuse_permutation(nodes: Sequence[Node]) -> tuple[Node, ...]:
    """``nodes`` (one block, lowered) with each MoE layer's unfused permutation as TE's fused kernels
    (see the module doc); a group that does not match is left as traced."""
    nodes = list(nodes)
    layers = {n.module[:-len(_ROUTER)] + _MLP for n in nodes if n.module.endswith(_ROUTER)}
    if not layers:
        return tuple(nodes)

    def ours(i: int, phase: Phase) -> bool:
        n = nodes[i] if 0 <= i < len(nodes) else None
        return isinstance(n, OpNode) and n.module in layers and n.phase is phase

    permutations: dict[str, _Permutation] = {}
    out: list[Node] = []
    i = 0
    while i < len(nodes):
        node = nodes[i]
        if not (isinstance(node, OpNode) and node.module in layers and node.phase is not Phase.OPTIMIZER):
            out.append(node)
            i += 1
            continue
        name, phase = op_name(node), node.phase
        if name == "clone" and node.key.dtypes[:1] == ("bool",) and ours(i + 1, phase) \
                and op_name(nodes[i + 1]) == "arange" and phase in FORWARD_PHASES:
            end = _permute_end(nodes, i, ours)
            if end is not None:
                kernel, permutations[node.module] = _permute(nodes[i:end + 1])
                out.append(kernel)
                i = end + 1
                continue
        known = permutations.get(node.module)
        if name == "zeros" and known and ours(i + 1, phase) and op_name(nodes[i + 1]) == "scatter_add_" \
                and known.rows(nodes[i + 1]):
            out.append(_unpermute(nodes[i + 1], known, UNPERMUTE, nodes[i + 1].key.input_shapes[1][0]))
            i += 2
            continue
        if name == "gather" and known and phase is Phase.BACKWARD and known.rows(node):
            out.append(_unpermute(node, known, UNPERMUTE_BACKWARD, node.output_shapes[0][0]))
            i += 1
            continue
        if name == "new_zeros" and known and phase is Phase.BACKWARD and ours(i + 1, phase) \
                and op_name(nodes[i + 1]) == "index_add" and known.rows(nodes[i + 1]):
            taken = _permute_backward_run(nodes, i, known, ours, out)
            if taken is not None:
                out.append(taken[0])
                i = taken[1]
                continue
        if name == "cat" and len(node.output_shapes[0]) == 2:
            probs = next((j for j in (i - 1, i + 1) if ours(j, phase) and op_name(nodes[j]) == "cat"
                          and nodes[j].output_shapes[0] == node.output_shapes[0][:1]), None)
            if probs == i - 1 and out and out[-1] is nodes[i - 1]:
                out.pop()
            out.append(_sort_chunks(node, nodes[probs] if probs is not None else None))
            i = i + 2 if probs == i + 1 else i + 1
            continue
        if name == "_to_copy" and phase in FORWARD_PHASES and node.key.dtypes[:1] == ("int64",) \
                and len(node.key.input_shapes[0]) == 2:
            i += 1  # the unfused path's host copy of the per-local-expert counts
            continue
        out.append(node)
        i += 1
    return tuple(out)


def _permute_end(nodes: list[Node], start: int, ours) -> int | None:
    """The index of the token ``index_select`` that ends the permute starting at ``start``."""
    phase = nodes[start].phase
    for j in range(start + 1, len(nodes)):
        if not ours(j, phase):
            return None
        if op_name(nodes[j]) == "index_select" and len(nodes[j].output_shapes[0]) == 2:
            return j
    return None


def _permute(run: list[OpNode]) -> tuple[OpNode, _Permutation]:
    experts, tokens = run[0].key.input_shapes[0]
    gather = run[-1]
    rows, hidden = gather.output_shapes[0]
    e = element_nbytes(gather.key.dtypes[0])
    selects = [n for n in run[:-1] if op_name(n) == "index_select"]
    p = element_nbytes(selects[-1].key.dtypes[0]) if sum(op_name(n) == "nonzero_static" for n in run) > 1 else 0
    nbytes = 2 * rows * hidden * e + tokens * experts * (MAP + ROW_ID) + 2 * rows * p
    kernel = fused(PERMUTE, run[0], (rows, hidden), nbytes, gather.key.dtypes[0],
                   input_shapes=((tokens, hidden), (experts, tokens)), args=(("probs", bool(p)),))
    return kernel, _Permutation(tokens=tokens, hidden=hidden, experts=experts, probs_nbytes=p)


def _unpermute(node: OpNode, known: _Permutation, op: str, rows: int) -> OpNode:
    hidden = node.output_shapes[0][1]
    e = element_nbytes(node.key.dtypes[0])
    nbytes = (rows + known.tokens) * hidden * e + ROW_ID * known.tokens * known.experts
    out = (known.tokens, hidden) if op == UNPERMUTE else (rows, hidden)
    into = (rows, hidden) if op == UNPERMUTE else (known.tokens, hidden)
    return fused(op, node, out, nbytes, node.key.dtypes[0], input_shapes=(into, (known.experts, known.tokens)))


def _permute_backward_run(nodes: list[Node], i: int, known: _Permutation, ours, out: list[Node]):
    """TE's permute backward for the ``new_zeros`` + 2-D ``index_add`` at ``i`` (and the probs' pair
    beside it when the forward permuted them): (kernel, next index), or None."""
    add = nodes[i + 1]
    rows, hidden = add.key.input_shapes[2]
    probs = 0
    end = i + 2
    if known.probs_nbytes:
        after = ours(i + 3, add.phase) and op_name(nodes[i + 2]) == "new_zeros" and op_name(nodes[i + 3]) == "index_add"
        before = (ours(i - 2, add.phase) and op_name(nodes[i - 2]) == "new_zeros" and op_name(nodes[i - 1]) == "index_add"
                  and len(out) >= 2 and out[-1] is nodes[i - 1])
        if after:
            end = i + 4
        elif before:
            del out[-2:]
        else:
            return None
        probs = known.probs_nbytes
    e = element_nbytes(add.key.dtypes[0])
    t, experts = known.tokens, known.experts
    nbytes = (rows + t) * hidden * e + ROW_ID * t * experts + (rows * probs + t * experts * probs)
    kernel = fused(PERMUTE_BACKWARD, nodes[i], (t, hidden), nbytes, add.key.dtypes[0],
                   input_shapes=((rows, hidden), (experts, t)), args=(("probs", bool(probs)),))
    return kernel, end


def _sort_chunks(rows_cat: OpNode, probs_cat: OpNode | None) -> OpNode:
    rows, hidden = rows_cat.output_shapes[0]
    e = element_nbytes(rows_cat.key.dtypes[0])
    p = element_nbytes(probs_cat.key.dtypes[0]) if probs_cat is not None else 0
    op = SORT_CHUNKS_BACKWARD if rows_cat.phase is Phase.BACKWARD else SORT_CHUNKS
    nbytes = 2 * rows * hidden * e + 2 * ROW_ID * rows + 2 * rows * p
    return fused(op, rows_cat, (rows, hidden), nbytes, rows_cat.key.dtypes[0], input_shapes=((rows, hidden),),
                 args=(("probs", bool(p)),))


TOPK = "te.fused_topk_with_score_function.default"
TOPK_BACKWARD = "te.fused_topk_with_score_function_backward.default"
AUX_SCORES = "te.fused_score_for_moe_aux_loss.default"
AUX_SCORES_BACKWARD = "te.fused_score_for_moe_aux_loss_backward.default"
AUX_LOSS = "te.fused_moe_aux_loss.default"
AUX_LOSS_BACKWARD = "te.fused_moe_aux_loss_backward.default"
FP32 = 4


def fuse_router(nodes: Sequence[Node]) -> tuple[Node, ...]:
    """``nodes`` (one block, lowered) with each MoE router's top-k and auxiliary loss as TE's fused
    kernels (``moe_router_fusion``; see the module doc); a router whose ops do not match is left as
    traced."""
    nodes = list(nodes)
    routers = {n.module for n in nodes if n.module.endswith(_ROUTER)}
    if not routers:
        return tuple(nodes)
    replaced: dict[int, list[Node]] = {}
    dropped: set[int] = set()
    with_aux: dict[str, bool] = {}
    for module in sorted(routers):
        for phase in (*FORWARD_PHASES, Phase.BACKWARD):
            ix = [i for i, n in enumerate(nodes) if n.module == module and n.phase is phase and isinstance(n, OpNode)]
            gemms = [i for i in ix if op_name(nodes[i]) == "mm"]
            if not gemms:
                continue
            if phase is Phase.BACKWARD:
                done = _router_backward(nodes, ix, gemms[0], with_aux.get(module))
            else:
                done = _router_forward(nodes, ix, gemms[0])
                if done is not None:
                    with_aux[module] = done[2]
            if done is not None:
                kernels, gone = done[0], done[1]
                for at, ks in kernels.items():
                    replaced[at] = ks
                dropped.update(gone)
    return splice(nodes, replaced, dropped)


def _contiguous(nodes: list[Node], start: int, stop: int, module: str, phase: Phase) -> bool:
    return all(isinstance(n, OpNode) and n.module == module and n.phase is phase for n in nodes[start:stop])


def _router_forward(nodes: list[Node], ix: list[int], gemm: int):
    """Forward: the ops after the gating GEMM up to the count of tokens per expert (a sum over the
    boolean routing map) as the fused top-k (and, with an auxiliary loss, its scores' kernel); the
    loss's own reductions after it as the fused loss."""
    module, phase = nodes[gemm].module, nodes[gemm].phase
    tokens, experts = nodes[gemm].output_shapes[0][-2:]
    logits = element_nbytes(nodes[gemm].key.dtypes[0])
    after = [i for i in ix if i > gemm]
    count = next((i for i in after if op_name(nodes[i]) == "sum" and nodes[i].key.dtypes[:1] == ("bool",)), None)
    scores_end = count if count is not None else (after[-1] + 1 if after else gemm + 1)
    if scores_end <= gemm + 1 or not _contiguous(nodes, gemm + 1, scores_end, module, phase):
        return None
    first = nodes[gemm + 1]
    kernels = {gemm + 1: [fused(TOPK, first, (tokens, experts), tokens * experts * (2 * logits + MAP + FP32),
                                first.key.dtypes[0], input_shapes=((tokens, experts),))]}
    gone = set(range(gemm + 1, scores_end))
    if count is None:
        return kernels, gone, False
    kernels[gemm + 1].append(fused(AUX_SCORES, first, (tokens, experts), tokens * experts * (logits + MAP + 2 * FP32),
                                   first.key.dtypes[0], input_shapes=((tokens, experts),)))
    loss = next((i for i in ix if i > count and op_name(nodes[i]) == "sum"
                 and nodes[i].key.input_shapes[0] == (tokens, experts)), None)
    if loss is None:
        return None
    end = loss + 1
    while end < len(nodes) and _contiguous(nodes, end, end + 1, module, phase) \
            and all(len(s) <= 1 for s in nodes[end].key.input_shapes) and op_name(nodes[end]) not in ("add_", "copy_"):
        end += 1
    kernels[loss] = [fused(AUX_LOSS, nodes[loss], (), tokens * experts * FP32 + 8 * experts + FP32, "float32",
                           input_shapes=((tokens, experts), (experts,)))]
    gone.update(range(loss, end))
    return kernels, gone, True


def _router_backward(nodes: list[Node], ix: list[int], gemm: int, aux: bool | None):
    """Backward: the ops before the gating GEMM's backward (but the sum of the two gradients of the
    logits, with an auxiliary loss) as the fused loss, scores and top-k backwards."""
    if aux is None:
        return None
    module, phase = nodes[gemm].module, nodes[gemm].phase
    tokens, experts = nodes[gemm].key.input_shapes[0]
    before = [i for i in ix if i < gemm]
    if not before:
        return None
    start, stop = before[0], gemm
    if aux and op_name(nodes[gemm - 1]) == "add" and nodes[gemm - 1].key.input_shapes[:2] == ((tokens, experts),) * 2:
        stop = gemm - 1  # autograd's sum of the top-k's and the loss's gradients of the logits
    if stop <= start or not _contiguous(nodes, start, stop, module, phase):
        return None
    logits = element_nbytes(nodes[gemm].key.dtypes[0])
    first, n = nodes[start], tokens * experts
    kernels = [fused(TOPK_BACKWARD, first, (tokens, experts), n * (2 * logits + MAP + FP32), first.key.dtypes[0],
                     input_shapes=((tokens, experts),))]
    if aux:
        kernels = [fused(AUX_LOSS_BACKWARD, first, (tokens, experts), n * FP32 + 8 * experts + FP32, "float32",
                         input_shapes=((experts,),)),
                   fused(AUX_SCORES_BACKWARD, first, (tokens, experts), n * (2 * FP32 + logits), "float32",
                         input_shapes=((tokens, experts),)),
                   *kernels]
    return {start: kernels}, set(range(start, stop)), aux
