"""Megatron-LM's ``--deterministic-mode``: the kernels that change when every run must repeat bit for bit.

megatron-core requires ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` for TransformerEngine's attention
(``extensions/transformer_engine.py``), so TE picks a fused-attention backward that accumulates dQ in a
fixed order (cuDNN's deterministic backward, FlashAttention's ``deterministic=True``) instead of with
atomic adds from every key tile. That backward runs five score-sized GEMMs (dV, dP, dS, dQ, dK); only
dQ's accumulation is ordered, so the slowdown is at most that GEMM's share, 1/5, fully serialised:
:data:`DETERMINISTIC_ATTENTION_BACKWARD` lies in [1.0, 1.2] and is taken mid-range, 1.1, a bound from
the kernel's structure, not a measurement (the estimate's assumptions say so). The kernel gets a key
of its own, so a duration measured for the non-deterministic one does not apply.

The rest of deterministic mode is priced elsewhere or left as traced: NCCL is pinned to the ring
algorithm (Megatron-LM asserts ``NCCL_ALGO`` is set; NVIDIA's functional tests set ``Ring``), so
all-reduces that span nodes lose the tree (:class:`~vtrain_plugin.cost.comm.collectives.CommModel`'s
``ring_only``); the embedding's backward (an indexed gather's ``index_put_`` instead of
``embedding_dense_backward``) and MoE's unpermute (``index_add`` instead of ``scatter_add``) keep
their traced prices (the kernel model's per-element rate of each, measured without deterministic mode).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from vtrain_plugin.core.graph import KernelKey, Node, OpNode

DETERMINISTIC_ATTENTION_BACKWARD = 1.1  # x the fused attention backward's time; range [1.0, 1.2] (module doc)
ATTENTION_BACKWARD_OPS = ("te.fused_attention_backward.default",)


def deterministic_kernels(nodes: Sequence[Node]) -> tuple[Node, ...]:
    """``nodes`` (lowered) with each fused-attention backward priced as its deterministic variant."""
    return tuple(_deterministic(n) if isinstance(n, OpNode) and n.key.op in ATTENTION_BACKWARD_OPS else n
                 for n in nodes)


def _deterministic(node: OpNode) -> OpNode:
    key = KernelKey(op=node.key.op, input_shapes=node.key.input_shapes, dtypes=node.key.dtypes,
                    args=(*node.key.args, ("deterministic", True)))
    return replace(node, key=key, flops=round(node.flops * DETERMINISTIC_ATTENTION_BACKWARD))
