"""The model family of compute-optimal sizing, Chinchilla tokens and the fixed-MFU answer (exact)."""

import pytest

from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.planning.model_family import (
    HIDDEN_STEP, MHA, chinchilla_tokens, family_shape, family_shapes, naive_size, training_flops)
from vtrain_plugin.specs.model import Family, ModelSpec


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_shapes_follow_the_rule_and_grow_in_parameters(family):
    shapes = family_shapes(family, min_params=1e8, max_params=1e12)
    assert [m.hidden_size for m in shapes] == [HIDDEN_STEP * k for k in range(1, len(shapes) + 1)]
    assert len(shapes) == {"gpt": 21, "llama": 22}[family]  # Llama's 8 query groups: fewer parameters per layer
    for m in shapes:
        assert m.family is Family(family) and m.head_dim == 128
        assert m.num_attention_heads == m.num_layers == m.hidden_size // 128
        assert m.num_attention_heads % 8 == 0  # TP and PP up to 8 divide every shape
    counts = [m.num_parameters for m in shapes]
    assert counts == sorted(set(counts))
    assert 1e8 <= counts[0] and counts[-1] <= 1e12
    assert family_shape(family, (len(shapes) + 1) * HIDDEN_STEP).num_parameters > 1e12


def test_the_ladder_reproduces_gpt3_175b_and_llama2_7b():
    gpt3 = family_shapes("gpt", min_params=1.7e11, max_params=1.8e11)
    assert [(m.num_layers, m.hidden_size, m.num_attention_heads) for m in gpt3] == [(96, 12288, 96)]
    assert (gpt3[0].vocab_size, gpt3[0].seq_length, gpt3[0].ffn_size, gpt3[0].tied) == (51200, 2048, 49152, True)
    reference = ModelSpec(num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048,
                          vocab_size=51200)
    assert gpt3[0].num_parameters == reference.num_parameters == 174_615_846_912
    llama = family_shape("llama", 4096, vocab_size=32000, seq_length=4096, num_query_groups=MHA)
    assert (llama.num_layers, llama.num_attention_heads, llama.ffn_size) == (32, 32, 11008)
    assert (llama.vocab_size, llama.seq_length, llama.dtype, llama.tied) == (32000, 4096, Dtype.BF16, False)
    assert llama.num_parameters == 6_738_415_616  # Llama 2 7B
    today = family_shape("llama", 4096)  # the default ladder: Llama 3's vocabulary, sequence and 8 KV groups
    assert (today.vocab_size, today.seq_length, today.num_query_groups, today.num_experts) == (128256, 8192, 8, None)
    # K and V of 8 groups rather than 32 heads (2 x 4096 x 3072 fewer per layer), two untied 128256-row tables
    assert today.num_parameters == 6_738_415_616 - 32 * 2 * 4096 * 3072 + 2 * (128256 - 32000) * 4096
    assert family_shape("llama", 8192).ffn_size == 22016  # 8 * 8192 / 3 = 21845.3, up to 256: Llama 65B's


def test_bounds_select_the_shapes_in_between():
    all_gpt = family_shapes("gpt", min_params=1, max_params=1e12)
    counts = [m.num_parameters for m in all_gpt]
    some = family_shapes("gpt", min_params=counts[2], max_params=counts[5])
    assert [m.num_parameters for m in some] == counts[2:6]
    assert family_shapes("gpt", min_params=counts[2] + 1, max_params=counts[3] - 1) == []


