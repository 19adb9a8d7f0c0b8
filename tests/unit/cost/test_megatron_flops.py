"""vtrain's model FLOPs against Megatron-LM's own ``num_floating_point_operations`` (the reference
function, called on the Megatron-LM arguments that describe the same model), for every architecture
a ModelSpec describes. The reference computes in floats, vtrain in integers: they agree to the
float's rounding (1e-12)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.megatron_reference import (
    megatron_args,
    num_floating_point_operations,
)
from vtrain_plugin.cost.megatron_flops import megatron_model_flops
from vtrain_plugin.specs.model import ModelSpec

ROUNDING = 1e-12

GPT = ModelSpec(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=50257)
GPT_ARGS = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128)
LLAMA = ModelSpec(family="llama", num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                  seq_length=256, vocab_size=1000)
LLAMA_ARGS = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256, swiglu=True,
                  group_query_attention=True, num_query_groups=2, ffn_hidden_size=768, padded_vocab_size=1024,
                  normalization="RMSNorm", add_bias_linear=False, untie_embeddings_and_output_weights=True)
# DeepSeek-V3 (arXiv 2412.19437, its config.json): MLA, 3 dense layers then 58 MoE layers of 256
# experts, 8 routed and one shared, one MTP layer
DEEPSEEK_V3 = ModelSpec(family="llama", num_layers=61, hidden_size=7168, num_attention_heads=128, seq_length=4096,
                        vocab_size=129280, ffn_hidden_size=18432, multi_latent_attention=True, q_lora_rank=1536,
                        kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, num_experts=256,
                        moe_router_topk=8, moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
                        moe_layer_freq=(0,) * 3 + (1,) * 58, mtp_num_layers=1)
DEEPSEEK_V3_ARGS = dict(num_layers=61, hidden_size=7168, num_attention_heads=128, seq_length=4096,
                        padded_vocab_size=129280, ffn_hidden_size=18432, swiglu=True,
                        multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
                        qk_pos_emb_head_dim=64, v_head_dim=128, num_experts=256, moe_router_topk=8,
                        moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
                        moe_layer_freq=[0] * 3 + [1] * 58, mtp_num_layers=1, kv_channels=128)


def assert_megatron_count(model: ModelSpec, args: dict, *, sequences: int, tensor_parallel: int = 1):
    reference = num_floating_point_operations(megatron_args(**args), sequences)
    assert megatron_model_flops(model, sequences=sequences, tensor_parallel=tensor_parallel) == pytest.approx(
        reference, rel=ROUNDING)


def test_dense_gpt_with_the_vocabulary_padded_for_tensor_parallelism():
    # 50257 padded to a multiple of 128 x 2 = 256
    assert_megatron_count(GPT, {**GPT_ARGS, "padded_vocab_size": 50432}, sequences=16, tensor_parallel=2)


def test_the_count_is_megatrons_closed_form_for_a_dense_gpt():
    # Narayanan et al. SC'21, eq. 3 before the causal halving Megatron-LM applies now:
    # 72 B s l h^2 (1 + s / 6h + V / 12 l h), with the core attention halved: 72 B s l h^2 (1 + s / 12 h) + 6 B s h V
    b, s, layers, h, vocab = 16, 128, 4, 256, 50432
    closed_form = 72 * b * s * layers * h * h * (1 + s / (12 * h)) + 6 * b * s * h * vocab
    assert megatron_model_flops(GPT, sequences=b, tensor_parallel=2) == pytest.approx(closed_form, rel=ROUNDING)


def test_llama_grouped_query_attention_and_swiglu():
    assert_megatron_count(LLAMA, LLAMA_ARGS, sequences=8)


def test_kv_channels_other_than_hidden_over_heads():
    model = ModelSpec(family="llama", num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=4,
                      kv_channels=64, seq_length=128, vocab_size=1000)
    assert model.head_dim == 64
    assert_megatron_count(model, {**LLAMA_ARGS, "num_layers": 2, "seq_length": 128, "num_query_groups": 4,
                                  "kv_channels": 64}, sequences=4)


@pytest.mark.parametrize("activation", ["gelu", "squared_relu"])
def test_ungated_activations_count_two_mlp_gemms(activation):
    model = ModelSpec(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1024,
                      ffn_hidden_size=1024, activation=activation)
    assert_megatron_count(model, {**GPT_ARGS, "num_layers": 2, "padded_vocab_size": 1024}, sequences=4)


@pytest.mark.parametrize("freq", [1, 2, (0, 1, 1, 1)])
def test_moe_with_shared_experts_and_a_layer_frequency(freq):
    model = ModelSpec(family="llama", num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                      seq_length=256, vocab_size=1000, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128,
                      moe_shared_expert_intermediate_size=384, moe_layer_freq=freq)
    args = {**LLAMA_ARGS, "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 128,
            "moe_shared_expert_intermediate_size": 384, "moe_layer_freq": list(freq) if isinstance(freq, tuple) else freq}
    assert_megatron_count(model, args, sequences=8)


def test_shared_experts_add_their_mlp_gemms():
    routed = ModelSpec(family="llama", num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256,
                       num_experts=8, moe_ffn_hidden_size=128)
    shared = ModelSpec(**{**routed.to_dict(), "moe_shared_expert_intermediate_size": 128})
    # one shared expert of the routed experts' size: topk (2) + 1 expert MLPs per MoE layer per token
    extra = 6 * 8 * 256 * 256 * 128 * 3 * 4
    assert megatron_model_flops(shared, sequences=8) - megatron_model_flops(routed, sequences=8) == extra


def test_deepseek_v3_multi_latent_attention_moe_and_mtp():
    assert DEEPSEEK_V3_ARGS["padded_vocab_size"] == 129280  # already a multiple of 128
    assert_megatron_count(DEEPSEEK_V3, DEEPSEEK_V3_ARGS, sequences=4)


def test_mla_without_a_query_rank():
    model = ModelSpec(family="llama", num_layers=2, hidden_size=512, num_attention_heads=8, seq_length=128,
                      vocab_size=1024, multi_latent_attention=True, kv_lora_rank=64, qk_head_dim=32,
                      qk_pos_emb_head_dim=16, v_head_dim=48)
    args = {**LLAMA_ARGS, "num_layers": 2, "hidden_size": 512, "seq_length": 128, "group_query_attention": False,
            "ffn_hidden_size": model.ffn_size, "multi_latent_attention": True, "kv_lora_rank": 64,
            "qk_head_dim": 32, "qk_pos_emb_head_dim": 16, "v_head_dim": 48}
    assert_megatron_count(model, args, sequences=2)


@pytest.mark.parametrize("last_layer_moe", [False, True])
def test_mtp_layers_are_of_the_last_layers_kind(last_layer_moe):
    freq = (1, 1, 1, 1) if last_layer_moe else (1, 1, 1, 0)
    model = ModelSpec(family="llama", num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256,
                      vocab_size=1000, num_experts=4, moe_ffn_hidden_size=128, moe_layer_freq=freq, mtp_num_layers=2)
    args = {**LLAMA_ARGS, "group_query_attention": False, "num_experts": 4, "moe_ffn_hidden_size": 128,
            "moe_layer_freq": list(freq), "mtp_num_layers": 2}
    assert_megatron_count(model, args, sequences=8)


def test_mtp_adds_work():
    plain = ModelSpec(**{**LLAMA.to_dict(), "mtp_num_layers": None})
    with_mtp = ModelSpec(**{**LLAMA.to_dict(), "mtp_num_layers": 1})
    assert megatron_model_flops(with_mtp, sequences=8) > megatron_model_flops(plain, sequences=8)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_mamba_hybrid(family):
    pattern = "M*-M-M*-"
    model = ModelSpec(family=family, num_layers=len(pattern), hidden_size=256, num_attention_heads=8,
                      num_query_groups=2 if family == "llama" else None, seq_length=256, vocab_size=1000,
                      hybrid_layer_pattern=pattern, mamba_state_dim=64, mamba_head_dim=32, mamba_num_groups=2)
    args = {**(LLAMA_ARGS if family == "llama" else {**GPT_ARGS, "padded_vocab_size": 1024}),
            "num_layers": len(pattern), "seq_length": 256, "hybrid_layer_pattern": pattern, "mamba_state_dim": 64,
            "mamba_head_dim": 32, "mamba_num_groups": 2}
    assert_megatron_count(model, args, sequences=8)


@pytest.mark.parametrize("shared", [None, 128])
def test_mamba_hybrid_with_moe_layers(shared):
    pattern = "M*EM-E"
    model = ModelSpec(family="llama", num_layers=6, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                      seq_length=256, vocab_size=1000, hybrid_layer_pattern=pattern, num_experts=8, moe_router_topk=2,
                      moe_ffn_hidden_size=96, moe_shared_expert_intermediate_size=shared)
    args = {**LLAMA_ARGS, "num_layers": 6, "seq_length": 256, "hybrid_layer_pattern": pattern, "num_experts": 8,
            "moe_router_topk": 2, "moe_ffn_hidden_size": 96, "moe_shared_expert_intermediate_size": shared}
    assert_megatron_count(model, args, sequences=8)


def test_mamba_hybrid_with_its_own_heads_and_kv_channels():
    pattern = "M*M-"
    model = ModelSpec(family="llama", num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                      kv_channels=64, seq_length=128, vocab_size=1000, hybrid_layer_pattern=pattern,
                      mamba_num_heads=16, mamba_head_dim=64, mamba_num_groups=4)
    args = {**LLAMA_ARGS, "seq_length": 128, "kv_channels": 64, "hybrid_layer_pattern": pattern,
            "mamba_num_heads": 16, "mamba_head_dim": 64, "mamba_num_groups": 4}
    assert_megatron_count(model, args, sequences=4)


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 6), heads=st.sampled_from([4, 8, 16]), head_dim=st.sampled_from([16, 32, 64]),
       groups_divisor=st.sampled_from([1, 2, 4]), ffn=st.integers(1, 64), gated=st.booleans(),
       seq=st.sampled_from([64, 128, 512]), vocab=st.integers(100, 70000), tp=st.sampled_from([1, 2, 8]),
       sequences=st.integers(1, 64), experts=st.sampled_from([None, 4, 16]), topk=st.integers(1, 4),
       freq=st.integers(1, 3), shared=st.sampled_from([None, 64, 256]), mtp=st.sampled_from([None, 1, 2]))
def test_random_dense_and_moe_shapes(layers, heads, head_dim, groups_divisor, ffn, gated, seq, vocab, tp, sequences,
                                     experts, topk, freq, shared, mtp):
    hidden = heads * head_dim
    groups = heads // groups_divisor
    moe = experts is not None
    model = ModelSpec(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
                      ffn_hidden_size=32 * ffn, gated_linear_unit=gated, seq_length=seq, vocab_size=vocab,
                      num_experts=experts, moe_router_topk=topk if moe else None,
                      moe_ffn_hidden_size=16 * ffn if moe else None, moe_layer_freq=freq if moe else 1,
                      moe_shared_expert_intermediate_size=shared if moe else None, mtp_num_layers=mtp)
    args = dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq,
                group_query_attention=True, num_query_groups=groups, ffn_hidden_size=32 * ffn, swiglu=gated,
                padded_vocab_size=model.padded_vocab_size(tp), num_experts=experts, moe_router_topk=topk,
                moe_ffn_hidden_size=16 * ffn if moe else None, moe_layer_freq=freq,
                moe_shared_expert_intermediate_size=shared if moe else None, mtp_num_layers=mtp)
    assert_megatron_count(model, args, sequences=sequences, tensor_parallel=tp)
