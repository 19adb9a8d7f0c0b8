"""One layer's activations on the Megatron-Core + TransformerEngine stack against Megatron-LM's own
accounting (``megatron/training/theoretical_memory_usage.py``: ``s b h (18 + 4 ffn / h) / t`` bytes
per layer with flash attention and sequence parallelism, after Korthikanti et al. 2022), each
difference named and asserted exactly, on a small real Llama layer and GPT layer (TP 2, SP)."""

from __future__ import annotations

import pytest

from vtrain_plugin.core.graph import BlockKind
from vtrain_plugin.core.units import GIB
from vtrain_plugin.cost.lowering.dropout_masks import dropout_mask_delta
from vtrain_plugin.cost.lowering.megatron_core_te import fused_attention_saved_delta
from vtrain_plugin.cost.memory import all_held
from vtrain_plugin.cost.stack_memory import stack_rank_memory
from vtrain_plugin.cost.lowering.te_saved import te_saved_delta
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import SoftwareStack, TrainingSpec

H, HEADS, GROUPS, S, MB, TP = 64, 4, 2, 32, 2, 2
SBH = S * MB * H
D = H // HEADS
FFN = {"llama": 256, "gpt": 4 * H}  # Llama: 8h/3 rounded up to 256


def _layer(family: str, recompute: str = "none"):
    from vtrain_plugin.capture.tracer import trace

    model = ModelSpec(family=family, num_layers=2, hidden_size=H, num_attention_heads=HEADS, seq_length=S,
                      vocab_size=256, dtype="bf16", num_query_groups=GROUPS if family == "llama" else None)
    graph = trace(model, ParallelPlan(tensor_parallel=TP, micro_batch_size=MB, sequence_parallel=True,
                                      recompute=recompute))
    return graph, graph.stages[0].layer_template()


def _te_layer_nbytes(layer, *, fp8: bool = False) -> int:
    return (layer.activation_nbytes + dropout_mask_delta(layer) + fused_attention_saved_delta(layer.nodes)
            + te_saved_delta(layer, fp8=fp8))


def megatron_layer_nbytes(ffn: int) -> float:
    """Megatron-LM's ``compute_activation_memory`` for one layer on one TP rank."""
    return SBH * (18 + 4 * ffn / H) / TP