def test_a_finer_ladder_and_family_parameters():
    fine = family_shapes("gpt", min_params=1e9, max_params=3e9, hidden_step=128, vocab_size=32000, seq_length=1024,
                         dtype="bf16")
    assert [m.hidden_size for m in fine] == list(range(2176, 3072 + 1, 128))
    assert all(m.head_dim == 128 and m.num_layers == m.hidden_size // 128 for m in fine)
    assert {(m.vocab_size, m.seq_length, m.dtype) for m in fine} == {(32000, 1024, Dtype.BF16)}
    assert fine[0].name == "gpt-h2176-l17"


@pytest.mark.parametrize("call,message", [
    (lambda: family_shapes("gpt", min_params=2e9, max_params=1e9),
     "min_params (2e+09) must not exceed max_params (1e+09)"),
    (lambda: family_shapes("gpt", min_params=0, max_params=1e9), "min_params must be positive, got 0"),
    (lambda: family_shapes("gpt", min_params=1, max_params=1e9, hidden_step=100),
     "hidden_step (100) must be a multiple of 128"),
    (lambda: family_shapes("bert", min_params=1, max_params=1e9), "family must be one of gpt, llama; got 'bert'"),
    (lambda: family_shape("gpt", 1000), "hidden_size (1000) must be a multiple of 128: head dim 128, "
                                         "128 hidden per layer"),
    (lambda: family_shape("gpt", 1024, vocab_size=0), "model.vocab_size must be positive, got 0"),
    (lambda: chinchilla_tokens(-1.0), "params must be positive, got -1.0"),
    (lambda: chinchilla_tokens(1e9, 0), "tokens_per_parameter must be positive, got 0"),
])
def test_bad_input_names_the_field_and_rule(call, message):
    with pytest.raises(ConfigError) as exc:
        call()
    assert str(exc.value) == message


def test_chinchilla_tokens_and_6nd():
    assert chinchilla_tokens(70e9) == 1.4e12  # Chinchilla: 70B parameters, 1.4T tokens
    assert chinchilla_tokens(1e9, tokens_per_parameter=100) == 1e11
    assert training_flops(175e9, 300e9) == 6 * 175e9 * 300e9 == 3.15e23


def test_naive_size_is_the_largest_shape_within_the_budget():
    # 1,024 A100 (312 TFLOP/s fp16) for 30 days at 50% MFU
    answer = naive_size("gpt", peak_tflop_per_s=312.0, gpus=1024, days=30)
    assert answer.budget_flops == 1024 * 312 * 10**12 * 30 * 86400 // 2 == 4.14056448e23
    assert (answer.model.hidden_size, answer.model.num_layers) == (8192, 64)
    n = answer.num_parameters
    assert n == 51_982_647_296 and answer.tokens == 20 * n
    assert answer.flops == training_flops(n, 20 * n) <= answer.budget_flops
    bigger = family_shape("gpt", 8192 + HIDDEN_STEP)
    assert training_flops(bigger.num_parameters, 20 * bigger.num_parameters) > answer.budget_flops


def test_naive_size_switches_shape_at_the_budget_and_scales_with_mfu():
    shape = family_shape("llama", 4096)
    n = shape.num_parameters
    flops = training_flops(n, chinchilla_tokens(n))
    budget_days = flops / (1024 * 312e12 * 0.5 * 86400)
    just_enough = naive_size("llama", peak_tflop_per_s=312.0, gpus=1024, days=budget_days * (1 + 1e-9))
    just_short = naive_size("llama", peak_tflop_per_s=312.0, gpus=1024, days=budget_days * (1 - 1e-9))
    assert just_enough.model == shape and just_short.model == family_shape("llama", 3072)
    half = naive_size("llama", peak_tflop_per_s=312.0, gpus=1024, days=budget_days * 2 * (1 + 1e-9), mfu=0.25)
    assert half.model == shape


def test_naive_size_refuses_a_budget_below_the_smallest_shape():
    with pytest.raises(ConfigError) as exc:
        naive_size("gpt", peak_tflop_per_s=1.0, gpus=1, days=1)
    assert str(exc.value) == (
        "no gpt shape fits the budget: the smallest, gpt-h1024-l8 with 155,297,792 parameters, needs "
        "6 * N * D = 2.89e+18 FLOPs on 3.11e+09 tokens; gpus (1) * peak (1 TFLOP/s) * mfu (0.5) * days (1) "
        "= 4.32e+16 FLOPs")
    for mfu in (0, 1.5, True):
        with pytest.raises(ConfigError, match=r"mfu must be a fraction in \(0, 1\], got"):
            naive_size("gpt", peak_tflop_per_s=312.0, gpus=8, days=1, mfu=mfu)
    with pytest.raises(ConfigError, match="gpus must be a positive integer, got 8.5"):
        naive_size("gpt", peak_tflop_per_s=312.0, gpus=8.5, days=1)


def test_presets_have_the_published_shapes_and_parameter_counts():
    from dataclasses import replace

    from vtrain_plugin.planning.model_family import MODEL_PRESETS, model_preset

    # Llama 2's parameter counts as Meta publishes them (the checkpoints' tensor sizes).
    assert model_preset("llama2-7b").num_parameters == 6_738_415_616
    assert model_preset("llama2-13b").num_parameters == 13_015_864_320
    llama70 = model_preset("llama2-70b")
    assert llama70.num_parameters == 68_976_648_192 and llama70.query_groups == 8
    assert replace(model_preset("gpt3-175b"), name="") == replace(family_shape("gpt", 12288), name="")
    assert [round(MODEL_PRESETS[f"gpt3-{size}"].num_parameters / 1e9, 1) for size in ("1.3b", "2.7b", "6.7b", "13b")] \
        == [1.3, 2.7, 6.7, 12.9]
    assert all(m.name == name for name, m in MODEL_PRESETS.items())
    with pytest.raises(ConfigError, match="unknown model preset 'gpt4'; valid presets are gpt3-1.3b, "):
        model_preset("gpt4")


def test_the_ladder_takes_query_groups_and_experts():
    moe = family_shape("llama", 2048, num_query_groups=4, num_experts=8, moe_router_topk=2)
    assert (moe.num_query_groups, moe.num_experts, moe.router_topk, moe.name) == (4, 8, 2, "llama-h2048-l16-e8k2")
    dense = family_shape("llama", 2048, num_query_groups=4)
    ffn = 3 * 2048 * 5632  # a SwiGLU FFN of 8 x 2048 / 3 up to 256; each expert has one, plus the router
    assert moe.num_parameters == dense.num_parameters + 16 * (7 * ffn + 8 * 2048)
    assert family_shape("gpt", 2048).num_query_groups is None  # GPT-3: multi-head attention
    with pytest.raises(ConfigError, match=r"num_query_groups \(8\) must divide the heads of every shape: hidden "
                                          r"size 1280 has 10 heads"):
        family_shape("llama", 1280)
    with pytest.raises(ConfigError, match="moe_router_topk needs num_experts"):
        family_shape("llama", 2048, moe_router_topk=2)
