"""The decoder layers of an FP8 run that stay in the model dtype: a stage's layer blocks split into
the instances inside and outside FP8.

megatron-core (``fp8_utils.is_first_last_bf16_layer``, Megatron-LM's ``--first-last-layers-bf16``)
builds and runs the layers whose global index (0-based, over the whole decoder) is below
``bf16_layers_at_start`` or at least ``num_layers - bf16_layers_at_end`` outside TransformerEngine's
FP8 context: their GEMMs run at the model dtype's rate, without FP8 casts. Layers are numbered in
megatron-core's order, chunk by chunk and rank by rank (``first_layer_numbers``). A chunk whose layers
of two kinds (dense, MoE) are folded into one block each is taken to hold them in block order.
"""

from __future__ import annotations

from dataclasses import replace

from vtrain_plugin.core.graph import Block, BlockKind, StageGraph
from vtrain_plugin.specs.training import Fp8Settings


def bf16_edge_counts(stage: StageGraph, first_layer_number: int, num_layers: int,
                     fp8: Fp8Settings) -> tuple[tuple[int, int], ...]:
    """Per block of ``stage`` (whose first layer is number ``first_layer_number``, 1-based, of
    ``num_layers``), how many of its first and of its last instances run outside FP8."""
    first = first_layer_number - 1
    held = sum(b.count for b in stage.blocks if b.kind is BlockKind.LAYER)
    at_start = max(0, min(held, fp8.bf16_layers_at_start - first))
    at_end = max(0, first + held - max(first + at_start, num_layers - fp8.bf16_layers_at_end))
    counts = [[0, 0] for _ in stage.blocks]
    layers = [i for i, b in enumerate(stage.blocks) if b.kind is BlockKind.LAYER]
    for i in layers:
        counts[i][0] = take = min(at_start, stage.blocks[i].count)
        at_start -= take
    for i in reversed(layers):
        counts[i][1] = take = min(at_end, stage.blocks[i].count - counts[i][0])
        at_end -= take
    return tuple((head, tail) for head, tail in counts)


def split_bf16_layers(stage: StageGraph, counts: tuple[tuple[int, int], ...]
                      ) -> tuple[StageGraph, tuple[bool, ...]]:
    """``stage`` with each block of ``counts`` (:func:`bf16_edge_counts`) split into its first
    instances outside FP8, the ones in FP8 and its last ones outside FP8, in that order; and per
    block of the result, whether it runs outside FP8."""
    blocks: list[Block] = []
    outside: list[bool] = []
    for block, (head, tail) in zip(stage.blocks, counts, strict=True):
        if not head and not tail:
            blocks.append(block)
            outside.append(False)
            continue
        for count, bf16 in ((head, True), (block.count - head - tail, False), (tail, True)):
            if count:
                blocks.append(block if count == block.count else replace(block, count=count))
                outside.append(bf16)
    return replace(stage, blocks=tuple(blocks)), tuple(outside)
