"""The arithmetic of the attention variants: which layers have a window, per stage; how many scores a
windowed kernel computes; MLA's parameters; the checks of the fields."""

import pytest
import torch

from megatron_adapters.stand_ins import sliding_window_causal_mask
from vtrain_plugin.capture.tracer import first_layer_numbers
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.cost.lowering.megatron_core_te import ATTENTION_CAUSAL_FRACTION, scored_pairs
from vtrain_plugin.specs.attention import mla_parameters, windowed_layers
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan


def spec(**fields) -> ModelSpec:
    return ModelSpec(**{"family": "llama", "num_layers": 12, "hidden_size": 64, "num_attention_heads": 4,
                        "seq_length": 32, **fields})


def test_layers_are_numbered_chunk_by_chunk_over_the_ranks():
    # PP 2 x VP 2, 3 layers per virtual stage: rank 0 holds 1-3 and 7-9, rank 1 holds 4-6 and 10-12
    assert first_layer_numbers(spec(), ParallelPlan(pipeline_parallel=2, virtual_pipeline=2)) == ((1, 7), (4, 10))
    # uneven: the first stage holds 2 layers, the other two 5 each
    assert first_layer_numbers(spec(), ParallelPlan(pipeline_parallel=3, decoder_first_pipeline_num_layers=2)) == \
        ((1,), (3,), (8,))


def test_windowed_layers_follow_megatron_cores_rule():
    model = spec(window_size=(8, 0), window_attn_skip_freq=3)  # layers 3, 6, 9, 12 full
    assert [windowed_layers(model, first, 3) for first in (1, 4, 7, 10)] == [2, 2, 2, 2]
    assert windowed_layers(model, 2, 2) == 1  # layers 2 and 3
    assert windowed_layers(spec(window_size=(8, 0)), 1, 12) == 12  # no skip frequency: every layer
    assert windowed_layers(spec(), 1, 12) == 0


@pytest.mark.parametrize("sq, sk, window", [(32, 32, 8), (32, 32, 0), (16, 32, 8), (16, 32, 20), (7, 7, 5)])
def test_a_window_scores_exactly_the_pairs_its_mask_keeps(sq, sk, window):
    kept = int((~sliding_window_causal_mask(sq, sk, (window, 0))).sum())
    assert scored_pairs(sq, sk, window) == kept


def test_a_window_as_wide_as_the_sequence_is_the_causal_kernel():
    assert scored_pairs(32, 32, 31) == scored_pairs(32, 32, None) == 32 * 32 * ATTENTION_CAUSAL_FRACTION
    assert scored_pairs(32, 32, 4096) == scored_pairs(32, 32)


def test_mla_parameters_without_query_compression():
    model = spec(multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=16)
    h, n = 64, 4
    assert mla_parameters(model) == h * n * 12 + h * (16 + 4) + 16 + 16 * n * (8 + 16) + n * 16 * h


@pytest.mark.parametrize("fields, message", [
    (dict(q_lora_rank=32), "model.q_lora_rank needs model.multi_latent_attention (MLA)"),
    (dict(multi_latent_attention=True, family="gpt"), "model.multi_latent_attention needs model.family llama (MLA's "
     "layers: RMSNorm, no linear biases, rotary positions inside the attention)"),
    (dict(window_size=(8, 2)), "model.window_size[1] (2) must be 0: a causal decoder attends to no later token "
     "(windows that look ahead are not modelled)"),
    (dict(window_size=(-1, 0)), "model.window_size[0] (-1) must be at least 0 (-1: no window, leave it unset)"),
    (dict(window_attn_skip_freq=2), "model.window_attn_skip_freq needs model.window_size (sliding-window attention)"),
    (dict(softmax_type="off-by-one"), "model.softmax_type='off-by-one': an off-by-one softmax is not modelled by "
     "vtrain yet"),
])
def test_bad_attention_fields_are_refused_in_one_line(fields, message):
    with pytest.raises(ConfigError) as err:
        spec(**fields)
    assert str(err.value) == message


