"""Sliding-window attention (its mask built on the CPU by the stand-in, alternating with full layers
by window_attn_skip_freq) and learnable-softmax attention sinks, traced through megatron-core 0.16's
local spec."""

from collections import Counter

import pytest
import torch

from megatron_adapters.cpu_patches import cpu_tracing_patches
from megatron_adapters.stand_ins import sliding_window_causal_mask
from tests.integration.standins.recording import BF16, CPU_FIELDS, record
from vtrain_plugin.core.graph import Phase

S, B, H, N, FFN, WINDOW = 32, 2, 64, 4, 128, 8
D = H // N


def gpt_block(**fields):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_adapters.norms import SequenceParallelNorm

    config = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=N, ffn_hidden_size=FFN,
                               add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                               normalization="RMSNorm", **fields, **CPU_FIELDS)
    layer = get_gpt_layer_local_spec(normalization="RMSNorm")
    layer.submodules.input_layernorm = SequenceParallelNorm
    layer.submodules.pre_mlp_layernorm = SequenceParallelNorm
    return TransformerBlock(config, TransformerBlockSubmodules(layer_specs=[layer] * 2, layer_norm=None),
                            post_layer_norm=False)


def run(**fields):
    return record(lambda: gpt_block(**fields), lambda: (torch.zeros(S, B, H, dtype=BF16, requires_grad=True),
                                                        torch.ones(1, 1, S, S, dtype=torch.bool)))


def softmax_ops(recorded, phase, layer):
    return Counter((r.key.op, r.key.input_shapes) for r in recorded.ops(phase, f"layers.{layer}.self_attention.core_attention"))


@pytest.fixture(scope="module")
def windowed():
    # layer 1 (layer_number 1) windowed, layer 2 full: megatron's window_attn_skip_freq=2
    return run(window_size=(WINDOW, 0), window_attn_skip_freq=2)


def test_the_sliding_window_mask_keeps_the_window_and_the_past_only():
    mask = sliding_window_causal_mask(6, 6, (2, 0))  # True: masked
    allowed = [[j for j in range(6) if not mask[i, j]] for i in range(6)]
    assert allowed == [[0], [0, 1], [0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5]]
    assert mask.device.type == "cpu"


def test_a_windowed_layer_builds_its_mask_at_every_forward(windowed):
    ops = softmax_ops(windowed, Phase.FORWARD, 0)
    assert ops[("aten.ones.default", ())] == 1
    assert ops[("aten.triu.default", ((S, S),))] == 1
    assert ops[("aten.tril.default", ((S, S),))] == 1
    assert ops[("aten.bitwise_not.default", ((S, S),))] == 1
    assert ops[("aten.masked_fill_.Scalar", ((B, N, S, S), (S, S)))] == 1  # the window mask, not the one passed
    triu = next(r for r in windowed.ops(Phase.FORWARD, "layers.0.self_attention") if r.key.op == "aten.triu.default")
    assert dict(triu.key.args)["diagonal"] == -WINDOW
    assert softmax_ops(windowed, Phase.BACKWARD, 0)[("aten.masked_fill.Scalar", ((B, N, S, S), (S, S)))] == 1


def test_a_full_layer_between_windowed_ones_uses_the_causal_mask(windowed):
    ops = softmax_ops(windowed, Phase.FORWARD, 1)
    assert ops[("aten.masked_fill_.Scalar", ((B, N, S, S), (1, 1, S, S)))] == 1
    assert not any(op in ("aten.triu.default", "aten.tril.default") for op, _ in ops)


def test_the_local_spec_computes_every_score_with_or_without_a_window(windowed):
    """The unfused local attention computes all S x S scores and masks them; a fused kernel with a
    window skips the masked blocks (the lowering's business, not the trace's)."""
    for layer in (0, 1):
        ops = softmax_ops(windowed, Phase.FORWARD, layer)
        assert ops[("aten.baddbmm.default", ((B * N, S, S), (B * N, S, D), (B * N, D, S)))] == 1
        assert ops[("aten.bmm.default", ((B * N, S, S), (B * N, S, D)))] == 1


def test_the_stand_in_masks_are_scoped_to_tracing():
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    original = fused_softmax.get_sliding_window_causal_mask
    assert original is utils.get_sliding_window_causal_mask
    with cpu_tracing_patches():
        assert fused_softmax.get_sliding_window_causal_mask is sliding_window_causal_mask
    assert fused_softmax.get_sliding_window_causal_mask is original
    assert utils.get_sliding_window_causal_mask is original


@pytest.fixture(scope="module")
def sinks():
    return run(softmax_type="learnable")


def test_learnable_softmax_adds_one_sink_logit_per_head(sinks):
    plain = run()
    assert sinks.parameters["layers.0.self_attention.core_attention.softmax_offset"] == (N,)
    assert sinks.numel() == plain.numel() + 2 * N  # two layers
    forward = softmax_ops(sinks, Phase.FORWARD, 0)
    assert forward[("aten.cat.default", ((B, N, S, S), (B, N, S, 1)))] == 1  # the sink column
    assert forward[("aten._softmax.default", ((B, N, S, S + 1),))] == 1
    assert ("aten._softmax.default", ((B, N, S, S),)) not in forward
    backward = softmax_ops(sinks, Phase.BACKWARD, 0)
    assert backward[("aten._softmax_backward_data.default", ((B, N, S, S + 1), (B, N, S, S + 1)))] == 1
    assert backward[("aten.sum.dim_IntList", ((B, N, S, 1),))] == 1  # the sinks' gradient
    # the rest of the layer is unchanged
    assert len(sinks.ops(Phase.FORWARD, "layers.0")) == len(plain.ops(Phase.FORWARD, "layers.0")) + 1
