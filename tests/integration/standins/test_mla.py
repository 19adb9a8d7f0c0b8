"""Multi-latent attention (DeepSeek-V3 style) from megatron-core's own MLASelfAttention on the fake
process group: the core attention stand-in (TEDotProductAttention's constructor) contracts queries and
keys over qk_head_dim + qk_pos_emb_head_dim and returns heads x v_head_dim; parameters follow the MLA
formula; the TE spec's duplicated down projections are kept under tensor parallelism."""

import math
from collections import Counter

import pytest
import torch

from tests.integration.standins.recording import BF16, CPU_FIELDS, record
from vtrain_plugin.core.graph import CollectiveKind as K
from vtrain_plugin.core.graph import Phase
from vtrain_plugin.specs.parallel import ParallelPlan

S, B, H, N, FFN = 32, 2, 64, 4, 128
Q_LORA, KV_LORA, QK, ROPE, V = 32, 16, 8, 4, 16  # every head dim different, so each shape names its tensor
DK = QK + ROPE  # query/key head dim
T = S * B  # tokens
ATTN = "layers.0.self_attention"


def mla_block(tp: int = 1, *, duplicated: bool = True):
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_adapters.stand_ins import mla_layer_spec

    config = MLATransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=N, ffn_hidden_size=FFN, q_lora_rank=Q_LORA,
        kv_lora_rank=KV_LORA, qk_head_dim=QK, qk_pos_emb_head_dim=ROPE, v_head_dim=V, rope_type="rope",
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
        **CPU_FIELDS)
    spec = mla_layer_spec(duplicated_down_projections=duplicated)
    return TransformerBlock(config, TransformerBlockSubmodules(layer_specs=[spec], layer_norm=None),
                            post_layer_norm=False)