def test_a_window_from_a_plan_file_is_a_tuple():
    assert spec(window_size=[8, 0]).window_size == (8, 0)
    assert spec(window_size=[8, 0]) == spec(window_size=(8, 0))
    assert torch.is_tensor(sliding_window_causal_mask(4, 4, (1, 0)))


def test_context_parallelism_with_mla_or_a_window_is_refused_by_name():
    plan = ParallelPlan(context_parallel=2)
    for fields, what in ((dict(window_size=(8, 0)), "sliding-window attention"),
                         (dict(multi_latent_attention=True), "multi-latent attention")):
        with pytest.raises(ConfigError) as err:
            plan.check_fits(spec(**fields))
        assert str(err.value) == (f"context_parallel_size (2) with {what}: context-parallel attention of that kind "
                                  f"is not modelled by vtrain yet")


@pytest.mark.parametrize("freq", [4, [0, 1] * 6, [1] + [0] * 11, 1])
def test_nope_layers_follow_megatron_cores_rule(freq):
    """vtrain's NoPE pattern is the list megatron-core's TransformerConfig makes of no_rope_freq."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from vtrain_plugin.specs.attention import nope_pattern

    config = TransformerConfig(num_layers=12, hidden_size=64, num_attention_heads=4, no_rope_freq=freq)
    assert [int(x) for x in nope_pattern(spec(no_rope_freq=freq))] == config.no_rope_freq


def test_nope_layers_have_one_spelling_and_are_counted_per_stage():
    from vtrain_plugin.specs.attention import nope_layers

    assert spec(no_rope_freq=[0, 0, 0, 1] * 3).no_rope_freq == 4  # megatron-core's list of the integer 4
    assert spec(no_rope_freq=[0] * 12).no_rope_freq is None
    assert spec(no_rope_freq=[1] + [0] * 11).no_rope_freq == (1,) + (0,) * 11
    assert [nope_layers(spec(no_rope_freq=4), first, 3) for first in (1, 4, 7, 10)] == [0, 1, 1, 1]  # 4 | 8 | 12
    assert nope_layers(spec(no_rope_freq=4), 1, 12) == 3


@pytest.mark.parametrize("fields, message", [
    (dict(no_rope_freq=5), "model.no_rope_freq (5) must divide model.num_layers (12) (megatron-core's rule)"),
    (dict(no_rope_freq=[0, 1]), "model.no_rope_freq: a per-layer pattern needs model.num_layers (12) entries, each "
                                "0 (RoPE) or 1 (NoPE); got 2"),
    (dict(no_rope_freq=0), "model.no_rope_freq must be a positive integer or a list of 0 / 1 per layer, got 0"),
    (dict(no_rope_freq=4, position_embedding_type="learned_absolute"),
     "model.no_rope_freq needs model.position_embedding_type rope (NoPE layers skip the rotary embedding)"),
    (dict(no_rope_freq=4, multi_latent_attention=True),
     "model.no_rope_freq with multi-latent attention: megatron-core's MLA applies its rotary embedding on every "
     "layer (only SelfAttention reads no_rope_freq)"),
    (dict(no_rope_freq=4, mtp_num_layers=1),
     "model.no_rope_freq with model.mtp_num_layers: megatron-core 0.16 looks an MTP layer's number up in "
     "no_rope_freq, past its num_layers entries"),
    (dict(no_rope_freq=4, num_experts=4, moe_layer_freq=2),
     "model.no_rope_freq: NoPE and RoPE layers mixed with dense and MoE layers are not modelled by vtrain yet"),
    (dict(no_rope_freq=4, window_size=(8, 0), window_attn_skip_freq=2),
     "model.no_rope_freq: NoPE and RoPE layers mixed with windowed and full-attention layers are not modelled "
     "by vtrain yet"),
])
def test_bad_nope_fields_are_refused_in_one_line(fields, message):
    with pytest.raises(ConfigError) as err:
        spec(**fields)
    assert str(err.value) == message
