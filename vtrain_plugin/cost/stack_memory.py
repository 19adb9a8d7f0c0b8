"""What the software stack changes in the memory the trace measured (:mod:`vtrain_plugin.cost.memory`).

The trace records megatron-core's local spec; a stack with fused attention (``megatron_core_te``)
keeps no score-sized tensors for backward (:func:`~vtrain_plugin.cost.lowering_te.fused_attention_saved_delta`:
one layer's activations go from quadratic to linear in the sequence length) and no causal mask (the
local spec's softmax keeps the ``s x s`` mask the layers of a chunk share, traced as the stage block
:data:`~megatron_adapters.conventions.SHARED_BY_CORE_ATTENTION`; TransformerEngine's causal kernels
take no mask, while a checkpoint around the attention or the layer keeps it as an input and its
bytes stay with the chunk), and TransformerEngine
in FP8 keeps an FP8 copy of each linear weight and its transpose across the micro-batches of an
iteration (:func:`~vtrain_plugin.cost.lowering_fp8.fp8_weight_cache_nbytes`), counted with the
weights. Activations saved in FP8 by TE's linears are still counted in the model dtype.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_adapters.conventions import SHARED_BY_CORE_ATTENTION
from vtrain_plugin.core.graph import OpGraph
from vtrain_plugin.core.units import GIB
from vtrain_plugin.cost.lowering_fp8 import fp8_weight_cache_nbytes
from vtrain_plugin.cost.lowering_te import fused_attention_saved_delta
from vtrain_plugin.cost.memory import PeakLive, RankMemory, rank_memory
from vtrain_plugin.specs.training import Fp8Settings, SoftwareStack


def stack_rank_memory(graph: OpGraph, peak_live: PeakLive, stack: SoftwareStack, fp8: Fp8Settings | None = None, *,
                      distributed_optimizer: bool = False) -> tuple[RankMemory, ...]:
    """:func:`~vtrain_plugin.cost.memory.rank_memory` of ``graph`` as ``stack`` (in FP8 with
    ``fp8``) runs it."""
    if stack is SoftwareStack.MEGATRON_CORE_TE:
        graph = replace(graph, stages=tuple(
            replace(stage, blocks=tuple(
                replace(block, activation_nbytes=block.activation_nbytes + fused_attention_saved_delta(block.nodes))
                for block in stage.blocks if block.name != SHARED_BY_CORE_ATTENTION))
            for stage in graph.stages))
    memory = rank_memory(graph, peak_live, distributed_optimizer=distributed_optimizer)
    if fp8 is None:
        return memory
    cache = [0] * graph.parallel.pipeline_parallel
    for stage in graph.stages:
        cache[stage.pipeline_rank] += sum(b.count * fp8_weight_cache_nbytes(b.nodes) for b in stage.blocks)
    return tuple(replace(m, weights_gib=m.weights_gib + cache[rank] / GIB) for rank, m in enumerate(memory))