def llama_layer_nbytes(s: int, b: int, h: int, heads: int, groups: int, ffn: int, t: int, *, fp8: bool = False) -> float:
    """One Llama layer on TE: Megatron-LM's formula and the named differences (sequence parallel)."""
    sbh, rows = s * b * h, s * b // t
    megatron = sbh * (18 + 4 * ffn / h) / t
    no_dropout_masks = -2 * sbh / t  # the formula's two 1-byte masks; Llama layers run without dropout
    gqa = -4 * sbh * (1 - groups / heads) / t  # keys and values at groups of heads heads
    swiglu = 2 * ffn * s * b / t  # the FC1 output is 2 ffn wide, the FC2 input ffn
    softmax_statistics = 4 * b * (heads // t) * s  # fp32 per query row and head (fused attention)
    norm_statistics = 2 * 4 * rows  # fp32 rstd of each RMSNorm row
    rope = 4 * s * (h // heads) * 2  # cos and sin of the query and key rotations, as traced
    # FP8: QKV, FC1 and FC2 inputs in one byte instead of two; the projection's FP8 input on top
    in_fp8 = (-(2 * sbh + ffn * s * b) + sbh) / t if fp8 else 0
    return megatron + no_dropout_masks + gqa + swiglu + softmax_statistics + norm_statistics + rope + in_fp8


def test_a_llama_layer_is_megatrons_formula_with_its_named_differences():
    _, layer = _layer("llama")
    assert _te_layer_nbytes(layer) == llama_layer_nbytes(S, MB, H, HEADS, GROUPS, FFN["llama"], TP)
    assert megatron_layer_nbytes(FFN["llama"]) == SBH * (18 + 4 * FFN["llama"] / H) / TP


def test_fp8_linears_keep_their_inputs_in_one_byte():
    _, layer = _layer("llama")
    qkv_fc1, fc2, proj = 2 * SBH // TP, FFN["llama"] * S * MB // TP, SBH // TP  # elements of their inputs
    assert _te_layer_nbytes(layer, fp8=True) - _te_layer_nbytes(layer) == -qkv_fc1 - fc2 + proj
    assert _te_layer_nbytes(layer, fp8=True) == llama_layer_nbytes(S, MB, H, HEADS, GROUPS, FFN["llama"], TP, fp8=True)
    # selective recompute: the attention is rebuilt in backward, its output kept by the projection alone
    _, selective = _layer("llama", recompute="selective")
    assert _te_layer_nbytes(selective, fp8=True) - _te_layer_nbytes(selective) == -qkv_fc1 - fc2 - proj


def test_a_gpt_layer_is_megatrons_formula_with_its_named_differences():
    _, layer = _layer("gpt")
    rows = S * MB // TP
    softmax_statistics = 4 * MB * (HEADS // TP) * S
    norm_statistics = 2 * 2 * 4 * rows  # fp32 mean and rstd of each LayerNorm row
    assert _te_layer_nbytes(layer) == megatron_layer_nbytes(FFN["gpt"]) + softmax_statistics + norm_statistics


def test_the_run_sets_gradient_and_fp8_weight_bytes():
    graph, layer = _layer("llama")
    params = sum(s.num_parameters for s in graph.stages)

    def memory(**training):
        spec = TrainingSpec(global_batch_size=MB, **training)
        (rank,) = stack_rank_memory(graph, all_held,
                                    SoftwareStack.MEGATRON_CORE_TE, spec)
        return rank

    bf16, reduced_in_bf16 = memory(), memory(grad_reduce_in_bf16=True)
    assert (bf16.gradients_gib * GIB, reduced_in_bf16.gradients_gib * GIB) == (4 * params, 2 * params)
    linear = sum(b.count * (H * (H + 2 * H * GROUPS // HEADS) + H * H + 2 * H * FFN["llama"] + FFN["llama"] * H) // TP
                 for b in graph.stages[0].blocks if b.kind is BlockKind.LAYER)
    fp8, fp8_params = memory(fp8="hybrid"), memory(fp8="hybrid", fp8_param_gather=True)
    assert bf16.weights_gib * GIB == 2 * params
    assert fp8.weights_gib * GIB == pytest.approx(2 * params + 2 * linear)  # FP8 copy and transpose besides
    assert fp8_params.weights_gib * GIB == pytest.approx(2 * (params - linear) + 2 * linear)  # FP8 data, transpose
    assert fp8_params.activations_gib == fp8.activations_gib < bf16.activations_gib


def test_llama3_8b_fp8_recipe_on_8_h100():
    """Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh (tests/fixtures/launch_scripts) as a
    plan: every term of its memory from its own rule."""
    from vtrain_plugin.estimate import estimate
    from vtrain_plugin.hardware.clusters import get_cluster_preset

    s, h, heads, groups, ffn, vocab, layers = 8192, 4096, 32, 8, 14336, 128256, 32
    model = ModelSpec(family="llama", num_layers=layers, hidden_size=h, num_attention_heads=heads,
                      num_query_groups=groups, ffn_hidden_size=ffn, seq_length=s, vocab_size=vocab,
                      tied_embeddings=False, dtype="bf16")
    training = TrainingSpec(global_batch_size=128, grad_reduce="overlap", fp8="hybrid", fp8_param_gather=True,
                            grad_reduce_in_bf16=True, cross_entropy_fusion=True, distributed_optimizer=True,
                            overlap_param_gather=True)
    from vtrain_plugin.capture.tracer import trace

    graph = trace(model, ParallelPlan(data_parallel=8, micro_batch_size=1))
    est = estimate(graph, cluster=get_cluster_preset("dgx-h100"), training=training)
    (memory,) = est.memory_gib
    linear = layers * (h * (h + 2 * h * groups // heads) + h * h + 3 * h * ffn)
    params = linear + 2 * vocab * h + layers * 2 * h + h
    assert memory.weights_gib * GIB == 2 * (params - linear) + 2 * linear  # FP8 weights: data and transpose
    assert memory.gradients_gib * GIB == 2 * params  # bf16 gradients
    assert memory.optimizer_gib * GIB == 12 * params / 8  # fp32 main weights and moments over DP 8
    head = 2 * s * h + 4 * s + 2 * s * h + 4 * s * vocab  # final norm input and rstd, output-layer input, fp32 softmax
    small = 8 * s + 4 * s + 4 + s + 8 * s  # tokens, loss mask and scalar, target mask, labels
    # beside them the step holds the fp32 per-token losses, two fp32 scalars and the rotary table
    # (s x head dim in fp32), and its backward peaks at the bf16 gradient of the logits; the fused
    # cross entropy's compiled forward holds a second fp32 copy of the logits
    step = 4 * s + 2 * 4 + 4 * s * (h // heads) + 2 * s * vocab + 4 * s * vocab
    assert memory.activations_gib * GIB == layers * llama_layer_nbytes(s, 1, h, heads, groups, ffn, 1, fp8=True) \
        + head + small + step
    assert memory.inflight_microbatches == 1
