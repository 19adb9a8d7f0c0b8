"""Context parallelism: the attention Megatron-Core runs through TransformerEngine when each sequence is
split over CP ranks, derived from the layer traced on one rank's tokens.

Megatron-Core gives each of the ``cp`` ranks of a context-parallel group two chunks of every sequence,
chunk ``r`` and chunk ``2cp-1-r`` of ``seq / (2cp)`` tokens (the load-balanced causal split), and runs
everything but the core attention on those ``s_l = seq / cp`` tokens alone: that is the traced layer
(the tracer runs the chunk on the local sequence). The core attention needs the keys and values of
every earlier token. megatron-core has it only through TransformerEngine (``AttnFuncWithCPAndKVP2P``,
``AttnFuncWithCPAndKVAllGather``), which is not on a CPU machine, so it is synthesized here from the
traced score GEMM (``baddbmm``: ``B`` = micro-batch x heads on this TP rank, ``s_l``, head dim ``d``;
keys and values have ``query_groups / heads`` as many heads, ``B_kv``): each phase's run of
core-attention ops (forward, recompute, backward) is replaced by TE's CP attention on the
representative rank (CP rank 0):

``p2p`` (ring), ``cp`` steps. Step ``i`` attends the local queries to the K/V chunk of rank ``-i``:
  step 0 to its own under the causal mask, every later step to half a block (rank 0's later query
  chunk against the whole remote chunk), so each step is ``s_l^2 / 2`` scores and the rank's total
  ``s_l * seq / 2``: its ``seq/cp`` queries against all ``seq`` keys, the causal half. Forward: while
  step ``i < cp-1`` computes, the rank sends the K/V chunk it holds to the next rank and receives the
  next one. Backward, in TE's order: step 0 sends K/V, steps ``1 .. cp-2`` K/V and the partial dK/dV
  of the chunk, step ``cp-1`` the dK/dV: ``2(cp-1)`` chunk transfers in ``cp`` messages. A send
  hides behind the attention kernel of its step (a separate stream in TE): the costing charges
  ``max(0, send - kernel)`` per step (:mod:`vtrain_plugin.cost.comm.overlap`).
``all_gather``: every rank's K/V all-gathered before one attention kernel over the whole causal
  work; in backward the K/V all-gathered again and the dK/dV reduce-scattered after the kernel.
  Nothing hides them.
``a2a`` (DeepSpeed-Ulysses, TE's ``AttnFuncWithCPAndQKVOA2A``): Q, K and V each all-to-all'd over the
  CP group from sequence-sharded (``s_l`` tokens, all local heads) to head-sharded (``seq`` tokens,
  ``B / cp`` and ``B_kv / cp`` heads), one attention kernel over the whole causal sequence, the output
  all-to-all'd back. Backward, in TE's order: O (saved sequence-sharded) and dO all-to-all'd to
  head-sharded, the backward kernel, dQ, dK, dV all-to-all'd back. Each all-to-all's buffer is the
  rank's local tensor (``B * s_l * d`` elements for Q, O, dO, dQ; ``B_kv * s_l * d`` for K, V, dK, dV),
  of which ``(cp-1)/cp`` leaves the rank; nothing hides them (they run before / after the kernel).
  TE asserts that the CP size divides both head counts (a layout rule of the plan).
``a2a+p2p`` (hierarchical, TE's ``AttnFuncWithCPAndKVP2P`` with ``cp_size_a2a > 1``): the same
  all-to-alls over the first level of ``hierarchical_context_parallel_sizes`` (``a`` consecutive CP
  ranks, ``ParallelGroup.CP_A2A``), then the ``p2p`` ring over the second (``cp / a`` ranks ``a``
  apart, ``ParallelGroup.CP_P2P``) on chunks of ``a * s_l`` tokens and ``B / a`` heads. ``a2a`` is
  this with a ring of one step; ``p2p`` with ``a = 1``.

Bytes: a K/V chunk is ``2 * B_kv * s_l * d`` elements of the model dtype; the all-gather's output
and the reduce-scatter's input are ``cp`` chunks. Every synthesized collective is on the CP group and
marked ``synthesized``, like the pipeline sends of :mod:`vtrain_plugin.cost.comm.runtime_collectives`.

The CP attention owns the layer's core attention under every software stack: it replaces the traced
ops before the stack's lowering (:mod:`vtrain_plugin.cost.lowering.stacks`), which leaves its kernels as
they are. Its kernels are TransformerEngine's fused attention, as
:mod:`vtrain_plugin.cost.lowering.megatron_core_te` has them without CP (same op names, bytes and FLOP
conventions, so the calibrated ``attention_efficiency`` of ``megatron_core_te`` times them): one per
ring step, ``4 * B * s_q * s_kv * d`` FLOPs forward, halved under the causal mask, 2.5 times that
backward (the scores recomputed); reads Q, K, V and writes O and the fp32 log-sum-exp forward, reads
Q, K, V, O, dO and the log-sum-exp and writes dQ, dK, dV backward. megatron-core runs CP attention
only through TransformerEngine, so a plan with CP runs ``megatron_core_te``
(:meth:`vtrain_plugin.specs.training.TrainingSpec.stack_for`).

Model FLOPs (MFU, TFLOP/s per GPU) do not depend on how a micro-batch is split: they are the traced
ones with each core-attention op's counted ``cp`` times (:meth:`ContextParallel.model_flops`), as the
traced attention is the local queries against the local keys and the real one against the keys of
every CP rank; over the ``cp`` ranks that is what the layer traced on the whole sequence counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

from vtrain_plugin.core.dtypes import element_nbytes
from vtrain_plugin.core.errors import TraceError
from vtrain_plugin.core.graph import (Block, BlockKind, CollectiveKind, CollectiveNode, KernelKey, Node, OpGraph,
                                      OpNode, ParallelGroup, Phase)
from vtrain_plugin.core.op_names import parse_op_name
from megatron_adapters.conventions import CORE_ATTENTION, is_core_attention_module
from vtrain_plugin.cost.lowering.megatron_core_te import ATTENTION_BACKWARD_FLOPS, ATTENTION_CAUSAL_FRACTION, FP32
from vtrain_plugin.specs.parallel import CpCommType

FORWARD_KERNEL = "te.fused_attention.default"
BACKWARD_KERNEL = "te.fused_attention_backward.default"


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionShape:
    """One layer's core attention on one rank, from its traced score GEMM."""

    batch_heads: int  # B: micro-batch x attention heads on this TP rank
    kv_batch_heads: int  # B_kv: micro-batch x key/value heads on this TP rank
    local_tokens: int  # s_l = seq / cp
    head_dim: int
    dtype: str

    @property
    def kv_chunk_nbytes(self) -> int:
        """Keys and values of one rank's tokens: what a ring step moves."""
        return 2 * self.kv_batch_heads * self.local_tokens * self.head_dim * element_nbytes(self.dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextParallel:
    """How the layers' core attention runs under context parallelism (see the module doc)."""

    size: int
    comm_type: CpCommType
    kv_heads_per_head: Fraction  # query groups / attention heads
    a2a_size: int = 1  # ranks of the all-to-all (ParallelPlan.cp_a2a_size): the whole group under a2a

    @classmethod
    def of(cls, graph: OpGraph) -> ContextParallel | None:
        """The CP attention of ``graph``'s plan; None without context parallelism."""
        plan = graph.parallel
        if plan.context_parallel == 1 or graph.model is None:
            return None
        model = graph.model
        return cls(size=plan.context_parallel, comm_type=plan.cp_comm_type, a2a_size=plan.cp_a2a_size,
                   kv_heads_per_head=Fraction(model.query_groups, model.num_attention_heads))

    def model_flops(self, node: OpNode) -> int:
        """The model FLOPs of a traced op on one CP rank (see the module doc)."""
        return node.flops * self.size if is_core_attention_module(node.module) else node.flops

    def layer_nodes(self, nodes: Sequence[Node]) -> tuple[Node, ...]:
        """A layer's nodes with each phase's run of core-attention ops replaced by CP attention, in
        the place of the run's first op (the runs' ops that launch no kernel go with them)."""
        runs: dict[Phase, list[OpNode]] = {}
        out: list[Node | Phase] = []
        for node in nodes:
            if isinstance(node, OpNode) and is_core_attention_module(node.module):
                if node.phase not in runs:
                    runs[node.phase] = []
                    out.append(node.phase)
                runs[node.phase].append(node)
            else:
                out.append(node)
        if not runs:
            return tuple(nodes)
        forward = runs.get(Phase.FORWARD) or runs.get(Phase.RECOMPUTE) or []
        shape = self.shape(forward)
        result: list[Node] = []
        for item in out:
            if isinstance(item, Phase):
                result.extend(self.attention(runs[item][0], shape))
            else:
                result.append(item)
        return tuple(result)

    def shape(self, forward_run: Sequence[OpNode]) -> AttentionShape:
        """The attention's shape, read from the score GEMM of its forward (``baddbmm``: bias
        ``[B, s_q, s_k]``, queries ``[B, s_q, d]``, keys ``[B, d, s_k]``)."""
        score = next((n for n in forward_run if parse_op_name(n.op).name == "baddbmm"), None)
        if score is None:
            where = forward_run[0].module if forward_run else "a layer"
            raise TraceError(f"context parallelism: no score GEMM (baddbmm) traced in the forward of {where}'s "
                             f"core attention to derive the CP attention from")
        batch_heads, tokens, head_dim = score.key.input_shapes[1]
        kv = batch_heads * self.kv_heads_per_head
        if kv.denominator != 1:
            raise TraceError(f"context parallelism: {batch_heads} query heads x {self.kv_heads_per_head} "
                             f"is not a whole number of key/value heads")
        return AttentionShape(batch_heads=batch_heads, kv_batch_heads=int(kv), local_tokens=tokens,
                              head_dim=head_dim, dtype=score.key.dtypes[1])

    def attention(self, like: OpNode, shape: AttentionShape) -> list[Node]:
        """The CP attention of one phase, in the phase and module of ``like``."""
        module = like.module[:like.module.index(CORE_ATTENTION) + len(CORE_ATTENTION)]
        backward = like.phase is Phase.BACKWARD
        chunk = shape.kv_chunk_nbytes
        s_l, cp = shape.local_tokens, self.size

        def collective(kind: CollectiveKind, nbytes: int) -> CollectiveNode:
            return CollectiveNode(kind=kind, nbytes=nbytes, group=ParallelGroup.CP, group_size=cp, phase=like.phase,
                                  module=module, dtype=shape.dtype, synthesized=True)

        def kernel(queries: int, keys: int, causal: bool) -> OpNode:
            return attention_kernel(shape, queries=queries, keys=keys, causal=causal, backward=backward,
                                    phase=like.phase, module=module)

        if self.comm_type is CpCommType.ALL_GATHER:
            gathered = cp * chunk
            nodes: list[Node] = [collective(CollectiveKind.ALL_GATHER, gathered), kernel(s_l, cp * s_l, True)]
            if backward:
                nodes.append(collective(CollectiveKind.REDUCE_SCATTER, gathered))
            return nodes
        a = self.a2a_size
        if a == 1:
            return self._ring(like, shape, ParallelGroup.CP, cp, module)
        a2a_group = ParallelGroup.CP if a == cp else ParallelGroup.CP_A2A

        def all_to_all(*heads: int) -> list[Node]:  # one per tensor, each the rank's local tensor
            e = element_nbytes(shape.dtype)
            return [CollectiveNode(kind=CollectiveKind.ALL_TO_ALL, nbytes=h * s_l * shape.head_dim * e,
                                   group=a2a_group, group_size=a, phase=like.phase, module=module,
                                   dtype=shape.dtype, synthesized=True) for h in heads]

        b, b_kv = shape.batch_heads, shape.kv_batch_heads
        split = replace(shape, batch_heads=b // a, kv_batch_heads=b_kv // a, local_tokens=a * s_l)
        ring = self._ring(like, split, ParallelGroup.CP_P2P, cp // a, module)
        if backward:  # O and dO to head-sharded; dQ, dK, dV back
            return all_to_all(b, b) + ring + all_to_all(b, b_kv, b_kv)
        return all_to_all(b, b_kv, b_kv) + ring + all_to_all(b)

    @staticmethod
    def _ring(like: OpNode, shape: AttentionShape, group: ParallelGroup, size: int, module: str) -> list[Node]:
        """TE's p2p ring of ``size`` steps over ``group`` on ``shape``'s chunks (see the module doc)."""
        backward = like.phase is Phase.BACKWARD
        chunk, s_l = shape.kv_chunk_nbytes, shape.local_tokens

        def kernel(queries: int, keys: int, causal: bool) -> OpNode:
            return attention_kernel(shape, queries=queries, keys=keys, causal=causal, backward=backward,
                                    phase=like.phase, module=module)

        nodes: list[Node] = []
        for step in range(size):
            chunks = int(step < size - 1) + int(backward and step > 0)  # K/V onward; dK/dV back (backward)
            if chunks:
                nbytes = chunks * chunk
                nodes += [CollectiveNode(kind=kind, nbytes=nbytes, group=group, group_size=size, phase=like.phase,
                                         module=module, dtype=shape.dtype, synthesized=True)
                          for kind in (CollectiveKind.SEND, CollectiveKind.RECV)]
            nodes.append(kernel(s_l, s_l, True) if step == 0 else kernel(s_l // 2, s_l, False))
        return nodes


def with_context_parallel(graph: OpGraph) -> OpGraph:
    """``graph`` with every layer's core attention replaced by its CP attention, as costing sees it
    (``graph`` itself without context parallelism): for reports of the traced graph."""
    cp = ContextParallel.of(graph)
    if cp is None:
        return graph
    stages = tuple(replace(stage, blocks=tuple(
        replace(block, nodes=cp.layer_nodes(block.nodes)) if block.kind is BlockKind.LAYER else block
        for block in stage.blocks)) for stage in graph.stages)
    return replace(graph, stages=stages)


def model_flops(blocks: Sequence[Block], cp: ContextParallel | None, phase: Phase | None = None) -> int:
    """Model FLOPs of one micro-batch through ``blocks`` (in ``phase``) on one TP and CP rank."""
    count = (lambda op: op.flops) if cp is None else cp.model_flops
    return sum(b.count * count(op) for b in blocks for op in b.ops(phase))


def attention_kernel(shape: AttentionShape, *, queries: int, keys: int, causal: bool, backward: bool, phase: Phase,
                     module: str) -> OpNode:
    """TransformerEngine's fused attention of ``queries`` x ``keys`` (see the module doc), its
    operands ``[s, B, d]`` (TE's ``[s, b, h, d]`` with micro-batch and heads folded, as the score
    GEMM gives them)."""
    b, b_kv, d = shape.batch_heads, shape.kv_batch_heads, shape.head_dim
    e = element_nbytes(shape.dtype)
    q, k, lse = b * queries * d, b_kv * keys * d, FP32 * b * queries
    flops = round(4 * b * queries * keys * d * (ATTENTION_CAUSAL_FRACTION if causal else 1))
    inputs = ((queries, b, d), (keys, b_kv, d), (keys, b_kv, d))
    key = KernelKey(op=BACKWARD_KERNEL if backward else FORWARD_KERNEL, input_shapes=inputs,
                    dtypes=(shape.dtype,) * 3)
    if backward:
        return OpNode(key=key, phase=phase, module=module, output_shapes=((queries, b, d),),
                      flops=round(ATTENTION_BACKWARD_FLOPS * flops), nbytes=e * (4 * q + 4 * k) + lse)
    return OpNode(key=key, phase=phase, module=module, output_shapes=((queries, b, d),), flops=flops,
                  nbytes=e * (2 * q + 2 * k) + lse)