def run(tp: int = 1, *, duplicated: bool = True):
    return record(lambda: mla_block(tp, duplicated=duplicated),
                  lambda: (torch.zeros(S // tp, B, H, dtype=BF16, requires_grad=True),
                           torch.ones(1, 1, S, S, dtype=torch.bool)),
                  plan=ParallelPlan(tensor_parallel=tp, sequence_parallel=tp > 1))


@pytest.fixture(scope="module")
def tp1():
    return run()


def test_parameters_follow_the_mla_formula(tp1):
    assert tp1.parameters == {
        "layers.0.input_layernorm.weight": (H,),
        f"{ATTN}.linear_q_down_proj.weight": (Q_LORA, H),
        f"{ATTN}.q_layernorm.weight": (Q_LORA,),
        f"{ATTN}.linear_q_up_proj.weight": (N * DK, Q_LORA),
        f"{ATTN}.linear_kv_down_proj.weight": (KV_LORA + ROPE, H),
        f"{ATTN}.kv_layernorm.weight": (KV_LORA,),
        f"{ATTN}.linear_kv_up_proj.weight": (N * (QK + V), KV_LORA),
        f"{ATTN}.linear_proj.weight": (H, N * V),
        "layers.0.pre_mlp_layernorm.weight": (H,),
        "layers.0.mlp.linear_fc1.weight": (2 * FFN, H),
        "layers.0.mlp.linear_fc2.weight": (H, FFN),
    }
    attention = (H * Q_LORA + Q_LORA + Q_LORA * N * DK  # q down, q norm, q up
                 + H * (KV_LORA + ROPE) + KV_LORA + KV_LORA * N * (QK + V)  # kv down (+ shared rope key), norm, up
                 + N * V * H)  # output projection
    assert tp1.numel(ATTN) == attention == 10_544
    assert tp1.numel() == attention + 2 * H + 3 * H * FFN


def test_core_attention_contracts_over_the_qk_head_dim_and_returns_the_v_head_dim(tp1):
    core = f"{ATTN}.core_attention"
    bn = B * N
    assert tp1.count(Phase.FORWARD, "aten.baddbmm.default", core) == Counter({((bn, S, S), (bn, S, DK), (bn, DK, S)): 1})
    assert tp1.count(Phase.FORWARD, "aten.bmm.default", core) == Counter({((bn, S, S), (bn, S, V)): 1})
    # backward: the context bmm's two gradients (over V), the scores' two (over DK)
    assert tp1.count(Phase.BACKWARD, "aten.bmm.default", core) == Counter({
        ((bn, S, V), (bn, V, S)): 1, ((bn, S, S), (bn, S, V)): 1,
        ((bn, S, S), (bn, S, DK)): 1, ((bn, DK, S), (bn, S, S)): 1})
    baddbmm = next(r for r in tp1.ops(Phase.FORWARD, core) if r.key.op == "aten.baddbmm.default")
    assert dict(baddbmm.key.args)["alpha"] == pytest.approx(1 / math.sqrt(DK))  # MLA's softmax scale
    # the local spec's unfused attention, op for op
    assert Counter(r.key.op for r in tp1.ops(Phase.FORWARD, core)) == Counter({
        "aten.baddbmm.default": 1, "aten._to_copy.default": 2, "aten.masked_fill_.Scalar": 1,
        "aten._softmax.default": 1, "aten.bmm.default": 1, "aten.clone.default": 1})
    assert Counter(r.key.op for r in tp1.ops(Phase.BACKWARD, core)) == Counter({
        "aten.bmm.default": 4, "aten.mul.Scalar": 2, "aten._to_copy.default": 2,
        "aten._softmax_backward_data.default": 1, "aten.masked_fill.Scalar": 1})


def test_projection_gemms_are_the_latent_down_and_up_projections(tp1):
    assert tp1.count(Phase.FORWARD, "aten.mm.default", ATTN) == Counter({
        ((T, H), (H, Q_LORA)): 1, ((T, H), (H, KV_LORA + ROPE)): 1,  # down projections
        ((T, Q_LORA), (Q_LORA, N * DK)): 1, ((T, KV_LORA), (KV_LORA, N * (QK + V))): 1,  # up projections
        ((T, N * V), (N * V, H)): 1})  # output projection
    backward = tp1.count(Phase.BACKWARD, "aten.mm.default", ATTN)
    assert sum(backward.values()) == 10  # data and weight gradient of each of the five
    assert backward[((T, N * DK), (N * DK, Q_LORA))] == 1 and backward[((N * DK, T), (T, Q_LORA))] == 1


def test_one_layer_records_forward_and_backward(tp1):
    layer = "layers.0"
    assert len(tp1.ops(Phase.FORWARD, layer)) == 84
    assert len(tp1.ops(Phase.BACKWARD, layer)) == 117
    assert not tp1.collectives()


def test_tensor_parallel_keeps_te_duplicated_down_projections():
    tp = 2
    dup, col = run(tp), run(tp, duplicated=False)
    # duplicated (TE spec): whole down projections on every rank; column parallel (local spec): split
    assert dup.parameters[f"{ATTN}.linear_q_down_proj.weight"] == (Q_LORA, H)
    assert dup.parameters[f"{ATTN}.linear_kv_down_proj.weight"] == (KV_LORA + ROPE, H)
    assert col.parameters[f"{ATTN}.linear_q_down_proj.weight"] == (Q_LORA // tp, H)
    assert col.parameters[f"{ATTN}.linear_kv_down_proj.weight"] == (((KV_LORA + ROPE) // tp), H)
    assert dup.parameters[f"{ATTN}.linear_q_up_proj.weight"] == (N * DK // tp, Q_LORA)

    def attention_collectives(recorded):
        return Counter((c.phase, c.kind, c.nbytes, c.module.removeprefix(ATTN)) for c in recorded.collectives()
                       if c.module.startswith(ATTN))

    full, bf16 = T * H * 2, 2
    rope_key = T * ROPE * bf16  # the shared rope key, gathered from the sequence-parallel shards
    assert attention_collectives(dup) == Counter({
        (Phase.FORWARD, K.ALL_GATHER, rope_key, ""): 1,
        (Phase.FORWARD, K.ALL_GATHER, T * Q_LORA * bf16, ".linear_q_up_proj"): 1,
        (Phase.FORWARD, K.ALL_GATHER, T * KV_LORA * bf16, ".linear_kv_up_proj"): 1,
        (Phase.FORWARD, K.REDUCE_SCATTER, full, ".linear_proj"): 1,
        (Phase.BACKWARD, K.ALL_GATHER, full, ".linear_proj"): 1,
        (Phase.BACKWARD, K.ALL_GATHER, T * Q_LORA * bf16, ".linear_q_up_proj"): 1,
        (Phase.BACKWARD, K.REDUCE_SCATTER, T * Q_LORA * bf16, ".linear_q_up_proj"): 1,
        (Phase.BACKWARD, K.ALL_GATHER, T * KV_LORA * bf16, ".linear_kv_up_proj"): 1,
        (Phase.BACKWARD, K.REDUCE_SCATTER, T * KV_LORA * bf16, ".linear_kv_up_proj"): 1,
        (Phase.BACKWARD, K.REDUCE_SCATTER, rope_key, ""): 1,
    })
    # the local spec's column-parallel down projections gather the hidden states twice more
    extra = attention_collectives(col) - attention_collectives(dup)
    assert extra[(Phase.FORWARD, K.ALL_GATHER, full, ".linear_q_down_proj")] == 1
    assert extra[(Phase.FORWARD, K.ALL_GATHER, full, ".linear_kv_down_proj")] == 1


def test_a_gpt_model_of_mla_layers_recomputes_the_core_attention_and_up_projections():
    """DeepSeek-V3's settings on a GPTModel: YaRN, RoPE inside MLA, selective recompute of the core
    attention and of MLA's up projections (``--recompute-modules core_attn mla_up_proj``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_adapters.norms import SequenceParallelNorm
    from megatron_adapters.stand_ins import mla_layer_spec

    def build():
        config = MLATransformerConfig(
            num_layers=2, hidden_size=H, num_attention_heads=N, ffn_hidden_size=FFN, q_lora_rank=Q_LORA,
            kv_lora_rank=KV_LORA, qk_head_dim=QK, qk_pos_emb_head_dim=ROPE, v_head_dim=V, rope_type="yarn",
            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, gated_linear_unit=True,
            activation_func=torch.nn.functional.silu, recompute_granularity="selective",
            recompute_modules=["core_attn", "mla_up_proj"], **CPU_FIELDS)
        block = TransformerBlockSubmodules(layer_specs=[mla_layer_spec()] * 2, layer_norm=SequenceParallelNorm)
        return GPTModel(config, block, vocab_size=256, max_sequence_length=S, position_embedding_type="rope")

    def inputs():
        tokens = torch.zeros(B, S, dtype=torch.long)
        return tokens, torch.arange(S).unsqueeze(0).expand(B, S), torch.ones(1, 1, S, S, dtype=torch.bool), tokens

    recorded = record(build, inputs, call=lambda model, a: model(a[0], a[1], a[2], labels=a[3]))
    bn = B * N
    for layer in (0, 1):
        attention = f"decoder.layers.{layer}.self_attention"
        assert recorded.count(Phase.RECOMPUTE, "aten.baddbmm.default", attention) == Counter({
            ((bn, S, S), (bn, S, DK), (bn, DK, S)): 1})
        assert recorded.count(Phase.RECOMPUTE, "aten.mm.default", attention) == Counter({
            ((T, Q_LORA), (Q_LORA, N * DK)): 1, ((T, KV_LORA), (KV_LORA, N * (QK + V))): 1})
        assert recorded.count(Phase.FORWARD, "aten.baddbmm.default", attention) == Counter({
            ((bn, S, S), (bn, S, DK), (bn, DK, S)): 1})
