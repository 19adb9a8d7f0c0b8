"""Dropout masks as a GPU keeps them (one byte per element) against the traced CPU step's (the model
dtype), on small real megatron-core GPT layers: every mask counted once, none where recompute
rebuilds it, none in a model without dropout."""

from __future__ import annotations

import pytest

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.graph import BlockKind
from vtrain_plugin.cost.lowering.dropout_masks import dropout_mask_delta, dropout_mask_delta_by_module
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan

H, HEADS, S, MB = 64, 4, 32, 2


def _blocks(family: str = "gpt", recompute: str = "none", tp: int = 1):
    model = ModelSpec(family=family, num_layers=2, hidden_size=H, num_attention_heads=HEADS, seq_length=S,
                      vocab_size=256, dtype="bf16")
    stage = trace(model, ParallelPlan(tensor_parallel=tp, micro_batch_size=MB, recompute=recompute)).stages[0]
    return {b.kind: b for b in stage.blocks if b.kind in (BlockKind.EMBEDDING, BlockKind.LAYER)}


@pytest.mark.parametrize("tp", [1, 2])
def test_each_bf16_mask_keeps_one_byte_per_element(tp):
    blocks = _blocks(tp=tp)
    scores = MB * HEADS // tp * S * S  # the attention-probability mask of one layer
    hidden = S * MB * H  # each of the two bias-dropout-add masks (no sequence parallelism)
    assert dropout_mask_delta_by_module(blocks[BlockKind.LAYER]) == {
        "decoder.layers.0.self_attention.core_attention.attention_dropout": -scores,
        "decoder.layers.0": -2 * hidden}
    assert dropout_mask_delta(blocks[BlockKind.LAYER]) == -(scores + 2 * hidden)
    assert dropout_mask_delta(blocks[BlockKind.EMBEDDING]) == -S * MB * H


def test_recomputed_masks_are_not_kept():
    """Selective recompute rebuilds the attention's mask in backward (its forward keeps none); full
    recompute keeps only each layer's input."""
    assert dropout_mask_delta(_blocks(recompute="selective")[BlockKind.LAYER]) == -2 * S * MB * H
    assert dropout_mask_delta(_blocks(recompute="full")[BlockKind.LAYER]) == 0


def test_no_dropout_no_masks():
    assert all(dropout_mask_delta(b) == 0 for b in _blocks("llama").values())
