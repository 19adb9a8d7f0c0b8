"""Megatron-Core's local layer spec (``megatron_core_local``, ``--transformer-impl local``): today's
Megatron-LM with Megatron's own fused kernels instead of TransformerEngine's.

The local spec's layers run the kernels of the legacy Megatron model (:mod:`.megatron_deepspeed`):
the fused causal scale-mask-softmax around unfused attention GEMMs, bias-GeLU, bias-dropout-add,
dropout and apex's fused LayerNorm. The optimizer is megatron-core's whatever the layers: its
multi-tensor passes over the block's parameters (:func:`.megatron_core_te.map_optimizer`: unscale
for fp16, gradient norm, clip, Adam, copy to the model weights), in bf16 as in fp16.

Why a stack of its own: the kernels are the 2023 stack's, but the host work is megatron-core's
(its module tree, hooks, distributed-optimizer and per-step bookkeeping), so its host costs are
fitted apart (one calibration file per GPU, ``megatron_core_local.json``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from vtrain_plugin.core.graph import Node
from vtrain_plugin.cost.lowering.fusion import lower_block
from vtrain_plugin.cost.lowering.megatron_core_te import map_optimizer
from vtrain_plugin.cost.lowering.megatron_deepspeed import map_group


def megatron_core_local(nodes: Sequence[Node], *, unfused: Collection[str] = ()) -> tuple[Node, ...]:
    """The block's nodes as megatron-core's local spec runs them (see the module doc), with the
    fusions ``unfused`` names (``training.unfused_kernels``) off."""
    return lower_block(nodes, lambda group: map_group(group, unfused), map_optimizer)
